//! Giving pages up: segments released, the cache emptied, pages unmapped
//! ([`unmap_pages`]) and their VA returned to the arena. A page whose unmap failed may still be
//! mapped, so it is quarantined and its VA stays taken for good (`stuck_va`).

use parking_lot::MutexGuard;
use strata_vmm::{process_is_exiting, Error, Result};

use super::Guard;
use super::{
    human_size, internal, stats, BlockState, CachedRun, CachingAllocator, State, StreamHandle,
};
use crate::mapped::{unmap_pages, MappedPage};
use crate::pool::Page;

impl CachingAllocator {
    /// Unmaps pages with the lock held (sleep, wake), keeping the first error.
    pub(super) fn unmap_into(
        &self,
        st: &mut State,
        mapped: Vec<MappedPage>,
        out: &mut Vec<Page>,
        first_err: &mut Option<Error>,
    ) {
        st.totals.counts.unmap_calls += mapped.len() as u64;
        if let Err(stuck) = unmap_pages(&self.pool, mapped, out) {
            first_err.get_or_insert(stuck.into_error(&mut self.stuck_va.lock()));
        }
    }

    /// Returns arena pages `start..start + len` to the arena, except pages whose unmap failed
    /// (`stuck_va`): those may still be mapped, so they stay taken for good.
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

    /// Removes a segment with no live block: its blocks leave the bins and the table. Returns
    /// its range, still taken in the arena, and its mapped pages (empty if asleep): the caller
    /// unmaps them after synchronizing, then frees the range.
    pub(super) fn release_segment(
        &self,
        st: &mut State,
        id: u32,
    ) -> Result<((u64, u64), Vec<MappedPage>)> {
        let live = st.segment_live(id);
        if live != 0 {
            return Err(internal(format!(
                "segment {id} released with {live} live blocks"
            )));
        }
        let seg = st.segments[id as usize]
            .take()
            .ok_or_else(|| internal(format!("segment {id} released twice")))?;
        st.free_segments.push(id);
        let blocks = &st.blocks;
        let bins = &mut st.tags[seg.tag as usize].bins;
        let mut classes: Vec<u16> = seg.runs.iter().map(|r| r.class).collect();
        classes.sort_unstable();
        classes.dedup();
        for class in classes {
            bins[class as usize].retain(|b| blocks[b as usize].segment != id);
        }
        for &b in &seg.blocks {
            let ptr = st.blocks[b as usize].ptr;
            st.by_ptr.remove(&ptr);
            let blk = &mut st.blocks[b as usize];
            blk.state = BlockState::Dead;
            blk.used_on = Vec::new();
            st.free_ids.push(b);
        }
        for r in &seg.runs {
            st.freed.record(
                self.va_of(seg.start) + r.offset,
                r.len,
                self.classes.size(r.class as usize),
            );
        }
        self.uncount_mapped(st, seg.tag as usize, &seg.mapped);
        st.totals.counts.segments_released += 1;
        Ok(((seg.start, seg.pages), seg.mapped))
    }

    /// Releases segment `id` with the lock held throughout (sleep, wake, asleep segments):
    /// its pages are unmapped into `out` (its streams already synchronized), then its range
    /// returns to the arena.
    pub(super) fn release_segment_now(
        &self,
        st: &mut State,
        id: u32,
        out: &mut Vec<Page>,
        first_err: &mut Option<Error>,
    ) -> Result<()> {
        let ((start, pages), mapped) = self.release_segment(st, id)?;
        self.unmap_into(st, mapped, out, first_err);
        self.free_va(st, start, pages)
    }

    /// Empties the cache (see [`CachingAllocator::empty_cache`]). Under the lock: completed
    /// pending frees are recycled, whole free pages cut out of large segments into the cache,
    /// the streams that may touch cached pages synchronized, and
    /// every cached run and empty segment taken out of the tables (their blocks out of the
    /// bins), their ranges held in flight. With the lock dropped: unmap and release. Under the
    /// lock again: the ranges return to the arena. Pages an in-flight grower will publish are
    /// in no table yet, so they are never touched.
    pub(super) fn release_cached(&self, guard: &mut Guard<'_>) -> Result<u64> {
        let st = &mut **guard;
        st.absorb_caches();
        self.poll_pending(st)?;
        self.cut_free_pages(st, None, None);
        let runs: Vec<(u64, CachedRun<Vec<MappedPage>>)> = st
            .cache
            .starts_smallest_first()
            .into_iter()
            .filter_map(|s| st.cache.remove(s).map(|r| (s, r)))
            .collect();
        let segs = st.empty_segments(true);
        let mut streams: Vec<StreamHandle> = runs.iter().map(|(_, r)| r.stream).collect();
        for &id in &segs {
            if let Some(seg) = &st.segments[id as usize] {
                streams.extend(seg.blocks.iter().map(|&b| st.blocks[b as usize].stream));
            }
        }
        if let Err(e) = self.sync_streams(st, streams) {
            for (s, r) in runs {
                st.cache.insert(s, r);
            }
            return Err(e);
        }
        let mut mapped = Vec::new();
        let mut ranges = Vec::new();
        for (start, run) in runs {
            self.uncount_mapped(st, run.tag as usize, &run.payload);
            mapped.extend(run.payload);
            ranges.push((start, run.pages));
        }
        for id in segs {
            let (range, pages) = self.release_segment(st, id)?;
            mapped.extend(pages);
            ranges.push(range);
        }
        // Segments of sleeping tags emptied while asleep hold only VA.
        let mut unmapped = Vec::new();
        let mut first_err = None;
        for id in st.empty_segments(false) {
            self.release_segment_now(st, id, &mut unmapped, &mut first_err)?;
        }
        self.pool.release(unmapped);
        let count = mapped.len() as u64;
        let id = st.inflight.begin(None, None, ranges, count);
        let released = MutexGuard::unlocked(guard, || {
            let mut pages = Vec::with_capacity(mapped.len());
            let unmapped = unmap_pages(&self.pool, mapped, &mut pages)
                .map_err(|stuck| stuck.into_error(&mut self.stuck_va.lock()));
            self.pool.release(pages);
            unmapped
        });
        let st = &mut **guard;
        st.totals.counts.unmap_calls += count;
        self.settle(st, id, false)?;
        released?;
        first_err.map_or(Ok(count * self.page), Err)
    }
}

impl Drop for CachingAllocator {
    fn drop(&mut self) {
        let exiting = process_is_exiting();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        st.absorb_caches();
        st.caches.clear();
        if self.report_leaks && st.totals.live > 0 && !exiting {
            let live = Self::live_of(st);
            let bytes: u64 = live.iter().map(|a| a.size).sum();
            let mut msg = format!(
                "strata: CachingAllocator on device {} dropped with {} live allocations ({}):\n",
                self.device,
                live.len(),
                human_size(bytes)
            );
            stats::write_allocations(&mut msg, live.iter());
            eprint!("{msg}");
        }
        if exiting {
            // No driver calls once exit began: the owners below leak instead.
            return;
        }
        let mut streams: Vec<StreamHandle> = st
            .blocks
            .iter()
            .filter(|b| b.state != BlockState::Dead)
            .map(|b| b.stream)
            .collect();
        streams.extend(st.blocks.iter().flat_map(|b| b.used_on.iter().copied()));
        streams.extend(st.cache.iter().map(|(_, r)| r.stream));
        streams.extend(st.large.values().map(|s| s.stream));
        streams.sort_unstable();
        streams.dedup();
        for s in streams {
            let _ = self.backend.stream_synchronize(s);
        }
        st.pending.clear();
        let mut mapped: Vec<MappedPage> = Vec::new();
        for seg in st.segments.iter_mut().flatten() {
            mapped.append(&mut seg.mapped);
        }
        for seg in st.large.values_mut() {
            mapped.append(&mut seg.mapped);
        }
        for s in st.cache.starts_smallest_first() {
            if let Some(mut r) = st.cache.remove(s) {
                mapped.append(&mut r.payload);
            }
        }
        let mut pages = Vec::with_capacity(mapped.len());
        for MappedPage { mapping, page } in mapped {
            if let Err(e) = mapping.unmap() {
                strata_vmm::record_deferred(e);
            }
            pages.push(page);
        }
        self.pool.give(pages);
    }
}
