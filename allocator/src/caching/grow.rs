//! The slow paths of allocation: new runs of small blocks (in shared pages or segments), whole-page runs (cache hits by split,
//! misses by mapping cached and pool pages behind a new VA range), and where pages come from
//! and go to.
//!
//! Growth and `empty_cache` make their driver calls with the lock dropped (see `inflight.rs`):
//! under the lock they check the limit, pick the pages (cached ones leave the tables, after
//! the streams that may touch them are synchronized) and take the VA; outside it they unmap,
//! create, map, set access or release; under the lock again they publish or roll back.

use parking_lot::{Mutex, MutexGuard};
use strata_vmm::{Access, DevicePtr, Error, Location, Result, StreamHandle};

use super::unmap::unmap_pages;
use super::{
    internal, run_slot, AllocatorCounts, Block, BlockState, CachedRun, CachingAllocator, Carve,
    Segment, State, TagId, CHUNKS_PER_PAGE,
};
use crate::mapped::{MappedPage, MappedRun, PageLease};
use crate::pool::{Page, PagePool};

/// Where [`CachingAllocator::grow_run_in`] takes the new range's VA.
#[derive(Clone, Copy, Debug)]
pub(super) enum VaChoice {
    /// The smallest free range that holds it.
    BestFit,
    /// The smallest with this many free pages after it (room to grow in place), else best fit.
    WithRoom(u64),
    /// Exactly here (the caller checked that it is free, under the lock it still holds).
    At(u64),
}

/// The allocator's lock, held.
pub(super) type Guard<'a> = MutexGuard<'a, State>;

/// Driver calls made with the lock dropped, added to the counts once it is held again.
#[derive(Default)]
pub(super) struct DriverCalls {
    map: u64,
    pub(super) unmap: u64,
    set_access: u64,
}

impl DriverCalls {
    pub(super) fn add_to(&self, counts: &mut AllocatorCounts) {
        counts.map_calls += self.map;
        counts.unmap_calls += self.unmap;
        counts.set_access_calls += self.set_access;
    }
}

/// Pages on their way to a new mapping: `want` of them, all or none.
#[derive(Default)]
pub(super) struct Supply {
    want: u64,
    /// Cached pages out of the tables, still mapped at their old VA.
    mapped: Vec<MappedPage>,
    /// The old arena ranges of `mapped`, held until they are unmapped.
    ranges: Vec<(u64, u64)>,
    /// Pages already unmapped.
    ready: Vec<Page>,
    /// Pages to take from the pool.
    fresh: usize,
}

impl Supply {
    /// Pages held outside the tables (counted against the limit while in flight).
    fn pages(&self) -> u64 {
        (self.mapped.len() + self.ready.len() + self.fresh) as u64
    }

    /// Unmaps the cached pages and takes the fresh ones: `want` pages (extras go back to the
    /// pool), or none (all back to the pool) and the first error. Makes driver calls; the
    /// old ranges are the caller's to free.
    /// `overflow`: a pool (host memory, a peer's) whose pages stand in when `pool` is out of
    /// memory (a tag that allows overflow); they return to it wherever they are freed.
    fn gather(
        self,
        pool: &PagePool,
        overflow: Option<&PagePool>,
        calls: &mut DriverCalls,
        requested: u64,
        stuck: &Mutex<Vec<DevicePtr>>,
    ) -> Result<Vec<Page>> {
        let mut pages = self.ready;
        let unmapped = unmap_pages(pool, self.mapped, &mut pages, calls, stuck);
        // Cached pages of other pools (host memory of an offloaded tag) go home; a new mapping
        // gets the device's own pages in their place.
        let (mut pages, foreign): (Vec<Page>, Vec<Page>) =
            pages.into_iter().partition(|p| p.is_home(pool));
        let missing = self.fresh + foreign.len();
        pool.give(foreign);
        let fresh = unmapped.and_then(|()| match missing {
            0 => Ok(Vec::new()),
            n => match (pool.take(n), overflow) {
                (Err(e), Some(spill)) if e.is_out_of_memory() => spill.take(n),
                (got, _) => got,
            },
        });
        match fresh {
            Ok(fresh) => {
                pages.extend(fresh);
                if pages.len() as u64 > self.want {
                    pool.give(pages.split_off(self.want as usize));
                }
                Ok(pages)
            }
            Err(e) => {
                pool.give(pages);
                Err(for_request(e, requested))
            }
        }
    }
}

/// The pool's out-of-memory error (about the page it failed to create) restated for the
/// caller's whole request.
#[cold]
fn for_request(e: Error, requested: u64) -> Error {
    match e {
        Error::OutOfMemory {
            location,
            available,
            ..
        } => Error::OutOfMemory {
            location,
            requested,
            available,
        },
        e => e,
    }
}

impl CachingAllocator {
    /// Small allocation when the bin of `stream` is empty: completed pending frees, blocks
    /// freed on other streams (ordered by an event), then a new segment.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_small_slow(
        &self,
        guard: &mut Guard<'_>,
        size: u64,
        class: usize,
        stream: StreamHandle,
        tag: TagId,
    ) -> Result<DevicePtr> {
        let st = &mut **guard;
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
        self.grow_small(guard, ti, class, size, stream)?;
        let st = &mut **guard;
        st.totals.counts.cache_misses += 1;
        st.pop_small(tag, class, size, stream)
            .ok_or_else(|| Error::InvalidState("new small segment has no block".into()))
    }

    /// Carves a new run of blocks of `class` under tag index `ti` (in a shared page of the tag
    /// with room, else a new one; a segment of its own for classes above a page); its blocks
    /// join `stream`'s bin. A new segment's driver calls run with the lock dropped.
    #[cold]
    #[inline(never)]
    pub(super) fn grow_small(
        &self,
        guard: &mut Guard<'_>,
        ti: usize,
        class: usize,
        requested: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let (seg_id, offset, len) = match self.classes.run_chunks(class) {
            Some(chunks) => {
                let len = chunks * self.classes.chunk_size();
                let room = match self.find_room(guard, ti, len) {
                    None if self.reclaim_empty_runs(guard, ti, stream)? > 0 => {
                        self.find_room(guard, ti, len)
                    }
                    room => room,
                };
                match room {
                    Some((id, offset)) => (id, offset, len),
                    None => (self.new_segment(guard, ti, 1, true, requested)?, 0, len),
                }
            }
            None => {
                let pages = self.classes.segment_pages(class);
                let id = self.new_segment(guard, ti, pages, false, requested)?;
                (id, 0, pages * self.page)
            }
        };
        self.carve(guard, seg_id, offset, len, class, stream);
        Ok(())
    }

    /// Returns to their shared pages the runs of tag index `ti` whose blocks are all free, of
    /// any class, so that their chunks can serve another class. Emptied runs are found by their
    /// counts in `State::run_live`, without scanning blocks. Their blocks leave the bins and
    /// the table; streams that freed them are ordered before `stream`, which the chunks' next
    /// blocks are carved for. Returns the runs removed.
    fn reclaim_empty_runs(&self, st: &mut State, ti: usize, stream: StreamHandle) -> Result<usize> {
        let mut doomed: Vec<(u32, Carve)> = Vec::new();
        for (id, seg) in st.iter_segments() {
            if !seg.shared || seg.tag as usize != ti || seg.mapped.is_empty() {
                continue;
            }
            doomed.extend(
                seg.runs
                    .iter()
                    .filter(|r| st.run_live[run_slot(id, self.run_of(seg, r.offset)) as usize] == 0)
                    .map(|&r| (id, r)),
            );
        }
        if doomed.is_empty() {
            return Ok(0);
        }
        // The blocks of the doomed runs, found by address.
        let mut gone: Vec<u32> = Vec::new();
        for &(id, run) in &doomed {
            let Some(seg) = st.segments[id as usize].as_ref() else {
                continue;
            };
            let lo = self.va_of(seg.start) + run.offset;
            let class_bytes = self.classes.size(run.class as usize);
            for i in 0..run.len / class_bytes {
                match st.by_ptr.get(&(lo + i * class_bytes)) {
                    Some(&b) => gone.push(b),
                    None => return Err(internal(format!("run block {:#x} missing", lo))),
                }
            }
        }
        let mut streams: Vec<StreamHandle> = gone
            .iter()
            .map(|&b| st.blocks[b as usize].stream)
            .filter(|&s| s != stream)
            .collect();
        streams.sort_unstable();
        streams.dedup();
        for s in streams {
            self.order_after(st, s, stream)?;
        }
        for &b in &gone {
            let blk = &mut st.blocks[b as usize];
            st.by_ptr.remove(&blk.ptr);
            blk.state = BlockState::Dead;
            blk.used_on = Vec::new();
        }
        let mut classes: Vec<u16> = doomed.iter().map(|(_, r)| r.class).collect();
        classes.sort_unstable();
        classes.dedup();
        let State {
            tags,
            blocks,
            segments,
            freed,
            ..
        } = &mut *st;
        for class in classes {
            tags[ti].bins[class as usize].retain(|b| blocks[b as usize].state != BlockState::Dead);
        }
        for &(id, run) in &doomed {
            let Some(seg) = segments[id as usize].as_mut() else {
                continue;
            };
            seg.runs.retain(|r| r.offset != run.offset);
            seg.blocks
                .retain(|&b| blocks[b as usize].state != BlockState::Dead);
            freed.record(
                self.va_of(seg.start) + run.offset,
                run.len,
                self.classes.size(run.class as usize),
            );
        }
        st.free_ids.extend(gone);
        Ok(doomed.len())
    }

    /// The first chunk of a run at `offset` in `seg` (0 outside shared pages).
    #[inline]
    pub(super) fn run_of(&self, seg: &Segment, offset: u64) -> u8 {
        if seg.shared {
            (offset / self.classes.chunk_size()) as u8
        } else {
            0
        }
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
        guard: &mut Guard<'_>,
        ti: usize,
        pages: u64,
        shared: bool,
        requested: u64,
    ) -> Result<u32> {
        let (start, mapped) = self.grow_run(guard, ti, pages, requested)?;
        let st = &mut **guard;
        st.freed.invalidate(self.va_of(start), pages * self.page);
        let seg_id = match st.free_segments.pop() {
            Some(id) => id,
            None => {
                st.segments.push(None);
                st.run_live
                    .resize(st.segments.len() * CHUNKS_PER_PAGE as usize, 0);
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
        let counter = run_slot(seg_id, self.run_of(seg, offset));
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
                counter,
                state: BlockState::Free,
                stream,
                used_on: Vec::new(),
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

    /// Maps `pages` new pages for tag index `ti` behind a new arena range and returns the
    /// range's first page and its mappings, for the caller to publish under the lock it holds
    /// again. The driver calls (unmapping recycled cached pages, creating pool pages, map,
    /// set_access) run with the lock dropped, under an in-flight record of the range and the
    /// pages; on failure the record is rolled back and the pages return to the pool.
    #[cold]
    #[inline(never)]
    pub(super) fn grow_run(
        &self,
        guard: &mut Guard<'_>,
        ti: usize,
        pages: u64,
        requested: u64,
    ) -> Result<(u64, Vec<MappedPage>)> {
        self.grow_run_in(guard, ti, VaChoice::BestFit, pages, requested)
    }

    /// [`Self::grow_run`] with a say in where the range goes (see [`VaChoice`]).
    #[cold]
    #[inline(never)]
    pub(super) fn grow_run_in(
        &self,
        guard: &mut Guard<'_>,
        ti: usize,
        choice: VaChoice,
        pages: u64,
        requested: u64,
    ) -> Result<(u64, Vec<MappedPage>)> {
        let st = &mut **guard;
        let taken = match choice {
            VaChoice::BestFit => st.va.alloc(pages),
            VaChoice::WithRoom(room) => st.va.alloc_with_room(pages, room),
            VaChoice::At(start) => {
                if !st.va.alloc_at(start, pages) {
                    return Err(internal(format!("arena pages {start}+{pages} not free")));
                }
                Some(start)
            }
        };
        let (start, mut supply) = match taken {
            Some(start) => match self.reserve_supply(st, pages, requested) {
                Ok(supply) => (start, supply),
                Err(e) => {
                    self.free_va(st, start, pages)?;
                    return Err(e);
                }
            },
            None => {
                // Arena VA short (rare): gather with the lock held, so that the recycled
                // pages' old ranges can serve this request.
                let ready = self.gather_locked(st, pages, requested)?;
                let Some(start) = st.va.alloc(pages) else {
                    self.pool.give(ready);
                    return Err(self.oom(st, requested));
                };
                let supply = Supply {
                    want: pages,
                    ready,
                    ..Supply::default()
                };
                (start, supply)
            }
        };
        let retiring = std::mem::take(&mut supply.ranges);
        let id = st.inflight.begin(
            Some(ti as u32),
            Some((start, pages)),
            retiring,
            supply.pages(),
        );
        let overflow = st.tags[ti].overflow.clone();
        let mut calls = DriverCalls::default();
        let mapped = MutexGuard::unlocked(guard, || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let got = supply.gather(
                    &self.pool,
                    overflow.as_deref(),
                    &mut calls,
                    requested,
                    &self.stuck_va,
                )?;
                self.map_run(start, got, &mut calls)
            }))
        });
        let st = &mut **guard;
        let mapped = match mapped {
            Ok(mapped) => mapped,
            Err(panic) => {
                // A panic must not leave the record in flight: `sleep` of this tag would wait
                // for it forever and its pages would count against the limit.
                if let Err(e) = self.settle(st, id, true) {
                    strata_vmm::record_deferred(e);
                }
                self.settled.notify_all();
                std::panic::resume_unwind(panic)
            }
        };
        calls.add_to(&mut st.totals.counts);
        let settled = self.settle(st, id, mapped.is_err());
        self.settled.notify_all();
        match mapped {
            Ok(mapped) => settled.map(|()| (start, mapped)),
            Err(e) => {
                if e.is_out_of_memory() {
                    st.totals.counts.ooms += 1;
                }
                Err(e)
            }
        }
    }

    /// Ends in-flight record `id`: the old ranges of the pages it unmapped return to the
    /// arena, and so does its target when the work `failed`.
    pub(super) fn settle(&self, st: &mut State, id: u64, failed: bool) -> Result<()> {
        let record = st
            .inflight
            .end(id)
            .ok_or_else(|| internal(format!("in-flight record {id} vanished")))?;
        let mut ranges = record.retiring;
        if failed {
            ranges.extend(record.target);
        }
        for (start, len) in ranges {
            self.free_va(st, start, len)?;
        }
        Ok(())
    }

    /// Under the lock: checks that `n` more pages fit (under the limit, counting the pages of
    /// in-flight work, and on the device) and takes the cached pages to recycle out of the
    /// tables (unmapped cached pages come first, so reserved memory does not grow while
    /// cached pages sit idle); the rest will come from the pool.
    pub(super) fn reserve_supply(&self, st: &mut State, n: u64, requested: u64) -> Result<Supply> {
        let empty: u64 = st
            .empty_segments(true)
            .iter()
            .filter_map(|&i| st.segments[i as usize].as_ref())
            .map(|s| s.pages)
            .sum();
        let reclaimable = st.cache.pages() + empty + self.cuttable_pages(st, None);
        let fresh = n.saturating_sub(reclaimable);
        if let Some(limit) = st.limit {
            let held = st.totals.mapped_pages + st.inflight.pages();
            let after = held
                .checked_add(fresh)
                .and_then(|p| p.checked_mul(self.page));
            if after.is_none_or(|a| a > limit) {
                st.totals.counts.ooms += 1;
                return Err(Error::LimitExceeded {
                    requested,
                    used: held * self.page,
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
        let mut supply = Supply {
            want: n,
            fresh: usize::try_from(fresh).map_err(|_| Error::Overflow("page count"))?,
            ..Supply::default()
        };
        if n > fresh {
            self.take_cached(st, n - fresh, &mut supply)?;
        }
        Ok(supply)
    }

    /// Takes at least `need` cached pages (smallest cached runs first, then empty small
    /// segments; whole free pages are cut out of large segments first if those are short)
    /// out of the tables into `supply`, after synchronizing the streams that may
    /// touch them (under the lock: a failure leaves everything in place). They stay mapped,
    /// their ranges held, until the supply is gathered.
    fn take_cached(&self, st: &mut State, need: u64, supply: &mut Supply) -> Result<()> {
        let empty: u64 = st
            .empty_segments(true)
            .iter()
            .filter_map(|&i| st.segments[i as usize].as_ref())
            .map(|s| s.pages)
            .sum();
        let short = need.saturating_sub(st.cache.pages() + empty);
        if short > 0 {
            self.cut_free_pages(st, Some(short), None);
        }
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
        for (start, run) in runs {
            st.totals.sub_pages(run.pages);
            st.tags[run.tag as usize].totals.mapped_pages -= run.pages;
            st.totals.counts.pages_recycled += run.pages;
            supply.mapped.extend(run.payload);
            supply.ranges.push((start, run.pages));
        }
        for id in segs {
            let (range, mapped) = self.release_segment(st, id)?;
            st.totals.counts.pages_recycled += mapped.len() as u64;
            supply.mapped.extend(mapped);
            supply.ranges.push(range);
        }
        Ok(())
    }

    /// `n` pages to map, gathered with the lock held throughout (wake; growth when the arena's
    /// VA is short): cached pages unmapped, their old ranges freed, the rest from the pool.
    pub(super) fn gather_locked(
        &self,
        st: &mut State,
        n: u64,
        requested: u64,
    ) -> Result<Vec<Page>> {
        let mut supply = self.reserve_supply(st, n, requested)?;
        let ranges = std::mem::take(&mut supply.ranges);
        let mut calls = DriverCalls::default();
        let got = supply.gather(&self.pool, None, &mut calls, requested, &self.stuck_va);
        calls.add_to(&mut st.totals.counts);
        for (start, len) in ranges {
            self.free_va(st, start, len)?;
        }
        if got.as_ref().is_err_and(Error::is_out_of_memory) {
            st.totals.counts.ooms += 1;
        }
        got
    }

    /// Maps `pages` page by page at arena page `start` and grants access over the whole run
    /// in one call ([`MappedRun`]). On failure everything is undone and the pages go back to
    /// the pool. Needs no lock: the caller holds the range.
    pub(super) fn map_run(
        &self,
        start: u64,
        pages: Vec<Page>,
        calls: &mut DriverCalls,
    ) -> Result<Vec<MappedPage>> {
        let n = pages.len() as u64;
        let grant = [(Location::Device(self.device), Access::ReadWrite)];
        let lease = PageLease::from_pages(&self.pool, pages);
        let run = MappedRun::map(lease, &self.arena, self.va_of(start), &grant)?;
        calls.map += n;
        calls.set_access += u64::from(n > 0);
        Ok(run.into_mapped_pages())
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
        if !seg.mapped.is_empty() {
            st.totals.sub_pages(seg.pages);
            st.tags[seg.tag as usize].totals.mapped_pages -= seg.pages;
        }
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
            st.totals.sub_pages(run.pages);
            st.tags[run.tag as usize].totals.mapped_pages -= run.pages;
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
        let mut calls = DriverCalls::default();
        let released = MutexGuard::unlocked(guard, || {
            let mut pages = Vec::with_capacity(mapped.len());
            let unmapped = unmap_pages(&self.pool, mapped, &mut pages, &mut calls, &self.stuck_va);
            self.pool.release(pages);
            unmapped
        });
        let st = &mut **guard;
        calls.add_to(&mut st.totals.counts);
        self.settle(st, id, false)?;
        released?;
        first_err.map_or(Ok(count * self.page), Err)
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
