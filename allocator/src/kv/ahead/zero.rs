//! The mapper's driver work ([`super`]): mapping a job's rows and unmapping rows it gives
//! up, and the zero-page swaps around both.
//!
//! Rows ahead in a zero-page space: the mapper lifts the zero page off a row's addresses before
//! it maps fresh pages there, and lays it back when it gives a row up unpublished. The zero
//! mappings stay the tables' (`Backing::Zero`): lent to the mapper while it holds the row, given
//! back by laying the zero page again, or consumed ([`Mapping::disown`]) when a grow publishes
//! the row. See "Zero page" in `kv/ahead`.

use std::sync::Arc;

use strata_vmm::{record_deferred, Access, DevicePtr, Location, Mapping, PhysicalMemory};
use strata_vmm::{Backend, Reservation, Result, Stream};

use super::{Job, Row, Shared};
use crate::mapped::{unmap_pages, MappedRun, PageLease};
use crate::pool::Page;

/// Driver calls the swaps made (the mapper's counters).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ZeroCalls {
    pub(super) map: u64,
    pub(super) unmap: u64,
    pub(super) set_access: u64,
}

/// The zero page of a space and where it is mapped, with the mapper's stream that zero-fills
/// the fresh pages it maps (so a row ahead reads zeros, as the zero page did, once its job
/// landed).
pub(super) struct ZeroPage {
    pub(super) phys: Arc<PhysicalMemory>,
    pub(super) location: Location,
    pub(super) page: u64,
    pub(super) stream: Stream,
}

impl ZeroPage {
    /// Zero-fills the `bytes` at each of `runs` (mapped read-write) and waits for it.
    pub(super) fn fill(
        &self,
        backend: &Arc<dyn Backend>,
        runs: impl Iterator<Item = DevicePtr>,
        bytes: u64,
    ) -> Result<()> {
        for va in runs {
            backend.memset_async(self.stream.handle(), va, 0, bytes)?;
        }
        self.stream.synchronize()
    }

    /// Unmaps the zero page from the `n` pages at `va` (one mapping each). All or nothing: on
    /// failure the pages lifted so far get it back.
    pub(super) fn lift(
        &self,
        reservation: &Arc<Reservation>,
        va: DevicePtr,
        n: usize,
        calls: &mut ZeroCalls,
    ) -> Result<()> {
        let backend = reservation.backend();
        for i in 0..n {
            calls.unmap += 1;
            if let Err(e) = backend.unmap(va + i as u64 * self.page, self.page) {
                if let Err(undo) = self.lay(reservation, va, i, calls) {
                    record_deferred(undo);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Maps the zero page behind the `n` unmapped pages at `va`, then grants read access over
    /// the run in one call. The mappings are the tables' again, so the handles are disowned.
    /// Goes on after an error and returns the first one.
    pub(super) fn lay(
        &self,
        reservation: &Arc<Reservation>,
        va: DevicePtr,
        n: usize,
        calls: &mut ZeroCalls,
    ) -> Result<()> {
        let mut first_err = None;
        for i in 0..n {
            let at = va + i as u64 * self.page;
            calls.map += 1;
            match Mapping::new(reservation, at, Arc::clone(&self.phys), 0, self.page, &[]) {
                Ok(mapping) => mapping.disown(),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if first_err.is_none() && n > 0 {
            calls.set_access += 1;
            let grants = [(self.location, Access::Read)];
            if let Err(e) = reservation
                .backend()
                .set_access(va, n as u64 * self.page, &grants)
            {
                first_err = Some(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Lays the zero page behind `vas` (unmapped page addresses of one tensor, any order), one
    /// run of consecutive pages at a time; errors are recorded.
    pub(super) fn lay_all(
        &self,
        reservation: &Arc<Reservation>,
        mut vas: Vec<DevicePtr>,
        calls: &mut ZeroCalls,
    ) {
        vas.sort_unstable();
        let mut k = 0;
        while k < vas.len() {
            let mut n = 1;
            while k + n < vas.len() && vas[k + n] == vas[k] + n as u64 * self.page {
                n += 1;
            }
            if let Err(e) = self.lay(reservation, vas[k], n, calls) {
                record_deferred(e);
            }
            k += n;
        }
    }
}

impl Shared {
    /// Takes the job's pages and maps them at its rows' addresses, read-write, one run per
    /// tensor with one `set_access` (lifting the zero page off each run first); all or nothing
    /// (a failed run's pages and every run built so far go back to the pool unmapped, with the
    /// zero page laid back behind every run it was lifted from).
    pub(super) fn map_rows(&self, job: Job, zero: &mut ZeroCalls) -> Result<Vec<Row>> {
        let tensors = self.reservations.len();
        let mut pages = self.pool.take(job.rows * tensors)?;
        let leases: Vec<PageLease> = (0..tensors)
            .map(|_| PageLease::from_pages(&self.pool, pages.split_off(pages.len() - job.rows)))
            .collect();
        let grants = [(self.location, Access::ReadWrite)];
        let mut runs = Vec::with_capacity(tensors);
        for ((t, reservation), lease) in self.reservations.iter().enumerate().zip(leases) {
            let va = self.va(t, job.slot, job.row);
            let mapped = match &self.zero {
                Some(z) => z.lift(reservation, va, job.rows, zero).and_then(|()| {
                    MappedRun::map(lease, reservation, va, &grants).inspect_err(|_| {
                        self.lay_zero(t, job, zero);
                    })
                }),
                None => MappedRun::map(lease, reservation, va, &grants),
            };
            match mapped {
                Ok(run) => runs.push(run),
                Err(e) => {
                    let built = runs.len();
                    drop(runs);
                    (0..built).for_each(|t| self.lay_zero(t, job, zero));
                    return Err(e);
                }
            }
        }
        if let Some(z) = &self.zero {
            // A row ahead reads zeros like the zero page it replaced (on failure `runs` drop,
            // unmapping their pages, and the zero page goes back).
            let vas = (0..tensors).map(|t| self.va(t, job.slot, job.row));
            let bytes = job.rows as u64 * self.page;
            if let Err(e) = z.fill(self.reservations[0].backend(), vas, bytes) {
                drop(runs);
                (0..tensors).for_each(|t| self.lay_zero(t, job, zero));
                return Err(e);
            }
        }
        let mut columns: Vec<_> = runs
            .into_iter()
            .map(|run| run.into_mapped_pages().into_iter())
            .collect();
        Ok((0..job.rows)
            .map(|_| {
                columns
                    .iter_mut()
                    .map(|c| c.next().expect("a page per row in every tensor"))
                    .collect()
            })
            .collect())
    }

    /// Lays the zero page back behind `job`'s rows in tensor `t` (a space without one: no-op).
    fn lay_zero(&self, t: usize, job: Job, calls: &mut ZeroCalls) {
        if let Some(z) = &self.zero {
            let va = self.va(t, job.slot, job.row);
            if let Err(e) = z.lay(&self.reservations[t], va, job.rows, calls) {
                record_deferred(e);
            }
        }
    }

    /// Unmaps `rows`, gives their pages back to the pool and lays the zero page (if any) back
    /// behind them; errors are recorded. Returns the zero page's driver calls.
    pub(super) fn release(&self, rows: Vec<Row>) -> ZeroCalls {
        let mut calls = ZeroCalls::default();
        let vas: Vec<Vec<DevicePtr>> = match &self.zero {
            Some(_) => (0..self.reservations.len())
                .map(|t| rows.iter().map(|row| row[t].mapping.va()).collect())
                .collect(),
            None => Vec::new(),
        };
        let mut returned: Vec<Page> = Vec::new();
        if let Err(stuck) = unmap_pages(&self.pool, rows.into_iter().flatten(), &mut returned) {
            record_deferred(stuck.first);
        }
        if !returned.is_empty() {
            self.pool.give(returned);
        }
        if let Some(z) = &self.zero {
            for (reservation, vas) in self.reservations.iter().zip(vas) {
                z.lay_all(reservation, vas, &mut calls);
            }
        }
        calls
    }
}
