//! Moving a mapped run onto other physical pages at the same VA ([`MappedRun::migrate`]).
//!
//! The steps, each leaving the run as it was when it fails:
//! 1. take the destination pages and map them at a staging VA of their own;
//! 2. order the copy after the caller's fences on the caller's stream, copy the run into the
//!    staging mapping (a backend copy, never the CPU), and synchronize the stream: from then on
//!    nothing in flight touches the range;
//! 3. unmap the staging mapping, then the run's own pages (last first), then map the
//!    destination pages at the run's VA with the run's grants;
//! 4. hand the source pages back to their pool.
//!
//! Step 3 is the only one with a window in which the run's VA is not backed by its pages;
//! [`Unmapped`] owns that window and maps the source pages back when dropped before commit.

use std::sync::Arc;

use strata_vmm::{
    copy_async_in, Access, CopyDesc, CopyKind, CopyScope, DevicePtr, Error, Event, Location,
    Mapping, Reservation, Result, StreamHandle,
};

use super::{MappedRun, PageLease};
use crate::pool::PagePool;

/// What one migration moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migrated {
    /// The run's VA (unchanged).
    pub va: DevicePtr,
    /// Bytes copied (the run's size).
    pub bytes: u64,
    /// Where the pages were (their memory's location: a peer's for borrowed pages).
    pub from: Location,
    /// Where they are now.
    pub to: Location,
}

impl MappedRun {
    /// Moves the run onto pages of `to` at the same VA: the data and the address stay, the
    /// physical memory (and so the speed of access) changes. `grants` are the run's access
    /// grants (re-applied at the VA, and used for the staging mapping: they must give the
    /// device of `stream` access). The copy is queued on `stream` after every event of
    /// `after` (work recorded at free/record_stream time that may still touch the range), and
    /// the stream is synchronized before the VA is remapped. Work queued after this call began
    /// must not touch the range until it returns.
    ///
    /// On any error the run keeps its old pages mapped with its grants, its data intact, and
    /// every destination page is back in `to`. Should mapping the old pages back fail as well
    /// (a second failure), that error is recorded as deferred and the run keeps its pages,
    /// some of them unmapped.
    pub fn migrate(
        &mut self,
        to: &Arc<PagePool>,
        stream: StreamHandle,
        after: &[&Event],
        grants: &[(Location, Access)],
    ) -> Result<Migrated> {
        let page_size = self.pool().page_size();
        if to.page_size() != page_size {
            return Err(Error::InvalidArgument(format!(
                "migration between pages of {page_size} and {} bytes",
                to.page_size()
            )));
        }
        let moved = Migrated {
            va: self.va,
            bytes: self.size(),
            from: self
                .pages()
                .first()
                .map_or(self.pool().location(), |p| p.phys().location()),
            to: to.location(),
        };
        let Some(reservation) = self.mappings.first().map(|m| Arc::clone(m.reservation())) else {
            return Ok(moved);
        };
        let backend = Arc::clone(reservation.backend());
        let staging_va = Arc::new(Reservation::new(&backend, moved.bytes, 0)?);
        let staging = MappedRun::take(to, &staging_va, staging_va.ptr(), self.len(), grants)?;
        for event in after {
            backend.stream_wait_event(stream, event.handle())?;
        }
        let copy = CopyDesc {
            dst: staging.va(),
            src: self.va,
            len: moved.bytes,
        };
        let scope = CopyScope {
            buffers: &[],
            reservations: &[&reservation, &staging_va],
        };
        let copied = copy_async_in(&backend, stream, CopyKind::Batch(&[copy]), scope);
        // Even when the submission reported an error, nothing may still be writing the staging
        // pages when they unmap.
        let synced = backend.stream_synchronize(stream);
        copied?;
        synced?;

        let landed = PageLease::from_pages(to, staging.unmap()?);
        let window = Unmapped::open(self, &reservation, grants)?;
        let replacement = MappedRun::map(landed, &reservation, moved.va, grants)?;
        window.commit(replacement);
        Ok(moved)
    }
}

/// A run whose pages are being unmapped from its VA: `run.mappings` holds the pages still
/// mapped (a prefix of `run.lease.pages`). Dropped before [`Unmapped::commit`], it maps the
/// others back at their VAs and re-applies the grants.
struct Unmapped<'r> {
    run: &'r mut MappedRun,
    reservation: &'r Arc<Reservation>,
    grants: &'r [(Location, Access)],
}

impl<'r> Unmapped<'r> {
    /// Unmaps every page of `run`, last first.
    fn open(
        run: &'r mut MappedRun,
        reservation: &'r Arc<Reservation>,
        grants: &'r [(Location, Access)],
    ) -> Result<Unmapped<'r>> {
        let window = Unmapped {
            run,
            reservation,
            grants,
        };
        while let Some(mapping) = window.run.mappings.pop() {
            if let Err((still_mapped, e)) = mapping.try_unmap() {
                window.run.mappings.push(still_mapped);
                return Err(e);
            }
        }
        Ok(window)
    }

    /// The destination run is mapped at the VA: it replaces the old one, whose pages (all
    /// unmapped now) go back to their pool.
    fn commit(self, replacement: MappedRun) {
        let mut this = std::mem::ManuallyDrop::new(self);
        let old = std::mem::replace(&mut *this.run, replacement);
        drop(old);
    }

    #[cold]
    fn map_back(&mut self) -> Result<()> {
        let page_size = self.run.pool().page_size();
        let first = self.run.mappings.len();
        let total = self.run.lease.len();
        for i in first..total {
            let at = self.run.va + i as u64 * page_size;
            let phys = Arc::clone(self.run.lease.pages()[i].phys());
            let mapping = Mapping::new(self.reservation, at, phys, 0, page_size, &[])?;
            self.run.mappings.push(mapping);
        }
        if first < total && !self.grants.is_empty() {
            let at = self.run.va + first as u64 * page_size;
            let len = (total - first) as u64 * page_size;
            self.reservation
                .backend()
                .set_access(at, len, self.grants)?;
        }
        Ok(())
    }
}

impl Drop for Unmapped<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.map_back() {
            strata_vmm::record_deferred(e);
        }
    }
}
