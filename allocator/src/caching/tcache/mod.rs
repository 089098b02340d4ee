//! Per-thread caches of small blocks in front of the shared bins.
//!
//! Each thread that allocates small blocks from an allocator gets a cache of its own (its
//! *magazines*: free blocks per (tag, class, stream), at most [`MAGAZINE_BLOCKS`] each and
//! [`CACHE_FREE_BYTES`] in all), behind a mutex of its own that only that thread takes on its
//! fast path: an allocation pops a block from the magazine of its stream, a free of a block the
//! cache handed out on the same stream pushes it back. Neither takes the allocator's lock.
//!
//! - **Finding blocks.** Every block a cache holds (free in a magazine, or live after the
//!   cache handed it out) stays in the shared block table as [`BlockState::Cached`] with its
//!   cache's slot, so a free, `size_of`, `tag_of` or `record_stream` from any thread finds it
//!   under the allocator's lock (the lock order is always the allocator's lock, then a
//!   cache's). A free from another thread on the block's own stream is done in its cache, as
//!   the owner's free would be ([`State::free_in_owner`]); anything else *reclaims* the block
//!   from its cache and goes on as before.
//! - **Streams.** A magazine only serves the stream its blocks were freed on; a free on another
//!   stream, or of a block used on other streams (`record_stream` reclaims it first), takes the
//!   shared path with its events. Blocks reach magazines only from the shared bins of their
//!   stream, so cross-stream reuse is ordered as before.
//! - **Stats.** Counts (allocations, frees, live, hits) are kept per cache and join the
//!   allocator's when it absorbs the cache. The allocated bytes of the blocks a cache handed
//!   out are its own [`Headroom`]s (requested and block bytes, and requested per tag), which
//!   its fast path may raise up to their caps; a raise past a cap takes the allocator's lock
//!   and settles the peaks with every cache locked ([`super::stats::settle`]). So no shared
//!   cache line is written on the fast path, and every figure and peak stays exact.
//! - **Absorbing.** [`State::absorb_caches`] moves every cache's blocks back to the shared
//!   table (free ones to their bins) and folds its counts: `empty_cache`, `stats`, the
//!   listings, a claim of a tag (sleep, offload, onload, revocation), retiring a tag and the
//!   allocator's drop do it first, so they see every block where it was before caches existed.
//!   A thread's exit absorbs its own cache (the thread-local's drop).
//!
//! On by default: `STRATA_THREAD_CACHE=0` ([`CachingConfig::thread_cache`](super::CachingConfig))
//! turns the caches off; off, every call takes the allocator's lock.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, MutexGuard};
use strata_vmm::{process_is_exiting, DevicePtr, Error, Result, StreamHandle};

use super::stats::Headroom;
use super::{BlockState, CachingAllocator, Mode, State, TagId};
use held::HeldBlocks;

mod check;
mod figures;
mod held;

pub(super) use check::cached_blocks;
pub(super) use figures::{cache_deltas, cache_shares, Deltas, Shares};
use figures::{count, uncount};

/// Most free blocks one magazine (tag, class, stream) holds.
pub(super) const MAGAZINE_BLOCKS: usize = 32;
/// Most free bytes one thread's cache holds; beyond, frees go to the shared bins.
pub(super) const CACHE_FREE_BYTES: u64 = 4 << 20;

/// Allocator identities for the thread-locals (never reused).
static NEXT_ALLOCATOR: AtomicU64 = AtomicU64::new(1);

pub(super) fn next_allocator_id() -> u64 {
    NEXT_ALLOCATOR.fetch_add(1, Relaxed)
}

/// One thread's cache for one allocator; aligned so that no two threads' caches share a cache
/// line (or the adjacent line the prefetcher pairs with it).
#[repr(align(128))]
pub(super) struct ThreadCache {
    /// Its slot in [`State::caches`] (what [`BlockState::Cached`] names).
    slot: u32,
    data: Mutex<CacheData>,
}

/// A block the cache holds.
#[derive(Clone, Copy, Debug)]
pub(super) struct Held {
    pub id: u32,
    pub size: u64,
    pub requested: u64,
    /// Live: the stream it was allocated on. Free: the stream of its magazine.
    pub stream: StreamHandle,
    pub ti: u32,
    pub tag: TagId,
    pub class: u16,
    pub live: bool,
}

struct Magazine {
    tag: TagId,
    class: u16,
    stream: StreamHandle,
    /// Free blocks: address and slot in `held`, the last freed on top.
    free: Vec<(DevicePtr, u32)>,
}

#[derive(Default)]
pub(super) struct CacheData {
    held: HeldBlocks,
    mags: Vec<Magazine>,
    free_bytes: u64,
    /// Index in `mags` of the magazine last used (checked first).
    hot: usize,
    /// By tag index (the totals are their sums).
    tags: Vec<Deltas>,
    pub(super) shares: Shares,
}

/// What a pop from a magazine found.
pub(super) enum Pop {
    Hit(DevicePtr),
    /// No free block of that class on that stream.
    Empty,
    /// A block, but handing it out would pass a cap: the caller settles (the block stays).
    NoRoom,
}

/// What a free found in the thread's own cache.
pub(super) enum FastFree {
    Done,
    DoubleFree,
    /// Not a block of this cache's fast path: the shared path decides.
    Shared,
}

impl CacheData {
    /// Pops a block of `class` freed on `stream` under `tag` (index `ti`), if one is there and
    /// fits the caps (or `settling`: the caller holds every cache and settles next).
    #[inline]
    fn alloc(
        &mut self,
        size: u64,
        class: usize,
        stream: StreamHandle,
        tag: TagId,
        settling: bool,
    ) -> Pop {
        let Some(mi) = find_magazine(&self.mags, &mut self.hot, tag, class as u16, stream) else {
            return Pop::Empty;
        };
        let m = &mut self.mags[mi];
        let Some(&(ptr, slot)) = m.free.last() else {
            return Pop::Empty;
        };
        let h = self.held.at(slot);
        if !settling && !self.shares.fit(size, h.size, h.ti as usize) {
            return Pop::NoRoom;
        }
        m.free.pop();
        h.live = true;
        h.requested = size;
        self.free_bytes -= h.size;
        self.shares.add(size, h.size, h.ti as usize);
        count(&mut self.tags[h.ti as usize], 1, h.size);
        Pop::Hit(ptr)
    }

    #[inline]
    fn free(&mut self, ptr: DevicePtr, stream: StreamHandle) -> FastFree {
        let Some((slot, h)) = self.held.get_mut(ptr) else {
            return FastFree::Shared;
        };
        if !h.live {
            return FastFree::DoubleFree;
        }
        if h.stream != stream || self.free_bytes + h.size > CACHE_FREE_BYTES {
            return FastFree::Shared;
        }
        let Some(mi) = find_magazine(&self.mags, &mut self.hot, h.tag, h.class, stream) else {
            return FastFree::Shared;
        };
        let m = &mut self.mags[mi];
        if m.free.len() >= MAGAZINE_BLOCKS {
            return FastFree::Shared;
        }
        h.live = false;
        m.free.push((ptr, slot));
        self.free_bytes += h.size;
        self.shares.sub(h.requested, h.size, h.ti as usize);
        uncount(&mut self.tags[h.ti as usize], h.size);
        FastFree::Done
    }

    fn magazine(&mut self, st: &State, ti: usize, class: usize, stream: StreamHandle) -> usize {
        let tag = st.tags[ti].tag;
        if let Some(i) = self
            .mags
            .iter()
            .position(|m| m.stream == stream && m.class as usize == class && m.tag == tag)
        {
            return i;
        }
        self.mags.push(Magazine {
            tag,
            class: class as u16,
            stream,
            free: Vec::with_capacity(MAGAZINE_BLOCKS),
        });
        if self.tags.len() <= ti {
            self.tags.resize(ti + 1, Deltas::default());
        }
        if self.shares.tags.len() <= ti {
            self.shares.tags.resize(ti + 1, Headroom::default());
        }
        self.mags.len() - 1
    }

    /// Removes a block (its magazine entry too, if free).
    fn take(&mut self, ptr: DevicePtr) -> Option<Held> {
        let h = self.held.remove(ptr)?;
        if !h.live {
            self.free_bytes -= h.size;
            if let Some(m) = self
                .mags
                .iter_mut()
                .find(|m| m.stream == h.stream && m.class == h.class && m.tag == h.tag)
            {
                m.free.retain(|&(p, _)| p != ptr);
            }
        }
        Some(h)
    }
}

/// The index in `mags` of the magazine of (`tag`, `class`, `stream`), `hot` (the last one
/// found) tried first.
#[inline]
fn find_magazine(
    mags: &[Magazine],
    hot: &mut usize,
    tag: TagId,
    class: u16,
    stream: StreamHandle,
) -> Option<usize> {
    let is = |m: &Magazine| m.stream == stream && m.class == class && m.tag == tag;
    if mags.get(*hot).is_some_and(is) {
        return Some(*hot);
    }
    *hot = mags.iter().position(is)?;
    Some(*hot)
}

/// A thread's cache for one allocator, and how to reach the allocator at thread exit.
struct Local {
    allocator: u64,
    cache: Arc<ThreadCache>,
    state: Weak<Mutex<State>>,
}

impl Drop for Local {
    fn drop(&mut self) {
        // At process exit (the main thread's thread-locals) nothing needs the blocks back, and
        // another thread may hold the lock for good.
        if process_is_exiting() {
            return;
        }
        if let Some(state) = self.state.upgrade() {
            state.lock().unregister(&self.cache);
        }
    }
}

thread_local! {
    static LOCALS: RefCell<Vec<Local>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's cache for allocator `id`, if it has one.
#[inline]
fn with_cache<T>(id: u64, f: impl FnOnce(&Arc<ThreadCache>) -> T) -> Option<T> {
    LOCALS
        .try_with(|locals| {
            let locals = locals.try_borrow().ok()?;
            let l = locals.iter().find(|l| l.allocator == id)?;
            Some(f(&l.cache))
        })
        .ok()
        .flatten()
}

impl State {
    /// Moves every block of every thread cache back to the shared tables and folds their
    /// counts. Returns the free blocks moved.
    pub(super) fn absorb_caches(&mut self) -> usize {
        let caches: Vec<Arc<ThreadCache>> = self.caches.iter().flatten().cloned().collect();
        caches.iter().map(|c| self.absorb(c)).sum()
    }

    fn absorb(&mut self, cache: &ThreadCache) -> usize {
        let mut data = cache.data.lock();
        self.fold(&mut data);
        let mut freed = 0;
        let data = &mut *data;
        let mags = std::mem::take(&mut data.mags);
        for m in mags {
            for (ptr, _) in m.free {
                if let Some(h) = data.held.remove(ptr) {
                    self.put_back(h, &mut data.shares);
                    freed += 1;
                }
            }
        }
        for h in data.held.drain() {
            self.put_back(h, &mut data.shares);
        }
        data.free_bytes = 0;
        let shares = &mut data.shares;
        self.totals.bytes.requested.take_cap(&mut shares.requested);
        self.totals.bytes.blocks.take_cap(&mut shares.blocks);
        for (ti, h) in shares.tags.iter_mut().enumerate() {
            self.tags[ti].totals.allocated.take_cap(h);
        }
        freed
    }

    /// A block out of its cache, back in the shared tables: live (its bytes move from the
    /// cache's `shares` to the shared figures), or free in its bin.
    fn put_back(&mut self, h: Held, shares: &mut Shares) {
        let b = &mut self.blocks[h.id as usize];
        b.stream = h.stream;
        if h.live {
            b.state = BlockState::Live;
            b.requested = h.requested;
            let bytes = &mut self.totals.bytes;
            bytes
                .requested
                .take_live(&mut shares.requested, h.requested);
            bytes.blocks.take_live(&mut shares.blocks, h.size);
            let tag = &mut self.tags[h.ti as usize].totals.allocated;
            tag.take_live(&mut shares.tags[h.ti as usize], h.requested);
        } else {
            b.state = BlockState::Free;
            let counter = b.counter as usize;
            self.tags[h.ti as usize].bins[h.class as usize].push(h.stream, h.id);
            if let Some(n) = self.run_live.get_mut(counter) {
                *n -= 1;
            }
        }
    }

    /// If block `id` is held by a thread cache, moves it back to the shared tables (the cache's
    /// counts folded first, so the shared figures cover its allocation).
    #[inline]
    pub(super) fn reclaim(&mut self, id: u32) {
        if let BlockState::Cached(slot) = self.blocks[id as usize].state {
            self.reclaim_cached(id, slot);
        }
    }

    #[cold]
    #[inline(never)]
    fn reclaim_cached(&mut self, id: u32, slot: u32) {
        let Some(cache) = self.caches.get(slot as usize).cloned().flatten() else {
            return;
        };
        let mut data = cache.data.lock();
        self.fold(&mut data);
        let ptr = self.blocks[id as usize].ptr;
        if let Some(h) = data.take(ptr) {
            self.put_back(h, &mut data.shares);
        }
    }

    /// A free of block `id` (at `ptr`) from a thread other than the one whose cache handed it
    /// out: done in that cache, under its lock, as its own thread's free would be (the block
    /// goes back to that cache's magazine of its stream). `None` when that free would take the
    /// shared path (another stream, a full magazine) or the block is not a cache's.
    pub(super) fn free_in_owner(
        &mut self,
        id: u32,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Option<Result<()>> {
        let BlockState::Cached(slot) = self.blocks[id as usize].state else {
            return None;
        };
        let cache = self.caches.get(slot as usize)?.as_ref()?;
        match cache.data.lock().free(ptr, stream) {
            FastFree::Done => Some(Ok(())),
            FastFree::DoubleFree => Some(Err(Error::DoubleFree(ptr))),
            FastFree::Shared => None,
        }
    }

    /// Moves free blocks of (`ti`, `class`) freed on `stream` from the shared bin into
    /// `cache`'s magazine, up to half a magazine (and the cache's byte bound).
    fn refill(
        &mut self,
        cache: &ThreadCache,
        data: &mut CacheData,
        ti: usize,
        class: usize,
        stream: StreamHandle,
    ) {
        let mi = data.magazine(self, ti, class, stream);
        let mut taken = Vec::new();
        let mut bytes = data.free_bytes;
        while data.mags[mi].free.len() + taken.len() < MAGAZINE_BLOCKS / 2 {
            let Some(id) = self.tags[ti].bins[class].pop(stream) else {
                break;
            };
            let size = self.blocks[id as usize].size;
            if bytes + size > CACHE_FREE_BYTES {
                self.tags[ti].bins[class].push(stream, id);
                break;
            }
            bytes += size;
            taken.push(id);
        }
        // The bin's top ends on the magazine's top: reuse stays last-freed-first.
        for id in taken.into_iter().rev() {
            if let Some(n) = self
                .run_live
                .get_mut(self.blocks[id as usize].counter as usize)
            {
                *n += 1;
            }
            self.stash(cache, data, mi, id);
        }
    }

    /// Puts free block `id` (out of its bin, counted out in its run) in magazine `mi`.
    fn stash(&mut self, cache: &ThreadCache, data: &mut CacheData, mi: usize, id: u32) {
        let b = &mut self.blocks[id as usize];
        let m = &mut data.mags[mi];
        b.state = BlockState::Cached(cache.slot);
        data.free_bytes += b.size;
        let held = Held {
            id,
            size: b.size,
            requested: 0,
            stream: m.stream,
            ti: b.tag,
            tag: m.tag,
            class: b.class,
            live: false,
        };
        m.free.push((b.ptr, data.held.insert(b.ptr, held)));
    }

    /// Returns this cache's free blocks of (`ti`, `class`) freed on streams other than
    /// `stream` to the shared bins, where the shared path reuses them ordered by an event.
    fn return_other_streams(
        &mut self,
        data: &mut CacheData,
        ti: usize,
        class: usize,
        stream: StreamHandle,
    ) {
        let tag = self.tags[ti].tag;
        let mut ptrs = Vec::new();
        for m in &mut data.mags {
            if m.tag == tag && m.class as usize == class && m.stream != stream {
                ptrs.append(&mut m.free);
            }
        }
        for (ptr, _) in ptrs {
            if let Some(h) = data.held.remove(ptr) {
                data.free_bytes -= h.size;
                self.put_back(h, &mut data.shares);
            }
        }
    }

    fn register(&mut self) -> Arc<ThreadCache> {
        let slot = match self.caches.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.caches.push(None);
                self.caches.len() - 1
            }
        };
        let cache = Arc::new(ThreadCache {
            slot: slot as u32,
            data: Mutex::new(CacheData::default()),
        });
        self.caches[slot] = Some(Arc::clone(&cache));
        cache
    }

    /// A thread's cache leaves (its thread exits): its blocks go back first.
    fn unregister(&mut self, cache: &Arc<ThreadCache>) {
        let slot = cache.slot as usize;
        if self
            .caches
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|c| Arc::ptr_eq(c, cache))
        {
            self.absorb(cache);
            self.caches[slot] = None;
        }
    }

    /// Live block `id` as its cache sees it: (requested, tag), or `None` when free.
    pub(super) fn peek_cached(&self, id: u32) -> Option<(u64, TagId)> {
        let BlockState::Cached(slot) = self.blocks[id as usize].state else {
            return None;
        };
        let cache = self.caches.get(slot as usize)?.as_ref()?;
        let data = cache.data.lock();
        let h = data.held.get(self.blocks[id as usize].ptr)?;
        h.live.then_some((h.requested, h.tag))
    }

    /// Every cache, locked (the invariant checker holds them all: no fast path moves a figure
    /// meanwhile).
    pub(super) fn lock_caches(&self) -> Vec<(u32, MutexGuard<'_, CacheData>)> {
        self.caches
            .iter()
            .flatten()
            .map(|c| (c.slot, c.data.lock()))
            .collect()
    }
}

impl CachingAllocator {
    /// The fast path of a small allocation: a pop from this thread's magazine.
    #[inline]
    pub(super) fn cached_alloc(
        &self,
        size: u64,
        class: usize,
        stream: StreamHandle,
        tag: TagId,
    ) -> Option<DevicePtr> {
        with_cache(self.id, |c| {
            match c.data.lock().alloc(size, class, stream, tag, false) {
                Pop::Hit(ptr) => Some(ptr),
                Pop::Empty | Pop::NoRoom => None,
            }
        })
        .flatten()
    }

    /// The fast path of a free: a push to this thread's magazine.
    #[inline]
    pub(super) fn cached_free(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<bool> {
        match with_cache(self.id, |c| c.data.lock().free(ptr, stream)) {
            Some(FastFree::Done) => Ok(true),
            Some(FastFree::DoubleFree) => Err(Error::DoubleFree(ptr)),
            Some(FastFree::Shared) | None => Ok(false),
        }
    }

    /// The slow path of a small allocation with thread caches on: refills this thread's
    /// magazine from the shared bin (registering the cache on first use), else the shared
    /// path; after which the magazine takes what the shared path carved.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_refill(
        &self,
        size: u64,
        class: usize,
        stream: StreamHandle,
        tag: TagId,
    ) -> Result<DevicePtr> {
        let mut st = self.state.lock();
        let cache = match with_cache(self.id, Arc::clone) {
            Some(c) => Some(c),
            None => self.register_local(&mut st),
        };
        let Some(cache) = cache else {
            return self.allocate_shared(&mut st, size, class, stream, tag);
        };
        let awake = st
            .tag_slot(tag)
            .filter(|&ti| st.tags[ti].mode == Mode::Awake);
        if let Some(ti) = awake {
            let mut data = cache.data.lock();
            st.refill(&cache, &mut data, ti, class, stream);
            match data.alloc(size, class, stream, tag, false) {
                Pop::Hit(ptr) => return Ok(ptr),
                Pop::NoRoom => {
                    drop(data);
                    let request = (size, class, stream, tag);
                    if let Some(ptr) = st.alloc_settling(&cache, ti, request) {
                        return Ok(ptr);
                    }
                }
                Pop::Empty => st.return_other_streams(&mut data, ti, class, stream),
            }
        }
        let ptr = self.allocate_shared(&mut st, size, class, stream, tag)?;
        if let Some(ti) = st
            .tag_slot(tag)
            .filter(|&ti| st.tags[ti].mode == Mode::Awake)
        {
            st.refill(&cache, &mut cache.data.lock(), ti, class, stream);
        }
        Ok(ptr)
    }

    /// Puts small block `id`, just freed on the shared path on the stream it was allocated
    /// on, in this thread's magazine if it has room (else the caller pushes it to its bin).
    pub(super) fn stash_freed(&self, st: &mut State, id: u32) -> bool {
        let Some(cache) = with_cache(self.id, Arc::clone) else {
            return false;
        };
        let mut data = cache.data.lock();
        let b = &st.blocks[id as usize];
        let (ti, class, stream, size) = (b.tag as usize, b.class as usize, b.stream, b.size);
        let mi = data.magazine(st, ti, class, stream);
        if data.mags[mi].free.len() >= MAGAZINE_BLOCKS || data.free_bytes + size > CACHE_FREE_BYTES
        {
            return false;
        }
        st.stash(&cache, &mut data, mi, id);
        true
    }

    /// Registers a cache for this thread (none while its thread-locals are being destroyed).
    fn register_local(&self, st: &mut State) -> Option<Arc<ThreadCache>> {
        LOCALS
            .try_with(|locals| {
                let mut locals = locals.try_borrow_mut().ok()?;
                locals.retain(|l| l.state.strong_count() > 0);
                let cache = st.register();
                locals.push(Local {
                    allocator: self.id,
                    cache: Arc::clone(&cache),
                    state: Arc::downgrade(&self.state),
                });
                Some(cache)
            })
            .ok()
            .flatten()
    }
}
