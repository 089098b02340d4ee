//! Rows ahead in a zero-page space: the mapper lifts the zero page off a row's addresses before
//! it maps fresh pages there, and lays it back when it gives a row up unpublished. The zero
//! mappings stay the tables' (`Backing::Zero`): lent to the mapper while it holds the row, given
//! back by laying the zero page again, or consumed ([`Mapping::disown`]) when a grow publishes
//! the row. See "Zero page" in `kv/ahead.rs`.

use std::sync::Arc;

use strata_vmm::{record_deferred, Access, DevicePtr, Location, Mapping, PhysicalMemory};
use strata_vmm::{Backend, Reservation, Result, Stream};

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
