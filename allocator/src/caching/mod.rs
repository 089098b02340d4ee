//! `CachingAllocator`: arbitrary sizes on pages of a [`PagePool`], stream-ordered and cached.
//!
//! - **Small sizes** (below [`CachingConfig::small_threshold`], 1 MiB by default) are rounded to
//!   a size class (multiples of 256 B, four geometric sub-steps per power of two) and carved from
//!   runs of a few 1/32-page chunks inside pages shared by all classes of a tag (classes larger
//!   than a page: segments of their own). Freed blocks go back to their class's free list;
//!   when a tag's pages have no room for a new run, runs whose blocks are all free (found by
//!   per-run counts, without scanning blocks) return to their page for any class before a
//!   page is mapped. Pages and bins are per tag, so blocks of two tags never share a page.
//! - **Large sizes** are rounded to 512 bytes and placed in *large segments*: runs of whole
//!   pages mapped, page by page, behind a range of one VA arena reserved once (access set over
//!   the whole run in one call; physical pages need not be contiguous), one tag and one stream
//!   each. The rest of a segment's last page serves the next large allocation of its stream
//!   (best fit over free extents, `large.rs`), so a size just above a page multiple does not
//!   hold a whole extra page. A segment whose blocks are all free joins a cache of free page
//!   runs, reused by splitting (best fit). When no free extent or cached run is big enough, a
//!   segment of the stream grows in place if the VA after it is free (expandable segments),
//!   else a new segment of the fewest pages is placed with room after it; either way cached
//!   pages (and whole free pages cut out of segments) are unmapped and mapped again, with pool
//!   pages if needed: a request that fits in the free pages (cached + pool) never fails for
//!   want of a contiguous range.
//! - **Streams.** A block freed on stream S is reusable at once on S. Another stream T takes it
//!   only after an event recorded on S is waited on by T (`stream_wait_event`, no host block).
//!   A block used on other streams ([`CachingAllocator::record_stream`]), or freed on a stream
//!   other than the one it was allocated on, is held pending until events on those streams
//!   complete. Streams that may touch pages are synchronized before the pages are unmapped.
//! - **Tags** and **sleep/wake**: see [`CachingAllocator::sleep`].
//!
//! The fast path (a cached small allocate or free) is a bin pop or push under the allocator's
//! one lock (by default a pop or push on the calling thread's own cache of small blocks, under
//! that cache's own lock, `tcache.rs`; `STRATA_THREAD_CACHE=0` turns that off): no driver call,
//! no logging, no heap allocation once warm. Growth, trimming and everything
//! involving the backend live in `#[cold]` functions. Growth and `empty_cache` never hold the
//! lock across create/map/set_access/unmap/release: they reserve the VA and count the pages
//! against the limit under it (an in-flight record, `inflight.rs`), make the driver calls with
//! it dropped, and publish or roll back under it again, so one thread's growth does not stall
//! the others' fast path. Offload, onload, revocation and sleep claim their tags (`quiet.rs`:
//! the tags' allocations and frees wait) and wait for the tags' streams and copy their pages
//! with the lock dropped. Stream synchronization before unmapping cached pages, unmapping in
//! sleep, and wake still run under the lock.
//!
//! Zero sizes: `allocate(0, _)` returns `Ok(0)` and changes nothing; `deallocate(0, _)` is a
//! no-op.

mod arena;
mod bins;
mod cache;
mod freed;
mod grow;
mod inflight;
mod invariants;
mod large;
mod large_path;
mod offload;
mod quiet;
mod revoke;
mod sleep;
mod stats;
mod streams;
mod supply;
mod tags;
mod tcache;
mod unmap;

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};
use rustc_hash::FxHashMap;
use strata_vmm::{round_up, Backend, DevicePtr, Error, Event, Reservation, Result, StreamHandle};

use crate::mapped::MappedPage;
use crate::pool::PagePool;
use crate::resource::MemoryResource;

pub use arena::VaArena;
pub use bins::{
    class_index, class_size, ClassBin, SizeClasses, CHUNKS_PER_PAGE, MAX_SEGMENT_PAGES, MIN_ALIGN,
};
pub use cache::{CachedRun, RangeCache, Run};
pub use large::{Extents, LargeSegment, LARGE_ALIGN};
pub use offload::{Moved, SpillCounts, SpillStats, TierBytes};
pub use revoke::Revoked;
pub use stats::{human_size, AllocatorCounts, AllocatorStats, LiveAllocation, TagStats};

use freed::FreedLog;
use tags::{Mode, TagState};

/// The allocator's lock, held.
type Guard<'a> = MutexGuard<'a, State>;

/// A tag: every allocation carries one; 0 is untagged. Tags are what sleep and wake act on.
pub type TagId = u32;

/// The tag of untagged allocations.
pub const UNTAGGED: TagId = 0;

/// Marks a large block (no size class).
const LARGE: u16 = u16::MAX;
/// Segment id of large blocks.
const NO_SEGMENT: u32 = u32::MAX;
/// Idle events kept for reuse.
const IDLE_EVENTS: usize = 64;

/// Configuration of a [`CachingAllocator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachingConfig {
    /// Bytes of VA reserved once for the arena (rounded up to the page size). `None`: four
    /// times the device memory, at least 1 TiB.
    pub arena_size: Option<u64>,
    /// Requests below this many bytes are small (size classes in shared pages). Capped at
    /// [`MAX_SEGMENT_PAGES`] pages, so small page sizes lower it.
    pub small_threshold: u64,
    /// Cap on the bytes of the device's own memory held mapped (live, small segments, cache):
    /// PyTorch's memory fraction. Pages of host memory or of a peer behind the allocator's
    /// addresses (overflow, offload, revocation to host) do not count. Beyond it,
    /// [`Error::LimitExceeded`], or the tag's overflow pool ([`CachingAllocator::set_overflow`]).
    pub limit: Option<u64>,
    /// How many freed pointers (and released segments) are remembered to tell a double free
    /// from an unknown pointer.
    pub freed_history: usize,
    /// Print live allocations to stderr when the allocator is dropped with some still live
    /// (never while the process is exiting).
    pub report_leaks: bool,
    /// Per-thread caches of small blocks in front of the shared bins (`tcache.rs`). Default:
    /// on, unless the environment sets `STRATA_THREAD_CACHE=0`. Threads that allocate at once
    /// then share no lock and no cache line (two threads: 0.57x one thread's time per pair in
    /// aggregate on the 2-vCPU development machine, against 1.2x with one lock); one thread
    /// pays ~80 instructions more per pair (BENCHMARKS.md). Each thread holds up to 4 MiB of
    /// free small blocks that other threads reach only through `empty_cache`, sleep, out of
    /// memory and the like.
    pub thread_cache: bool,
}

impl Default for CachingConfig {
    fn default() -> Self {
        CachingConfig {
            arena_size: None,
            small_threshold: 1 << 20,
            limit: None,
            freed_history: 4096,
            report_leaks: true,
            thread_cache: !std::env::var("STRATA_THREAD_CACHE").is_ok_and(|v| v.trim() == "0"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockState {
    /// Handed out.
    Live,
    /// In its bin (small blocks only; freed large blocks leave the table for the cache).
    Free,
    /// Freed, waiting for events on the streams that used it.
    Pending,
    /// Held by the thread cache in this slot of [`State::caches`] (free in a magazine, or
    /// live after the cache handed it out): the cache knows which (`tcache.rs`).
    Cached(u32),
    /// Unused table slot.
    Dead,
}

struct Block {
    ptr: DevicePtr,
    /// Class size, or the request rounded to [`LARGE_ALIGN`].
    size: u64,
    requested: u64,
    /// Index into `State::tags`.
    tag: u32,
    segment: u32,
    class: u16,
    /// Small blocks: its run's slot in [`State::run_live`] (see [`run_slot`]); large: 0.
    counter: u32,
    state: BlockState,
    /// Live: the stream it was allocated on. Free/Pending: the stream it was freed on.
    stream: StreamHandle,
    /// Other streams that used it (`record_stream`).
    used_on: Vec<StreamHandle>,
}

/// Blocks of one class carved from `len` bytes at `offset` in a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Carve {
    offset: u64,
    len: u64,
    class: u16,
}

// A run's first chunk fits a `u8`.
const _: () = assert!(CHUNKS_PER_PAGE <= 256);

/// The slot in [`State::run_live`] of the run starting at chunk `run` of segment `segment`
/// (segments of one class have one run, at chunk 0). Fits a `u32` below 2^27 segments; the
/// segment table and this one would take over 30 GiB of host memory before that.
#[inline]
fn run_slot(segment: u32, run: u8) -> u32 {
    segment * CHUNKS_PER_PAGE as u32 + u32::from(run)
}

/// Pages of one tag carved into blocks: a shared page (one page, runs of chunks for any class
/// of the tag) or a segment of its own for one class whose blocks exceed a page.
struct Segment {
    /// First page of the segment in the arena.
    start: u64,
    pages: u64,
    /// Whether further runs may be carved from it (shared page).
    shared: bool,
    /// Carved runs, by offset; they never overlap.
    runs: Vec<Carve>,
    tag: u32,
    blocks: Vec<u32>,
    /// The segment's pages (empty while the tag sleeps).
    mapped: Vec<MappedPage>,
}

struct PendingFree {
    block: u32,
    events: Vec<Event>,
    /// The streams `events` were recorded on (a claimed tag's are waited for with the lock
    /// dropped, `quiet.rs`).
    streams: Vec<StreamHandle>,
}

/// Everything behind the allocator's one lock.
struct State {
    blocks: Vec<Block>,
    free_ids: Vec<u32>,
    by_ptr: FxHashMap<DevicePtr, u32>,
    tags: Vec<TagState>,
    tag_ix: FxHashMap<TagId, u32>,
    segments: Vec<Option<Segment>>,
    /// Blocks out of their bins (live or pending) per run of small blocks, [`CHUNKS_PER_PAGE`]
    /// slots per entry of `segments` ([`run_slot`]; zero where no run starts). The fast path
    /// touches only its block's slot, one add, as it once touched a per-segment count; a
    /// segment's count and its emptied runs are read off these slots on the slow paths.
    run_live: Vec<u32>,
    free_segments: Vec<u32>,
    cache: RangeCache<Vec<MappedPage>>,
    /// Large segments by first page.
    large: BTreeMap<u64, LargeSegment<Vec<MappedPage>>>,
    /// Free ranges of large segments.
    extents: Extents,
    va: VaArena,
    pending: Vec<PendingFree>,
    idle_events: Vec<Event>,
    freed: FreedLog,
    totals: stats::Totals,
    limit: Option<u64>,
    /// Growth and shrinking whose driver calls run with the lock dropped.
    inflight: inflight::InFlightTable,
    /// Migrations of all tags (`offload.rs`).
    spill: offload::SpillCounts,
    /// Runs whose pages a migration holds with the lock dropped (`offload.rs`).
    migrating: Vec<offload::InMigration>,
    /// Revocation notices not yet taken (`revoke.rs`).
    revoked: Vec<revoke::Revoked>,
    /// Arena pages taken for good: their unmap failed and they may still be mapped.
    stuck_pages: Vec<u64>,
    /// Registered thread caches by slot (`tcache.rs`).
    caches: Vec<Option<Arc<tcache::ThreadCache>>>,
}

impl State {
    /// The fast path: pops a block of `class` freed on `stream`. Counts the allocation, not
    /// the cache hit.
    #[inline]
    fn pop_small(
        &mut self,
        tag: TagId,
        class: usize,
        size: u64,
        stream: StreamHandle,
    ) -> Option<DevicePtr> {
        let ti = self.tag_slot(tag)?;
        let t = &mut self.tags[ti];
        if t.mode != Mode::Awake {
            return None;
        }
        let id = t.bins[class].pop(stream)?;
        let b = &mut self.blocks[id as usize];
        b.state = BlockState::Live;
        b.requested = size;
        b.stream = stream;
        let settle = t.totals.on_alloc(size, b.size) | self.totals.on_alloc(size, b.size);
        self.totals.counts.small_allocs += 1;
        if let Some(n) = self.run_live.get_mut(b.counter as usize) {
            *n += 1;
        }
        let ptr = b.ptr;
        if settle {
            self.settle_peaks(ti);
        }
        Some(ptr)
    }

    /// Puts small block `id`, just freed on `stream` (its own), in its bin.
    #[inline]
    fn bin_freed(&mut self, id: u32, stream: StreamHandle) {
        let b = &self.blocks[id as usize];
        self.tags[b.tag as usize].bins[b.class as usize].push(stream, id);
        if let Some(n) = self.run_live.get_mut(b.counter as usize) {
            *n -= 1;
        }
    }

    fn new_block(&mut self, block: Block) -> u32 {
        match self.free_ids.pop() {
            Some(id) => {
                self.blocks[id as usize] = block;
                id
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    fn unknown_pointer(&self, ptr: DevicePtr) -> Error {
        if self.freed.contains(ptr) {
            Error::DoubleFree(ptr)
        } else {
            Error::UnknownPointer(ptr)
        }
    }

    /// A live block a thread cache holds: (requested, tag).
    fn live_cached(&self, ptr: DevicePtr) -> Option<(u64, TagId)> {
        self.peek_cached(*self.by_ptr.get(&ptr)?)
    }

    fn live_block(&self, ptr: DevicePtr) -> Result<&Block> {
        match self.by_ptr.get(&ptr) {
            Some(&id) if self.blocks[id as usize].state == BlockState::Live => {
                Ok(&self.blocks[id as usize])
            }
            _ => Err(Error::UnknownPointer(ptr)),
        }
    }

    /// Accounts the free of a live block (it leaves the allocated figures now).
    fn account_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        self.tags[b.tag as usize]
            .totals
            .on_free(b.requested, b.size);
        self.totals.on_free(b.requested, b.size);
    }

    /// Blocks of segment `id` out of their bins (live or pending).
    fn segment_live(&self, id: u32) -> u32 {
        let first = run_slot(id, 0) as usize;
        self.run_live
            .get(first..first + CHUNKS_PER_PAGE as usize)
            .map_or(0, |slots| slots.iter().sum())
    }

    /// Mapped segments with no live or pending block.
    fn empty_segments(&self, mapped: bool) -> Vec<u32> {
        self.iter_segments()
            .filter(|&(id, s)| self.segment_live(id) == 0 && s.mapped.is_empty() != mapped)
            .map(|(id, _)| id)
            .collect()
    }

    /// Pages mapped of the device's own memory (what the limit counts).
    fn device_pages(&self) -> u64 {
        self.totals.mapped_pages - self.totals.elsewhere_pages
    }

    /// Pages of the mapped segments with no live or pending block.
    fn empty_segment_pages(&self) -> u64 {
        self.empty_segments(true)
            .iter()
            .filter_map(|&i| self.segments[i as usize].as_ref())
            .map(|s| s.pages)
            .sum()
    }

    fn iter_segments(&self) -> impl Iterator<Item = (u32, &Segment)> {
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
    }
}

/// Arbitrary-size, stream-ordered, caching allocator over a [`PagePool`]. See the module docs.
pub struct CachingAllocator {
    pool: Arc<PagePool>,
    backend: Arc<dyn Backend>,
    device: u32,
    page: u64,
    arena_pages: u64,
    /// Physical memory of the device: no request beyond it (plus pooled pages) can succeed.
    device_total: u64,
    classes: SizeClasses,
    report_leaks: bool,
    arena: Arc<Reservation>,
    /// Shared with the thread-locals of the thread caches, which absorb theirs at thread exit.
    state: Arc<Mutex<State>>,
    /// Identity of this allocator for the thread-locals.
    id: u64,
    /// Whether small blocks go through per-thread caches.
    thread_cache: bool,
    /// Notified whenever an in-flight growth ends (`sleep` waits for those of its tag).
    settled: Condvar,
    /// Addresses of pages whose unmap failed (they may still be mapped): when the range
    /// holding one returns to the arena, that page stays taken for good ([`Self::free_va`]).
    stuck_va: Mutex<Vec<DevicePtr>>,
}

impl CachingAllocator {
    /// An allocator over `pool`'s device; reserves the arena's VA now (no physical memory).
    pub fn new(pool: Arc<PagePool>, config: CachingConfig) -> Result<Self> {
        let backend = Arc::clone(pool.backend());
        let device = pool.device();
        let page = pool.page_size();
        if page == 0 || page % MIN_ALIGN != 0 {
            return Err(Error::InvalidArgument(format!(
                "page size {page} is not a multiple of {MIN_ALIGN}"
            )));
        }
        let device_total = backend.device_info(device)?.total_memory;
        let arena_size = match config.arena_size {
            Some(size) => size,
            None => device_total.saturating_mul(4).max(1 << 40),
        };
        let arena_size = round_up(arena_size, page).ok_or(Error::Overflow("arena size"))?;
        if arena_size == 0 {
            return Err(Error::InvalidArgument("arena size 0".into()));
        }
        // Small classes live in segments of at most MAX_SEGMENT_PAGES pages: with small pages
        // (a 4 KiB host granularity) the threshold shrinks to fit instead of failing.
        let threshold = config
            .small_threshold
            .min(MAX_SEGMENT_PAGES.saturating_mul(page));
        let classes = SizeClasses::new(threshold, page);
        if let Some(last) = classes.len().checked_sub(1) {
            if classes.size(last) > bins::MAX_SEGMENT_PAGES * page {
                return Err(Error::InvalidArgument(format!(
                    "small threshold {} above {} pages",
                    config.small_threshold,
                    bins::MAX_SEGMENT_PAGES
                )));
            }
        }
        let arena = Arc::new(Reservation::new(&backend, arena_size, 0)?);
        let arena_pages = arena_size / page;
        let state = State {
            blocks: Vec::new(),
            free_ids: Vec::new(),
            by_ptr: FxHashMap::default(),
            tags: vec![TagState::new(UNTAGGED, classes.len())],
            tag_ix: FxHashMap::default(),
            segments: Vec::new(),
            run_live: Vec::new(),
            free_segments: Vec::new(),
            cache: RangeCache::default(),
            large: BTreeMap::new(),
            extents: Extents::default(),
            va: VaArena::new(arena_pages),
            pending: Vec::new(),
            idle_events: Vec::new(),
            freed: FreedLog::new(config.freed_history),
            totals: stats::Totals::default(),
            limit: config.limit,
            inflight: inflight::InFlightTable::default(),
            spill: offload::SpillCounts::default(),
            migrating: Vec::new(),
            revoked: Vec::new(),
            stuck_pages: Vec::new(),
            caches: Vec::new(),
        };
        Ok(CachingAllocator {
            pool,
            backend,
            device,
            page,
            arena_pages,
            device_total,
            classes,
            report_leaks: config.report_leaks,
            arena,
            state: Arc::new(Mutex::new(state)),
            id: tcache::next_allocator_id(),
            thread_cache: config.thread_cache,
            settled: Condvar::new(),
            stuck_va: Mutex::new(Vec::new()),
        })
    }

    /// The pool pages come from.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    /// Page (granularity) size.
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Start and size of the arena's VA.
    pub fn arena(&self) -> (DevicePtr, u64) {
        (self.arena.ptr(), self.arena.size())
    }

    /// Requests below this many bytes are small.
    pub fn small_threshold(&self) -> u64 {
        self.classes.threshold()
    }

    /// Allocates `size` bytes, untagged, for use on `stream`.
    #[inline]
    pub fn allocate(&self, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        self.allocate_tagged(size, stream, UNTAGGED)
    }

    /// Allocates `size` bytes under `tag` for use on `stream`. The pointer is aligned to at
    /// least 256 bytes (512 for large sizes). Allocating under a sleeping tag is
    /// [`Error::InvalidState`]; exhaustion is [`Error::OutOfMemory`] or
    /// [`Error::LimitExceeded`], after which the allocator is still fully usable.
    #[inline]
    pub fn allocate_tagged(
        &self,
        size: u64,
        stream: StreamHandle,
        tag: TagId,
    ) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(0);
        }
        if size < self.classes.threshold() {
            let class = class_index(size);
            if self.thread_cache {
                if let Some(ptr) = self.cached_alloc(size, class, stream, tag) {
                    return Ok(ptr);
                }
                return self.allocate_refill(size, class, stream, tag);
            }
            let mut st = self.state.lock();
            if let Some(ptr) = st.pop_small(tag, class, size, stream) {
                st.totals.counts.cache_hits += 1;
                return Ok(ptr);
            }
            return self.allocate_small_slow(&mut st, size, class, stream, tag);
        }
        match self.allocate_large(size, stream, tag) {
            Err(Error::OutOfMemory { .. } | Error::LimitExceeded { .. })
                if self.thread_cache && self.absorb_after_oom() =>
            {
                self.allocate_large(size, stream, tag)
            }
            r => r,
        }
    }

    /// Frees `ptr` on `stream`: reusable at once by allocations on `stream`, elsewhere after an
    /// event. Unknown (or interior) pointers are [`Error::UnknownPointer`], a second free
    /// [`Error::DoubleFree`]; neither changes anything. `0` is a no-op.
    #[inline]
    pub fn deallocate(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        if self.thread_cache && self.cached_free(ptr, stream)? {
            return Ok(());
        }
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let Some(&id) = st.by_ptr.get(&ptr) else {
            return Err(st.unknown_pointer(ptr));
        };
        if self.thread_cache {
            if let Some(done) = st.free_in_owner(id, ptr, stream) {
                return done;
            }
            st.reclaim(id);
        }
        let b = &mut st.blocks[id as usize];
        if b.state != BlockState::Live {
            return Err(Error::DoubleFree(ptr));
        }
        let t = &mut st.tags[b.tag as usize];
        if b.class == LARGE || b.stream != stream || !b.used_on.is_empty() || t.mode != Mode::Awake
        {
            return self.free_slow(&mut guard, ptr, id, stream);
        }
        b.state = BlockState::Free;
        t.totals.on_free(b.requested, b.size);
        st.totals.on_free(b.requested, b.size);
        if !self.thread_cache {
            t.bins[b.class as usize].push(stream, id);
            if let Some(n) = st.run_live.get_mut(b.counter as usize) {
                *n -= 1;
            }
            return Ok(());
        }
        if !self.stash_freed(st, id) {
            st.bin_freed(id, stream);
        }
        Ok(())
    }

    /// Marks `ptr` as used on `stream` too: when freed, it is held until the work queued on
    /// `stream` before the free completes.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let mut st = self.state.lock();
        let Some(&id) = st.by_ptr.get(&ptr) else {
            return Err(Error::UnknownPointer(ptr));
        };
        st.reclaim(id);
        let b = &mut st.blocks[id as usize];
        if b.state != BlockState::Live {
            return Err(Error::UnknownPointer(ptr));
        }
        if b.stream != stream && !b.used_on.contains(&stream) {
            b.used_on.push(stream);
        }
        Ok(())
    }

    /// The tag of a live allocation.
    pub fn tag_of(&self, ptr: DevicePtr) -> Result<TagId> {
        let st = self.state.lock();
        if let Some((_, tag)) = st.live_cached(ptr) {
            return Ok(tag);
        }
        let b = st.live_block(ptr)?;
        Ok(st.tags[b.tag as usize].tag)
    }

    /// The requested size of a live allocation.
    pub fn size_of(&self, ptr: DevicePtr) -> Result<u64> {
        let st = self.state.lock();
        if let Some((size, _)) = st.live_cached(ptr) {
            return Ok(size);
        }
        Ok(st.live_block(ptr)?.requested)
    }

    /// Unmaps every cached page (freed large runs, small segments with no live block) and
    /// releases it to the driver. Returns the bytes released. Pending frees whose events have
    /// completed are cached first; live allocations are untouched. The unmap and release calls
    /// run with the lock dropped; pages that concurrent growers are mapping are not cached yet
    /// and stay untouched.
    pub fn empty_cache(&self) -> Result<u64> {
        let mut st = self.state.lock();
        self.release_cached(&mut st)
    }

    /// Sets (or lifts) the cap on the device's own memory held ([`CachingConfig::limit`]);
    /// growth, [`onload`](Self::onload) and revocations stay under it. Lowering it below what
    /// is held empties
    /// the cache; live allocations stay, and further growth fails until under the cap. A
    /// growth already in flight (admitted under the old cap) still completes.
    pub fn set_limit(&self, limit: Option<u64>) -> Result<()> {
        let mut st = self.state.lock();
        st.limit = limit;
        let reserved = st.device_pages() * self.page;
        if limit.is_some_and(|l| reserved > l) {
            self.release_cached(&mut st)?;
        }
        Ok(())
    }

    /// The cap on the device's own memory held ([`CachingConfig::limit`]).
    pub fn limit(&self) -> Option<u64> {
        self.state.lock().limit
    }
}

fn internal(reason: String) -> Error {
    Error::InvalidState(format!("caching allocator internal error: {reason}"))
}

impl MemoryResource for CachingAllocator {
    fn allocate(&self, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        self.allocate_tagged(size, stream, UNTAGGED)
    }

    fn deallocate(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        CachingAllocator::deallocate(self, ptr, stream)
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn device(&self) -> u32 {
        self.device
    }
}
