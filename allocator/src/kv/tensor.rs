//! One K or V tensor: its reservation and the backing of each of its pages.

use std::sync::Arc;

use strata_vmm::{
    Access, Backend, DevicePtr, Error, Location, Mapping, PhysicalMemory, Reservation, Result,
};

use crate::mapped::{unmap_pages, MappedPage};
use crate::pool::{Page, PagePool};

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Counters {
    pub(super) pages_mapped: u64,
    pub(super) pages_unmapped_total: u64,
    pub(super) pages_mapped_total: u64,
    pub(super) map_calls: u64,
    pub(super) unmap_calls: u64,
    pub(super) set_access_calls: u64,
}

pub(super) enum Backing {
    Unmapped,
    Zero(Mapping),
    /// A pool page: unmapped with [`unmap_pages`], so a page whose unmap failed is quarantined.
    Real(MappedPage),
}

/// What the per-tensor helpers need from the space (borrowed apart from the tensors).
pub(super) struct Env<'a> {
    pub(super) pool: &'a PagePool,
    pub(super) backend: &'a Arc<dyn Backend>,
    pub(super) location: Location,
    pub(super) page: u64,
    pub(super) zero: Option<&'a Arc<PhysicalMemory>>,
}

pub(super) struct Tensor {
    pub(super) reservation: Arc<Reservation>,
    pub(super) pages: Vec<Backing>,
}

impl Tensor {
    pub(super) fn va(&self, index: usize, page: u64) -> DevicePtr {
        self.reservation.ptr() + index as u64 * page
    }

    /// Backs pages `from..to` with pool pages popped from `spare` (unmapping the zero page
    /// first), then grants read-write access over the whole run in one call. On failure the
    /// run is left part-backed for [`Tensor::unback`]; a page that failed to map is back in `spare`.
    pub(super) fn back_real(
        &mut self,
        from: usize,
        to: usize,
        spare: &mut Vec<Page>,
        env: &Env<'_>,
        c: &mut Counters,
    ) -> Result<()> {
        for i in from..to {
            let va = self.va(i, env.page);
            match std::mem::replace(&mut self.pages[i], Backing::Unmapped) {
                Backing::Unmapped => {}
                Backing::Zero(mapping) => {
                    c.unmap_calls += 1;
                    mapping.unmap()?;
                }
                real @ Backing::Real(..) => {
                    self.pages[i] = real;
                    return Err(Error::InvalidState(format!(
                        "kv page {va:#x} is already backed"
                    )));
                }
            }
            let page = spare
                .pop()
                .ok_or_else(|| Error::InvalidState("kv grow ran out of taken pages".into()))?;
            match Mapping::new(
                &self.reservation,
                va,
                Arc::clone(page.phys()),
                0,
                env.page,
                &[],
            ) {
                Ok(mapping) => {
                    c.map_calls += 1;
                    c.pages_mapped += 1;
                    c.pages_mapped_total += 1;
                    self.pages[i] = Backing::Real(MappedPage { mapping, page });
                }
                Err(e) => {
                    spare.push(page);
                    return Err(e);
                }
            }
        }
        if to > from {
            c.set_access_calls += 1;
            env.backend.set_access(
                self.va(from, env.page),
                (to - from) as u64 * env.page,
                &[(env.location, Access::ReadWrite)],
            )?;
        }
        Ok(())
    }

    /// Takes the pool pages of `from..to` out of the table (their slots become unmapped).
    pub(super) fn take_real(&mut self, from: usize, to: usize) -> Vec<MappedPage> {
        let mut taken = Vec::new();
        for backing in &mut self.pages[from..to] {
            if let Backing::Real(..) = backing {
                if let Backing::Real(mapped) = std::mem::replace(backing, Backing::Unmapped) {
                    taken.push(mapped);
                }
            }
        }
        taken
    }

    /// Unmaps the pool pages of `from..to` into `returned` ([`unmap_pages`]: a page whose unmap
    /// failed is quarantined, never back to the free list), then, with a zero page, maps it
    /// behind every unmapped page of the run and grants read access over the run in one call.
    /// Goes on after an error and returns the first one.
    pub(super) fn unback(
        &mut self,
        from: usize,
        to: usize,
        returned: &mut Vec<Page>,
        env: &Env<'_>,
        c: &mut Counters,
    ) -> Result<()> {
        let mut first_err = None;
        let taken = self.take_real(from, to);
        let n = taken.len() as u64;
        c.unmap_calls += n;
        c.pages_mapped -= n;
        c.pages_unmapped_total += n;
        if let Err(stuck) = unmap_pages(env.pool, taken, returned) {
            first_err = Some(stuck.first);
        }
        if let Some(zero) = env.zero {
            let mut all_mapped = true;
            for i in from..to {
                if let Backing::Unmapped = self.pages[i] {
                    let va = self.va(i, env.page);
                    match Mapping::new(&self.reservation, va, Arc::clone(zero), 0, env.page, &[]) {
                        Ok(mapping) => {
                            c.map_calls += 1;
                            self.pages[i] = Backing::Zero(mapping);
                        }
                        Err(e) => {
                            all_mapped = false;
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
            if all_mapped && to > from {
                c.set_access_calls += 1;
                if let Err(e) = env.backend.set_access(
                    self.va(from, env.page),
                    (to - from) as u64 * env.page,
                    &[(env.location, Access::Read)],
                ) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
