//! The slow paths of allocation: new runs of small blocks (in shared pages or segments) and
//! new runs of whole pages mapped behind a new VA range (pages from `supply.rs`).
//!
//! Growth and `empty_cache` make their driver calls with the lock dropped (see `inflight.rs`):
//! under the lock they check the limit, pick the pages (cached ones leave the tables, after
//! the streams that may touch them are synchronized) and take the VA; outside it they unmap,
//! create, map, set access or release; under the lock again they publish or roll back.

use parking_lot::MutexGuard;
use strata_vmm::{Access, DevicePtr, Error, Location, Result, StreamHandle};

use super::stats::DriverCalls;
use super::supply::Supply;
use super::{
    internal, run_slot, Block, BlockState, CachingAllocator, Carve, Guard, Segment, State, TagId,
    CHUNKS_PER_PAGE,
};
use crate::mapped::{MappedPage, MappedRun, PageLease};
use crate::pool::Page;

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

impl CachingAllocator {
    /// After a failed growth: absorbs the thread caches; true when that freed blocks (the
    /// error is then not counted: the caller tries again).
    #[cold]
    pub(super) fn absorb_after_oom(&self) -> bool {
        let mut st = self.state.lock();
        let freed = st.absorb_caches() > 0;
        if freed {
            st.totals.counts.ooms = st.totals.counts.ooms.saturating_sub(1);
        }
        freed
    }

    /// A small allocation through the shared bins; out of memory, it absorbs the thread
    /// caches (their free blocks may make a run wholly free) and tries once more.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_shared(
        &self,
        st: &mut Guard<'_>,
        size: u64,
        class: usize,
        stream: StreamHandle,
        tag: TagId,
    ) -> Result<DevicePtr> {
        if let Some(ptr) = st.pop_small(tag, class, size, stream) {
            st.totals.counts.cache_hits += 1;
            return Ok(ptr);
        }
        match self.allocate_small_slow(st, size, class, stream, tag) {
            Err(Error::OutOfMemory { .. } | Error::LimitExceeded { .. })
                if st.absorb_caches() > 0 =>
            {
                st.totals.counts.ooms = st.totals.counts.ooms.saturating_sub(1);
                self.allocate_small_slow(st, size, class, stream, tag)
            }
            r => r,
        }
    }

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
        let ti = guard.ensure_tag(tag, self.classes.len());
        self.wait_while_moving(guard, ti);
        let st = &mut **guard;
        if st.tags[ti].asleep() {
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
                    // Free blocks in thread caches keep their runs carved: back to the bins
                    // first, so that runs they empty can serve this class.
                    None if guard.absorb_caches()
                        + self.reclaim_empty_runs(guard, ti, stream)?
                        > 0 =>
                    {
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
        self.count_mapped(st, ti, &mapped);
        st.segments[seg_id as usize] = Some(Segment {
            start,
            pages,
            shared,
            runs: Vec::new(),
            tag: ti as u32,
            blocks: Vec::new(),
            mapped,
        });
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
        let overflow = st.tags[ti].overflow.clone();
        let overflows = overflow.is_some();
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
            Some(start) => match self.reserve_supply(st, pages, requested, overflows) {
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
            supply.device_pages(self.device),
        );
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

    #[inline]
    pub(super) fn va_of(&self, page: u64) -> DevicePtr {
        self.arena.ptr() + page * self.page
    }

    #[inline]
    pub(super) fn page_of(&self, ptr: DevicePtr) -> u64 {
        (ptr - self.arena.ptr()) / self.page
    }
}
