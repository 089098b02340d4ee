//! One owner for "pool pages mapped behind a VA range".
//!
//! - [`PageLease`]: pages taken from (or adopted by) a [`PagePool`] that go back to it when
//!   dropped, with the pool's counters: to the free list ([`Return::Give`]) or to the driver
//!   ([`Return::Release`]). A lease made by [`PageLease::lend`] counts its pages as lent to a
//!   peer (`PoolStats::lent`) for as long as it holds them.
//! - [`MappedRun`]: a lease whose pages are mapped back to back at `va` inside a reservation,
//!   one mapping per page, with one `set_access` over the whole run. Building one is all or
//!   nothing: on an error every page mapped so far is unmapped and every page returns to its
//!   pool. Dropping one unmaps every page, then returns every page the same way; a page whose
//!   unmap failed is quarantined ([`PagePool::quarantine`]: it may still be mapped, so it is
//!   neither reused nor released).
//!
//! Callers that keep pages in tables of their own (the caching allocator recycles pages one by
//! one, a KV space maps pages per slot, the tier store per object) build a run and take its
//! pages out with [`MappedRun::into_mapped_pages`], or map [`MappedPage`]s themselves; from
//! then on the pool counters are theirs to keep, and they unmap with [`unmap_pages`] (or
//! [`MappedPage::unmap_or_quarantine`]), which quarantines a page whose unmap failed.

use std::sync::Arc;

use strata_vmm::{Access, DevicePtr, Error, Location, Mapping, Reservation, Result};

use crate::pool::{Page, PagePool};

mod migrate;
mod unmap;

pub use migrate::Migrated;
pub use unmap::{unmap_pages, StillMapped};

/// Where leased pages go when their owner drops them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Return {
    /// Back on the pool's free list (reused without a driver call).
    #[default]
    Give,
    /// Released to the driver (the memory returns to the device, e.g. a lender's).
    Release,
}

/// Pool pages owned as one: they go back to `pool` (per [`Return`]) when dropped.
pub struct PageLease {
    pool: Arc<PagePool>,
    pages: Vec<Page>,
    on_drop: Return,
    /// The pages are counted lent by the pool while this lease holds them.
    lent: bool,
}

impl PageLease {
    /// Takes `n` pages from `pool` (all or none).
    pub fn take(pool: &Arc<PagePool>, n: usize) -> Result<PageLease> {
        let pages = pool.take(n)?;
        Ok(PageLease::from_pages(pool, pages))
    }

    /// Takes `n` pages of `pool` to lend to a peer device: counted in `PoolStats::lent` until
    /// they leave the lease.
    pub fn lend(pool: &Arc<PagePool>, n: usize) -> Result<PageLease> {
        let mut lease = PageLease::take(pool, n)?;
        pool.mark_lent(n, true);
        lease.lent = true;
        Ok(lease)
    }

    /// Owns `pages`, already counted in use by `pool` (taken or adopted there).
    pub fn from_pages(pool: &Arc<PagePool>, pages: Vec<Page>) -> PageLease {
        PageLease {
            pool: Arc::clone(pool),
            pages,
            on_drop: Return::Give,
            lent: false,
        }
    }

    /// An empty lease of `pool` (pages join with [`PageLease::push`]).
    pub fn empty(pool: &Arc<PagePool>) -> PageLease {
        PageLease::from_pages(pool, Vec::new())
    }

    /// Where the pages go on drop (default: [`Return::Give`]).
    pub fn returning(mut self, on_drop: Return) -> PageLease {
        self.on_drop = on_drop;
        self
    }

    /// Adds a page counted in use by this lease's pool.
    pub fn push(&mut self, page: Page) {
        self.pages.push(page);
    }

    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    pub fn pages(&self) -> &[Page] {
        &self.pages
    }

    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Hands the pages to the caller, still counted in use by the pool (no longer lent).
    pub fn into_pages(mut self) -> Vec<Page> {
        self.take_pages()
    }

    /// Moves every page out (uncounting them as lent).
    fn take_pages(&mut self) -> Vec<Page> {
        let pages = std::mem::take(&mut self.pages);
        self.unlend(pages.len());
        pages
    }

    /// `n` pages left this lease: a lent lease stops counting them as lent.
    fn unlend(&self, n: usize) {
        if self.lent && n > 0 {
            self.pool.mark_lent(n, false);
        }
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        let pages = self.take_pages();
        match self.on_drop {
            Return::Give => self.pool.give(pages),
            Return::Release => self.pool.release(pages),
        }
    }
}

impl std::fmt::Debug for PageLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLease")
            .field("device", &self.pool.device())
            .field("pages", &self.pages.len())
            .field("on_drop", &self.on_drop)
            .field("lent", &self.lent)
            .finish()
    }
}

/// One pool page mapped at one VA. Field order matters: the mapping unmaps before the page
/// goes.
#[derive(Debug)]
pub struct MappedPage {
    pub mapping: Mapping,
    pub page: Page,
}

impl MappedPage {
    /// Unmaps the page and hands it back, still counted in use by its pool. When the driver
    /// refuses, the page may still be mapped: it is quarantined ([`PagePool::quarantine`]:
    /// never reused, never released), its mapping leaked with it (so its reservation is never
    /// freed under it), and the error comes back with the address that stays mapped.
    pub fn unmap_or_quarantine(self, pool: &PagePool) -> Result<Page, (DevicePtr, Error)> {
        let MappedPage { mapping, page } = self;
        match mapping.try_unmap() {
            Ok(_) => Ok(page),
            Err((still_mapped, e)) => {
                let va = still_mapped.va();
                std::mem::forget(still_mapped);
                pool.quarantine(page);
                Err((va, e))
            }
        }
    }
}

/// Pool pages mapped back to back at `va`; unmapped and returned to their pool on drop.
pub struct MappedRun {
    /// `mappings[i]` maps `lease.pages()[i]` at `va + i * page_size`.
    mappings: Vec<Mapping>,
    lease: PageLease,
    va: DevicePtr,
}

impl MappedRun {
    /// Takes `n` pages of `pool` and maps them at `va` inside `reservation` (see
    /// [`MappedRun::map`]).
    pub fn take(
        pool: &Arc<PagePool>,
        reservation: &Arc<Reservation>,
        va: DevicePtr,
        n: usize,
        grants: &[(Location, Access)],
    ) -> Result<MappedRun> {
        MappedRun::map(PageLease::take(pool, n)?, reservation, va, grants)
    }

    /// Maps the lease's pages back to back at `va` inside `reservation` and, when `grants` is
    /// non-empty, sets access over the whole run in one call. On an error the pages mapped so
    /// far are unmapped and every page goes back per the lease's [`Return`].
    pub fn map(
        lease: PageLease,
        reservation: &Arc<Reservation>,
        va: DevicePtr,
        grants: &[(Location, Access)],
    ) -> Result<MappedRun> {
        let page_size = lease.pool.page_size();
        let n = lease.len() as u64;
        let size = n
            .checked_mul(page_size)
            .ok_or(Error::Overflow("mapped run size"))?;
        if !reservation.contains(va, size) {
            return Err(Error::NotReserved { va, size });
        }
        let mut run = MappedRun {
            mappings: Vec::with_capacity(lease.len()),
            lease,
            va,
        };
        // On any `?` below, `run` drops: what is mapped unmaps, every page returns.
        for (i, page) in run.lease.pages.iter().enumerate() {
            let at = va + i as u64 * page_size;
            let phys = Arc::clone(page.phys());
            run.mappings
                .push(Mapping::new(reservation, at, phys, 0, page_size, &[])?);
        }
        if !grants.is_empty() && n > 0 {
            reservation.backend().set_access(va, size, grants)?;
        }
        Ok(run)
    }

    /// Where pages go on drop (default: [`Return::Give`]).
    pub fn returning(mut self, on_drop: Return) -> MappedRun {
        self.lease.on_drop = on_drop;
        self
    }

    /// First byte of the run.
    pub fn va(&self) -> DevicePtr {
        self.va
    }

    /// Bytes mapped.
    pub fn size(&self) -> u64 {
        self.mappings.len() as u64 * self.lease.pool.page_size()
    }

    /// Pages mapped.
    pub fn len(&self) -> usize {
        self.mappings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mappings.is_empty()
    }

    /// The pages, in VA order.
    pub fn pages(&self) -> &[Page] {
        self.lease.pages()
    }

    pub fn pool(&self) -> &Arc<PagePool> {
        self.lease.pool()
    }

    /// Hands the mapped pages to the caller (still mapped, still counted in use by the pool,
    /// no longer lent):
    /// for owners that keep and recycle pages one by one.
    pub fn into_mapped_pages(mut self) -> Vec<MappedPage> {
        let mappings = std::mem::take(&mut self.mappings);
        let pages = self.lease.take_pages();
        mappings
            .into_iter()
            .zip(pages)
            .map(|(mapping, page)| MappedPage { mapping, page })
            .collect()
    }

    /// Owns pages mapped back to back from `va` again (the inverse of
    /// [`MappedRun::into_mapped_pages`]): each page still counted in use by its home pool
    /// (see [`Page`]), `pool` the run's own (its page size; where pages without another home
    /// return). Pages not mapped at `va + i * page_size`, one page each, are handed back with
    /// [`Error::InvalidArgument`], untouched.
    #[allow(clippy::result_large_err)]
    pub fn from_mapped_pages(
        pool: &Arc<PagePool>,
        va: DevicePtr,
        pages: Vec<MappedPage>,
    ) -> std::result::Result<MappedRun, (Vec<MappedPage>, Error)> {
        let page_size = pool.page_size();
        let misplaced = pages.iter().enumerate().any(|(i, m)| {
            m.mapping.va() != va + i as u64 * page_size
                || m.mapping.size() != page_size
                || !Arc::ptr_eq(m.mapping.phys(), m.page.phys())
        });
        if misplaced {
            let e = Error::InvalidArgument(format!(
                "pages given as a run at {va:#x} are not mapped back to back there"
            ));
            return Err((pages, e));
        }
        let (mappings, pages): (Vec<Mapping>, Vec<Page>) =
            pages.into_iter().map(|m| (m.mapping, m.page)).unzip();
        Ok(MappedRun {
            mappings,
            lease: PageLease::from_pages(pool, pages),
            va,
        })
    }

    /// Unmaps every page now and hands them to the caller, still counted in use by the pool.
    /// On an unmap error every page is still unmapped or released, and the first error is
    /// returned (the pages whose unmap succeeded went back to the pool).
    pub fn unmap(mut self) -> Result<Vec<Page>> {
        let first = self.unmap_all();
        match first {
            None => Ok(self.lease.take_pages()),
            Some(e) => Err(e),
        }
    }

    /// Unmaps every mapping; a page whose unmap failed leaves the lease for quarantine
    /// ([`PagePool::quarantine`]: never reused, never released, since it may still be mapped)
    /// and its mapping is leaked with it. Returns the first error.
    fn unmap_all(&mut self) -> Option<Error> {
        let mut first = None;
        let mut failed = Vec::new();
        for (i, mapping) in std::mem::take(&mut self.mappings).into_iter().enumerate() {
            if let Err((still_mapped, e)) = mapping.try_unmap() {
                std::mem::forget(still_mapped);
                first.get_or_insert(e);
                failed.push(i);
            }
        }
        if !failed.is_empty() {
            self.lease.unlend(failed.len());
            for i in failed.into_iter().rev() {
                let page = self.lease.pages.remove(i);
                self.lease.pool.quarantine(page);
            }
        }
        first
    }
}

impl Drop for MappedRun {
    fn drop(&mut self) {
        if strata_vmm::process_is_exiting() {
            // No driver calls once exit began: the mappings leak.
            std::mem::forget(std::mem::take(&mut self.mappings));
            return;
        }
        if let Some(e) = self.unmap_all() {
            strata_vmm::record_deferred(e);
        }
        // The lease drops next and returns the pages.
    }
}

impl std::fmt::Debug for MappedRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MappedRun({:#x}+{:#x} of device {}, {:?})",
            self.va,
            self.size(),
            self.lease.pool.device(),
            self.lease.on_drop
        )
    }
}
