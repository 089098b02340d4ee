//! Unmapping pages the caching allocator gives up, and returning their VA to the arena: a page
//! whose unmap failed may still be mapped, so it is quarantined and its VA stays taken for good.

use parking_lot::Mutex;
use strata_vmm::{DevicePtr, Error, Result};

use super::grow::DriverCalls;
use super::{internal, CachingAllocator, State};
use crate::mapped::MappedPage;
use crate::pool::{Page, PagePool};

/// Unmaps pages (one mapping each) into `out`, all of them; returns the first error. A page
/// whose unmap failed may still be mapped: it goes to quarantine in `pool` (its home's
/// counters), never into `out`, its mapping is leaked, and its address joins `stuck` so that
/// its VA is never handed out again.
pub(super) fn unmap_pages(
    pool: &PagePool,
    mapped: Vec<MappedPage>,
    out: &mut Vec<Page>,
    calls: &mut DriverCalls,
    stuck: &Mutex<Vec<DevicePtr>>,
) -> Result<()> {
    let mut first_err = None;
    for MappedPage { mapping, page } in mapped {
        calls.unmap += 1;
        match mapping.try_unmap() {
            Ok(_) => out.push(page),
            Err((still_mapped, e)) => {
                stuck.lock().push(still_mapped.va());
                std::mem::forget(still_mapped);
                first_err.get_or_insert(e);
                pool.quarantine(page);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

impl CachingAllocator {
    /// Unmaps pages with the lock held (sleep, wake), keeping the first error.
    pub(super) fn unmap_into(
        &self,
        st: &mut State,
        mapped: Vec<MappedPage>,
        out: &mut Vec<Page>,
        first_err: &mut Option<Error>,
    ) {
        let mut calls = DriverCalls::default();
        if let Err(e) = unmap_pages(&self.pool, mapped, out, &mut calls, &self.stuck_va) {
            first_err.get_or_insert(e);
        }
        calls.add_to(&mut st.totals.counts);
    }

    /// Returns arena pages `start..start + len` to the arena, except pages whose unmap failed
    /// ([`unmap_pages`]): those may still be mapped, so they stay taken for good.
    pub(super) fn free_va(&self, st: &mut State, start: u64, len: u64) -> Result<()> {
        st.va.free(start, len).map_err(internal)?;
        let mut stuck = self.stuck_va.lock();
        if !stuck.is_empty() {
            let mut kept = Ok(());
            stuck.retain(|&ptr| {
                let page = self.page_of(ptr);
                if !(start..start + len).contains(&page) {
                    return true;
                }
                if st.va.alloc_at(page, 1) {
                    st.stuck_pages.push(page);
                } else {
                    kept = Err(internal(format!("stuck arena page {page} not free")));
                }
                false
            });
            kept?;
        }
        Ok(())
    }
}
