//! The slow paths of allocation: new runs of small blocks (in shared pages or segments), whole-page runs (cache hits by split,
//! misses by mapping cached and pool pages behind a new VA range), and where pages come from
//! and go to.

use std::sync::Arc;

use strata_vmm::{Access, DevicePtr, Error, Location, Mapping, Result, StreamHandle};

use super::{
    internal, Block, BlockState, CachedRun, CachingAllocator, Carve, MappedPage, Segment, State,
    TagId, LARGE, NO_SEGMENT,
};
use crate::pool::Page;

impl CachingAllocator {
    /// Small allocation when the bin of `stream` is empty: completed pending frees, blocks
    /// freed on other streams (ordered by an event), then a new segment.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_small_slow(
        &self,
        st: &mut State,
        size: u64,
        class: usize,
        stream: StreamHandle,
        tag: TagId,
    ) -> Result<DevicePtr> {
        let ti = st.ensure_tag(tag, self.classes.len());
        if st.tags[ti].asleep {
            return Err(Error::InvalidState(format!("tag {tag} is asleep")));
        }
        if !st.pending.is_empty() {
            self.poll_pending(st)?;
            if let Some(ptr) = st.pop_small(tag, class, size, stream) {
                st.totals.counts.cache_hits += 1;
                return Ok(ptr);
            }
        }
        let others = st.tags[ti].bins[class].other_streams(stream);
        if !others.is_empty() {
            for other in others {
                self.order_after(st, other, stream)?;
                st.tags[ti].bins[class].adopt(other, stream);
            }
            let State { tags, blocks, .. } = &mut *st;
            for (s, id) in tags[ti].bins[class].iter() {
                blocks[id as usize].stream = s;
            }
        }
        if let Some(ptr) = st.pop_small(tag, class, size, stream) {
            st.totals.counts.cache_hits += 1;
            return Ok(ptr);
        }
        self.grow_small(st, ti, class, size, stream)?;
        st.totals.counts.cache_misses += 1;
        st.pop_small(tag, class, size, stream)
            .ok_or_else(|| Error::InvalidState("new small segment has no block".into()))
    }

    /// Carves a new run of blocks of `class` under tag index `ti` (in a shared page of the tag
    /// with room, else a new one; a segment of its own for classes above a page); its blocks
    /// join `stream`'s bin.
    #[cold]
    #[inline(never)]
    pub(super) fn grow_small(
        &self,
        st: &mut State,
        ti: usize,
        class: usize,
        requested: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let (seg_id, offset, len) = match self.classes.run_chunks(class) {
            Some(chunks) => {
                let len = chunks * self.classes.chunk_size();
                match self.find_room(st, ti, len) {
                    Some((id, offset)) => (id, offset, len),
                    None => (self.new_segment(st, ti, 1, true, requested)?, 0, len),
                }
            }
            None => {
                let pages = self.classes.segment_pages(class);
                let id = self.new_segment(st, ti, pages, false, requested)?;
                (id, 0, pages * self.page)
            }
        };
        self.carve(st, seg_id, offset, len, class, stream);
        Ok(())
    }

    /// The first shared page of tag index `ti` with `len` free bytes: (segment, offset).
    fn find_room(&self, st: &State, ti: usize, len: u64) -> Option<(u32, u64)> {
        st.iter_segments()
            .filter(|(_, s)| s.shared && s.tag as usize == ti && !s.mapped.is_empty())
            .find_map(|(id, s)| {
                let mut at = 0;
                for r in &s.runs {
                    if r.offset - at >= len {
                        return Some((id, at));
                    }
                    at = r.offset + r.len;
                }
                (s.pages * self.page - at >= len).then_some((id, at))
            })
    }

    /// Maps a new segment of `pages` pages, with no blocks yet, under tag index `ti`.
    fn new_segment(
        &self,
        st: &mut State,
        ti: usize,
        pages: u64,
        shared: bool,
        requested: u64,
    ) -> Result<u32> {
        let got = self.obtain_pages(st, pages, requested)?;
        let Some(start) = st.va.alloc(pages) else {
            self.pool.give(got);
            return Err(self.oom(st, requested));
        };
        let mapped = match self.map_run(st, start, got) {
            Ok(m) => m,
            Err(e) => {
                let _ = st.va.free(start, pages);
                return Err(e);
            }
        };
        st.freed.invalidate(self.va_of(start), pages * self.page);
        let seg_id = match st.free_segments.pop() {
            Some(id) => id,
            None => {
                st.segments.push(None);
                (st.segments.len() - 1) as u32
            }
        };
        st.segments[seg_id as usize] = Some(Segment {
            start,
            pages,
            shared,
            runs: Vec::new(),
            tag: ti as u32,
            blocks: Vec::new(),
            live: 0,
            mapped,
        });
        st.totals.add_pages(pages);
        st.tags[ti].totals.mapped_pages += pages;
        st.totals.counts.segments_created += 1;
        Ok(seg_id)
    }

    /// Cuts `len` bytes at `offset` of segment `seg_id` into blocks of `class`, freed on
    /// `stream` (lowest address pops first).
    fn carve(
        &self,
        st: &mut State,
        seg_id: u32,
        offset: u64,
        len: u64,
        class: usize,
        stream: StreamHandle,
    ) {
        let Some(seg) = st.segments[seg_id as usize].as_ref() else {
            return;
        };
        let (base, ti) = (self.va_of(seg.start) + offset, seg.tag);
        let class_bytes = self.classes.size(class);
        let count = len / class_bytes;
        let mut ids = Vec::with_capacity(count as usize);
        for i in 0..count {
            let ptr = base + i * class_bytes;
            let id = st.new_block(Block {
                ptr,
                size: class_bytes,
                requested: 0,
                tag: ti,
                segment: seg_id,
                class: class as u16,
                state: BlockState::Free,
                stream,
                used_on: Vec::new(),
                pages: Vec::new(),
            });
            st.by_ptr.insert(ptr, id);
            ids.push(id);
        }
        let bin = &mut st.tags[ti as usize].bins[class];
        for &id in ids.iter().rev() {
            bin.push(stream, id);
        }
        if let Some(seg) = st.segments[seg_id as usize].as_mut() {
            let carve = Carve {
                offset,
                len,
                class: class as u16,
            };
            let at = seg.runs.partition_point(|r| r.offset < offset);
            seg.runs.insert(at, carve);
            seg.blocks.extend(ids);
        }
    }

    /// Whole pages: a cached run (split to size), else pages from the cache and the pool
    /// mapped behind a new VA range.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_large(
        &self,
        size: u64,
        stream: StreamHandle,
        tag: TagId,
    ) -> Result<DevicePtr> {
        let pages = size / self.page + u64::from(size % self.page != 0);
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let ti = st.ensure_tag(tag, self.classes.len());
        if st.tags[ti].asleep {
            return Err(Error::InvalidState(format!("tag {tag} is asleep")));
        }
        if let Some(limit) = st.limit {
            if pages.checked_mul(self.page).is_none_or(|b| b > limit) {
                st.totals.counts.ooms += 1;
                return Err(Error::LimitExceeded {
                    requested: size,
                    used: st.totals.mapped_pages * self.page,
                    limit,
                });
            }
        }
        if pages > self.arena_pages {
            return Err(self.oom(st, size));
        }
        if !st.pending.is_empty() {
            self.poll_pending(st)?;
        }
        if let Some(start) = st.cache.best_fit(ti as u32, pages) {
            let run = st
                .cache
                .take_head(start, pages)
                .ok_or_else(|| Error::InvalidState("cache best fit vanished".into()))?;
            if run.stream != stream {
                if let Err(e) = self.order_after(st, run.stream, stream) {
                    st.cache.insert(start, run);
                    return Err(e);
                }
            }
            st.totals.counts.cache_hits += 1;
            return Ok(self.install_large(st, ti, start, pages, size, stream, run.payload));
        }
        let got = self.obtain_pages(st, pages, size)?;
        let Some(start) = st.va.alloc(pages) else {
            self.pool.give(got);
            return Err(self.oom(st, size));
        };
        let mapped = match self.map_run(st, start, got) {
            Ok(m) => m,
            Err(e) => {
                let _ = st.va.free(start, pages);
                return Err(e);
            }
        };
        st.totals.add_pages(pages);
        st.tags[ti].totals.mapped_pages += pages;
        st.totals.counts.cache_misses += 1;
        st.totals.counts.mappings_created += 1;
        Ok(self.install_large(st, ti, start, pages, size, stream, mapped))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn install_large(
        &self,
        st: &mut State,
        ti: usize,
        start: u64,
        pages: u64,
        requested: u64,
        stream: StreamHandle,
        mapped: Vec<MappedPage>,
    ) -> DevicePtr {
        let ptr = self.va_of(start);
        let size = pages * self.page;
        st.freed.invalidate(ptr, size);
        let id = st.new_block(Block {
            ptr,
            size,
            requested,
            tag: ti as u32,
            segment: NO_SEGMENT,
            class: LARGE,
            state: BlockState::Live,
            stream,
            used_on: Vec::new(),
            pages: mapped,
        });
        st.by_ptr.insert(ptr, id);
        st.tags[ti].totals.on_alloc(requested, size);
        st.totals.on_alloc(requested, size);
        st.totals.counts.large_allocs += 1;
        ptr
    }

    /// `n` pages to map: unmapped cached pages first (so reserved memory does not grow while
    /// cached pages sit idle), then the pool. All or nothing.
    #[cold]
    #[inline(never)]
    pub(super) fn obtain_pages(&self, st: &mut State, n: u64, requested: u64) -> Result<Vec<Page>> {
        let empty: u64 = st
            .empty_segments(true)
            .iter()
            .filter_map(|&i| st.segments[i as usize].as_ref())
            .map(|s| s.pages)
            .sum();
        let reclaimable = st.cache.pages() + empty;
        let fresh = n.saturating_sub(reclaimable);
        if let Some(limit) = st.limit {
            let after = st
                .totals
                .mapped_pages
                .checked_add(fresh)
                .and_then(|p| p.checked_mul(self.page));
            if after.is_none_or(|a| a > limit) {
                st.totals.counts.ooms += 1;
                return Err(Error::LimitExceeded {
                    requested,
                    used: st.totals.mapped_pages * self.page,
                    limit,
                });
            }
        }
        if fresh
            .checked_mul(self.page)
            .is_none_or(|b| b > self.device_total)
            && fresh > self.device_total / self.page + self.pool.stats().free as u64
        {
            // Hopeless: fail before the pool creates (and drops) a device's worth of pages.
            return Err(self.oom(st, requested));
        }
        let mut pages = if fresh > 0 {
            let count = usize::try_from(fresh).map_err(|_| Error::Overflow("page count"))?;
            match self.pool.take(count) {
                Ok(p) => p,
                Err(e) => {
                    if e.is_out_of_memory() {
                        st.totals.counts.ooms += 1;
                    }
                    return Err(e);
                }
            }
        } else {
            Vec::new()
        };
        if n > fresh {
            if let Err(e) = self.reclaim(st, n - fresh, &mut pages) {
                self.pool.give(pages);
                return Err(e);
            }
        }
        if pages.len() as u64 > n {
            let extra = pages.split_off(n as usize);
            self.pool.give(extra);
        }
        Ok(pages)
    }

    /// Unmaps at least `need` cached pages (smallest cached runs first, then empty small
    /// segments) after synchronizing the streams that may touch them; adds them to `out`.
    pub(super) fn reclaim(&self, st: &mut State, need: u64, out: &mut Vec<Page>) -> Result<()> {
        let mut remaining = need;
        let mut runs = Vec::new();
        for start in st.cache.starts_smallest_first() {
            if remaining == 0 {
                break;
            }
            let Some(have) = st.cache.get(start).map(|r| r.pages) else {
                continue;
            };
            let k = have.min(remaining);
            if let Some(taken) = st.cache.take_tail(start, k) {
                remaining -= k;
                runs.push(taken);
            }
        }
        let mut segs = Vec::new();
        if remaining > 0 {
            for id in st.empty_segments(true) {
                if remaining == 0 {
                    break;
                }
                if let Some(seg) = &st.segments[id as usize] {
                    remaining = remaining.saturating_sub(seg.pages);
                    segs.push(id);
                }
            }
        }
        let mut streams: Vec<StreamHandle> = runs.iter().map(|(_, r)| r.stream).collect();
        for &id in &segs {
            if let Some(seg) = &st.segments[id as usize] {
                streams.extend(seg.blocks.iter().map(|&b| st.blocks[b as usize].stream));
            }
        }
        if let Err(e) = self.sync_streams(st, streams) {
            for (start, run) in runs {
                st.cache.insert(start, run);
            }
            return Err(e);
        }
        let mut first_err = None;
        for (start, run) in runs {
            st.totals.sub_pages(run.pages);
            st.tags[run.tag as usize].totals.mapped_pages -= run.pages;
            st.totals.counts.pages_recycled += run.pages;
            self.unmap_into(st, run.payload, out, &mut first_err);
            st.va.free(start, run.pages).map_err(internal)?;
        }
        for id in segs {
            let mapped = self.release_segment(st, id)?;
            st.totals.counts.pages_recycled += mapped.len() as u64;
            self.unmap_into(st, mapped, out, &mut first_err);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Unmaps pages (one mapping each), keeping the first error.
    pub(super) fn unmap_into(
        &self,
        st: &mut State,
        mapped: Vec<MappedPage>,
        out: &mut Vec<Page>,
        first_err: &mut Option<Error>,
    ) {
        for MappedPage { mapping, page } in mapped {
            st.totals.counts.unmap_calls += 1;
            if let Err(e) = mapping.unmap() {
                first_err.get_or_insert(e);
            }
            out.push(page);
        }
    }

    /// Maps `pages` page by page at arena page `start` and grants access over the whole run
    /// in one call. On failure everything is undone and the pages go back to the pool.
    pub(super) fn map_run(
        &self,
        st: &mut State,
        start: u64,
        pages: Vec<Page>,
    ) -> Result<Vec<MappedPage>> {
        let base = self.va_of(start);
        let n = pages.len() as u64;
        let mut out: Vec<MappedPage> = Vec::with_capacity(pages.len());
        let mut rest = pages.into_iter();
        while let Some(page) = rest.next() {
            let va = base + out.len() as u64 * self.page;
            st.totals.counts.map_calls += 1;
            match Mapping::new(&self.arena, va, Arc::clone(page.phys()), 0, self.page, &[]) {
                Ok(mapping) => out.push(MappedPage { mapping, page }),
                Err(e) => {
                    let mut back = vec![page];
                    back.extend(rest);
                    back.extend(out.into_iter().map(|mp| mp.page));
                    self.pool.give(back);
                    return Err(e);
                }
            }
        }
        st.totals.counts.set_access_calls += 1;
        let grant = [(Location::Device(self.device), Access::ReadWrite)];
        if let Err(e) = self.backend.set_access(base, n * self.page, &grant) {
            self.pool.give(out.into_iter().map(|mp| mp.page).collect());
            return Err(e);
        }
        Ok(out)
    }

    /// Removes a segment with no live block: its blocks leave the bins and the table, its VA
    /// returns to the arena. Returns its mapped pages (empty if asleep) for the caller to
    /// unmap after synchronizing.
    pub(super) fn release_segment(&self, st: &mut State, id: u32) -> Result<Vec<MappedPage>> {
        let Some(seg) = st.segments[id as usize].take() else {
            return Ok(Vec::new());
        };
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
        st.va.free(seg.start, seg.pages).map_err(internal)?;
        if !seg.mapped.is_empty() {
            st.totals.sub_pages(seg.pages);
            st.tags[seg.tag as usize].totals.mapped_pages -= seg.pages;
        }
        st.totals.counts.segments_released += 1;
        Ok(seg.mapped)
    }

    pub(super) fn empty_cache_locked(&self, st: &mut State) -> Result<u64> {
        self.poll_pending(st)?;
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
        let mut pages = Vec::new();
        let mut first_err = None;
        for (start, run) in runs {
            st.totals.sub_pages(run.pages);
            st.tags[run.tag as usize].totals.mapped_pages -= run.pages;
            self.unmap_into(st, run.payload, &mut pages, &mut first_err);
            st.va.free(start, run.pages).map_err(internal)?;
        }
        for id in segs {
            let mapped = self.release_segment(st, id)?;
            self.unmap_into(st, mapped, &mut pages, &mut first_err);
        }
        // Segments of sleeping tags emptied while asleep hold only VA.
        for id in st.empty_segments(false) {
            self.release_segment(st, id)?;
        }
        let bytes = pages.len() as u64 * self.page;
        self.pool.release(pages);
        first_err.map_or(Ok(bytes), Err)
    }

    pub(super) fn oom(&self, st: &mut State, requested: u64) -> Error {
        st.totals.counts.ooms += 1;
        Error::OutOfMemory {
            location: Location::Device(self.device),
            requested,
            available: st.va.largest().saturating_mul(self.page),
        }
    }

    #[inline]
    pub(super) fn va_of(&self, page: u64) -> DevicePtr {
        self.arena.ptr() + page * self.page
    }

    #[inline]
    pub(super) fn page_of(&self, ptr: DevicePtr) -> u64 {
        (ptr - self.arena.ptr()) / self.page
    }
}
