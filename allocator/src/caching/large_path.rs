//! The large path on segments (`large.rs`): allocation (a free extent of the stream's
//! segments, else a new segment from a cached run or from growth), freeing (extents merge; a
//! wholly free segment joins the cache), and cutting whole free pages out of segments into the
//! cache (for growth, `empty_cache` and sleep).

use strata_vmm::{DevicePtr, Error, Result, StreamHandle};

use super::grow::VaChoice;
use super::large::{self, whole_pages, LargeSegment, LARGE_ALIGN};
use super::Guard;
use super::{
    internal, Block, BlockState, CachedRun, CachingAllocator, MappedPage, State, TagId, LARGE,
    NO_SEGMENT,
};

impl CachingAllocator {
    /// Large sizes: the best-fitting free extent of a segment of `stream`, else a new segment
    /// (a cached run split to size, else pages mapped behind a new VA range). Mid sizes try a
    /// bigger segment first (see [`large::segment_pages`]) and fall back to the fewest pages
    /// when that one does not fit.
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
        let ti = guard.ensure_tag(tag, self.classes.len());
        self.wait_while_moving(&mut guard, ti);
        let st = &mut *guard;
        if st.tags[ti].asleep() {
            return Err(Error::InvalidState(format!("tag {tag} is asleep")));
        }
        if let Some(limit) = st.limit {
            // Past the limit only onto the tag's overflow pool.
            let overflows = st.tags[ti].overflow.is_some();
            if pages.checked_mul(self.page).is_none_or(|b| b > limit) && !overflows {
                st.totals.counts.ooms += 1;
                return Err(Error::LimitExceeded {
                    requested: size,
                    used: st.device_pages() * self.page,
                    limit,
                });
            }
        }
        if pages > self.arena_pages {
            return Err(self.oom(st, size));
        }
        // Cannot overflow: `pages` pages fit in the arena.
        let len = size.div_ceil(LARGE_ALIGN) * LARGE_ALIGN;
        if !st.pending.is_empty() {
            self.poll_pending(st)?;
        }
        if let Some(addr) = st.extents.best_fit(ti as u32, stream, len) {
            let avail = st
                .extents
                .remove(addr)
                .ok_or_else(|| internal("best-fit extent vanished".into()))?;
            st.totals.counts.cache_hits += 1;
            return self.place_large(st, ti, addr, avail, len, size, stream);
        }
        let want = large::segment_pages(len, self.page, st.totals.mapped_pages);
        let tries: &[u64] = if want > pages {
            &[want, pages]
        } else {
            &[pages]
        };
        for &n in tries {
            let st = &mut *guard;
            if let Some(start) = st.cache.best_fit(ti as u32, n) {
                let run = st
                    .cache
                    .take_head(start, n)
                    .ok_or_else(|| Error::InvalidState("cache best fit vanished".into()))?;
                if run.stream != stream {
                    if let Err(e) = self.order_after(st, run.stream, stream) {
                        st.cache.insert(start, run);
                        return Err(e);
                    }
                }
                st.totals.counts.cache_hits += 1;
                return self.new_large_segment(st, ti, start, n, run.payload, len, size, stream);
            }
        }
        if let Some(ptr) = self.extend_large(&mut guard, ti, len, size, stream)? {
            return Ok(ptr);
        }
        // A new segment of the fewest pages, with room after it to grow in place.
        let room = large::segment_pages(len, self.page, u64::MAX);
        let (start, mapped) =
            self.grow_run_in(&mut guard, ti, VaChoice::WithRoom(room), pages, size)?;
        let st = &mut *guard;
        self.count_mapped(st, ti, &mapped);
        st.totals.counts.cache_misses += 1;
        st.totals.counts.mappings_created += 1;
        self.new_large_segment(st, ti, start, pages, mapped, len, size, stream)
    }

    /// Grows a segment of tag index `ti` and `stream` in place when the pages after it are free
    /// in the arena: the fewest new pages that, joined to its free tail, hold `len` bytes
    /// (expandable segments: blocks share pages without reserving a big segment up front).
    /// Returns the block, or `None` when no segment can grow (or, after a race while the lock
    /// was dropped, the new pages cannot hold it: they are then cached).
    #[cold]
    #[inline(never)]
    fn extend_large(
        &self,
        guard: &mut Guard<'_>,
        ti: usize,
        len: u64,
        requested: u64,
        stream: StreamHandle,
    ) -> Result<Option<DevicePtr>> {
        let Some((end, more)) = self.growable_segment(guard, ti, len, stream) else {
            return Ok(None);
        };
        let (start, mapped) = self.grow_run_in(guard, ti, VaChoice::At(end), more, requested)?;
        let st = &mut **guard;
        self.count_mapped(st, ti, &mapped);
        st.totals.counts.cache_misses += 1;
        st.totals.counts.mappings_created += 1;
        // The segment may have been cut or cached while the lock was dropped: join whatever of
        // this tag and stream ends here, else stand alone.
        let joined = st
            .large
            .range(..start)
            .next_back()
            .filter(|(&s, seg)| {
                s + seg.pages == start
                    && seg.tag == ti as u32
                    && seg.stream == stream
                    && !seg.mapped.is_empty()
            })
            .map(|(&s, _)| s);
        let first = match joined.and_then(|s| st.large.get_mut(&s).map(|seg| (s, seg))) {
            Some((s, seg)) => {
                seg.pages += more;
                seg.mapped.extend(mapped);
                s
            }
            None => {
                let seg = LargeSegment {
                    pages: more,
                    tag: ti as u32,
                    stream,
                    mapped,
                };
                st.large.insert(start, seg);
                start
            }
        };
        let bounds = (self.va_of(first), self.va_of(start + more));
        let (addr, avail) = st.extents.insert(
            self.va_of(start),
            more * self.page,
            bounds,
            ti as u32,
            stream,
        );
        if avail >= len {
            st.extents.remove(addr);
            return self
                .place_large(st, ti, addr, avail, len, requested, stream)
                .map(Some);
        }
        if (addr, avail) == (bounds.0, bounds.1 - bounds.0) {
            self.cache_free_segment(st, first)?;
        }
        Ok(None)
    }

    /// The segment of tag index `ti` and `stream` that needs the fewest new pages after it
    /// (free in the arena) to hold `len` bytes with its free tail: (its end page, new pages).
    fn growable_segment(
        &self,
        st: &State,
        ti: usize,
        len: u64,
        stream: StreamHandle,
    ) -> Option<(u64, u64)> {
        st.large
            .iter()
            .filter(|(_, seg)| {
                seg.tag == ti as u32 && seg.stream == stream && !seg.mapped.is_empty()
            })
            .filter_map(|(&s, seg)| {
                let end = s + seg.pages;
                let tail = st
                    .extents
                    .ending_at(self.va_of(end), self.va_of(s))
                    .map_or(0, |(_, l)| l);
                let more = (len - tail.min(len)).div_ceil(self.page);
                (more > 0 && st.va.is_free(end, more)).then_some((more, end))
            })
            .min()
            .map(|(more, end)| (end, more))
    }

    /// Publishes a segment of `pages` pages at arena page `start` for `stream` and places a
    /// block of `len` bytes at its start.
    #[allow(clippy::too_many_arguments)]
    fn new_large_segment(
        &self,
        st: &mut State,
        ti: usize,
        start: u64,
        pages: u64,
        mapped: Vec<MappedPage>,
        len: u64,
        requested: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        st.large.insert(
            start,
            LargeSegment {
                pages,
                tag: ti as u32,
                stream,
                mapped,
            },
        );
        let addr = self.va_of(start);
        self.place_large(st, ti, addr, pages * self.page, len, requested, stream)
    }

    /// Places a live block of `len` bytes at `addr`, the start of `avail` free bytes (out of
    /// the extent index) of a segment; the rest stays free.
    #[allow(clippy::too_many_arguments)]
    fn place_large(
        &self,
        st: &mut State,
        ti: usize,
        addr: u64,
        avail: u64,
        len: u64,
        requested: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        if avail > len {
            let (start, seg) = self
                .segment_at(st, addr)
                .ok_or_else(|| internal(format!("no large segment at {addr:#x}")))?;
            let bounds = (self.va_of(start), self.va_of(start + seg.pages));
            let (tag, s) = (seg.tag, seg.stream);
            st.extents.insert(addr + len, avail - len, bounds, tag, s);
        }
        st.freed.invalidate(addr, len);
        let id = st.new_block(Block {
            ptr: addr,
            size: len,
            requested,
            tag: ti as u32,
            segment: NO_SEGMENT,
            class: LARGE,
            counter: 0,
            state: BlockState::Live,
            stream,
            used_on: Vec::new(),
        });
        st.by_ptr.insert(addr, id);
        let settle =
            st.tags[ti].totals.on_alloc(requested, len) | st.totals.on_alloc(requested, len);
        st.totals.counts.large_allocs += 1;
        if settle {
            st.settle_peaks(ti);
        }
        Ok(addr)
    }

    /// The segment holding `addr`: (first page, segment).
    pub(super) fn segment_at<'a>(
        &self,
        st: &'a State,
        addr: u64,
    ) -> Option<(u64, &'a LargeSegment<Vec<MappedPage>>)> {
        let page = self.page_of(addr);
        st.large
            .range(..=page)
            .next_back()
            .filter(|(&s, seg)| page < s + seg.pages)
            .map(|(&s, seg)| (s, seg))
    }

    /// `len` bytes at `addr` of a segment become free; a segment left wholly free joins the
    /// cache (or, while its tag sleeps, its VA returns to the arena).
    pub(super) fn free_large(&self, st: &mut State, addr: u64, len: u64) -> Result<()> {
        let (start, seg) = self
            .segment_at(st, addr)
            .ok_or_else(|| internal(format!("freed large block {addr:#x} has no segment")))?;
        let (lo, hi) = (self.va_of(start), self.va_of(start + seg.pages));
        if addr + len > hi {
            return Err(internal(format!(
                "large block {addr:#x} overruns its segment"
            )));
        }
        if (addr, len) == (lo, hi - lo) {
            // The block was the whole segment (no extent to merge with).
            return self.cache_segment(st, start);
        }
        let (tag, stream) = (seg.tag, seg.stream);
        let (s, l) = st.extents.insert(addr, len, (lo, hi), tag, stream);
        if (s, l) != (lo, hi - lo) {
            return Ok(());
        }
        self.cache_free_segment(st, start)
    }

    /// Moves the wholly free segment at page `start` (one extent) out of the segment table:
    /// its pages join the cache (or, while its tag sleeps, its VA returns to the arena).
    fn cache_free_segment(&self, st: &mut State, start: u64) -> Result<()> {
        st.extents.remove(self.va_of(start));
        self.cache_segment(st, start)
    }

    /// Moves the segment at page `start`, with no block and no extent left, out of the table.
    fn cache_segment(&self, st: &mut State, start: u64) -> Result<()> {
        let seg = st
            .large
            .remove(&start)
            .ok_or_else(|| internal("large segment vanished".into()))?;
        if seg.mapped.is_empty() {
            self.free_va(st, start, seg.pages)
        } else {
            st.cache.insert(
                start,
                CachedRun {
                    pages: seg.pages,
                    tag: seg.tag,
                    stream: seg.stream,
                    payload: seg.mapped,
                },
            );
            Ok(())
        }
    }

    /// Whole free pages inside mapped segments (of tag index `tag`, or of every awake tag).
    pub(super) fn cuttable_pages(&self, st: &State, tag: Option<u32>) -> u64 {
        st.extents
            .with_whole_pages(self.page)
            .into_iter()
            .filter(|&(s, _)| self.may_cut(st, s, tag))
            .map(|(s, l)| whole_pages(s, l, self.page).1)
            .sum()
    }

    fn may_cut(&self, st: &State, extent: u64, tag: Option<u32>) -> bool {
        st.extents
            .owner(extent)
            .is_some_and(|(t, _)| tag.is_none_or(|want| want == t) && !st.tags[t as usize].asleep())
    }

    /// Cuts whole free pages out of mapped segments (largest extents first) into the cache,
    /// splitting the segments around them, until `need` pages moved (`None`: all of them),
    /// for tag index `tag` or every awake tag. Returns the pages moved.
    pub(super) fn cut_free_pages(
        &self,
        st: &mut State,
        need: Option<u64>,
        tag: Option<u32>,
    ) -> u64 {
        let mut moved = 0;
        for (s, l) in st.extents.with_whole_pages(self.page) {
            if need.is_some_and(|n| moved >= n) {
                break;
            }
            if !self.may_cut(st, s, tag) {
                continue;
            }
            let (first, n) = whole_pages(s, l, self.page);
            let Some((start, _)) = self.segment_at(st, s) else {
                continue;
            };
            let Some(seg) = st.large.remove(&start) else {
                continue;
            };
            st.extents.remove(s);
            let (h0, h1, end) = (
                self.page_of(first),
                self.page_of(first) + n,
                start + seg.pages,
            );
            let mut mapped = seg.mapped;
            let right = mapped.split_off((h1 - start) as usize);
            let hole = mapped.split_off((h0 - start) as usize);
            let (tag_ix, stream) = (seg.tag, seg.stream);
            let part = |pages, mapped| LargeSegment {
                pages,
                tag: tag_ix,
                stream,
                mapped,
            };
            if h0 > start {
                st.large.insert(start, part(h0 - start, mapped));
                if first > s {
                    let bounds = (self.va_of(start), self.va_of(h0));
                    st.extents.insert(s, first - s, bounds, tag_ix, stream);
                }
            }
            if end > h1 {
                st.large.insert(h1, part(end - h1, right));
                let tail = self.va_of(h1);
                if s + l > tail {
                    let bounds = (tail, self.va_of(end));
                    st.extents
                        .insert(tail, s + l - tail, bounds, tag_ix, stream);
                }
            }
            st.cache.insert(
                h0,
                CachedRun {
                    pages: n,
                    tag: tag_ix,
                    stream,
                    payload: hole,
                },
            );
            moved += n;
        }
        moved
    }
}
