//! Giving pages back: the retries of a take when the pool is out of memory, reclaiming deferred
//! slots, and unbacking runs of a slot (see "Deferred reclamation" in the module documentation).

use strata_vmm::{record_deferred, Error, Result};

use super::tensor::Env;
use super::{KvSpace, SlotState};
use crate::pool::Page;

impl KvSpace {
    /// Takes `n` pages. When the pool is out of memory, gives back the pages mapped ahead and
    /// retries, then reclaims deferred slots and retries once more.
    pub(super) fn take_pages(&mut self, n: usize) -> Result<Vec<Page>> {
        match self.pool.take(n) {
            Err(e) if e.is_out_of_memory() => {
                if self.release_ahead() {
                    if let Ok(pages) = self.pool.take(n) {
                        return Ok(pages);
                    }
                }
                if self.deferred.is_empty() {
                    return Err(e);
                }
                self.reclaim_pages(n);
                self.pool.take(n)
            }
            other => other,
        }
    }

    /// Reclaims whole deferred slots, longest parked first, until at least `target` pages went
    /// back to the pool or none is left. Returns the pages given back.
    pub(super) fn reclaim_pages(&mut self, target: usize) -> usize {
        let mut given = 0;
        while given < target {
            let Some(index) = self.deferred.pop_front() else {
                break;
            };
            given += self.reclaim_slot(index as usize);
        }
        given
    }

    /// Unbacks a deferred slot entirely and makes it free. Errors are recorded (surfaced by the
    /// next fallible vmm call) since the caller cannot act on them.
    fn reclaim_slot(&mut self, index: usize) -> usize {
        let mapped = self.slots[index].mapped;
        let given = match self.unback_slot(index, 0, mapped) {
            Ok(n) => n,
            Err((n, e)) => {
                record_deferred(e);
                n
            }
        };
        let slot = &mut self.slots[index];
        slot.mapped = 0;
        slot.state = SlotState::Free;
        self.free.push(index as u32);
        given
    }

    /// Unbacks pages `from..to` of slot `index` in every tensor and hands them to the pool (a
    /// page whose unmap failed is quarantined instead). Returns the number of pages given back
    /// (with the first error, if any).
    pub(super) fn unback_slot(
        &mut self,
        index: usize,
        from: usize,
        to: usize,
    ) -> std::result::Result<usize, (usize, Error)> {
        if to <= from {
            return Ok(0);
        }
        let base = index * self.pages_per_slot;
        let env = Env {
            pool: &self.pool,
            backend: &self.backend,
            location: self.location,
            page: self.page,
            zero: self.zero.as_ref(),
        };
        let mut returned = Vec::new();
        let mut first_err = None;
        for tensor in &mut self.tensors {
            if let Err(e) = tensor.unback(
                base + from,
                base + to,
                &mut returned,
                &env,
                &mut self.counters,
            ) {
                first_err.get_or_insert(e);
            }
        }
        let given = returned.len();
        if !returned.is_empty() {
            self.pool.give(returned);
        }
        match first_err {
            None => Ok(given),
            Some(e) => Err((given, e)),
        }
    }

    /// Unmaps the pages of every deferred slot and gives them back to the pool; returns how many.
    /// Errors are recorded and surfaced by the next fallible vmm call.
    pub fn reclaim_deferred(&mut self) -> usize {
        self.reclaim_pages(usize::MAX)
    }
}
