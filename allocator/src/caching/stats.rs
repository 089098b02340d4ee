//! Counters of the caching allocator, its snapshot ([`CachingAllocator::stats`]), live
//! allocations and the printable report, and human-readable sizes.

use std::fmt::Write as _;

use strata_vmm::{DevicePtr, StreamHandle};

use super::{BlockState, CachingAllocator, State, TagId, LARGE};

/// Event counts since the allocator was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorCounts {
    /// Successful allocations (non-zero sizes).
    pub allocs: u64,
    /// Successful deallocations.
    pub frees: u64,
    /// Allocations served by the small bins / by large segments.
    pub small_allocs: u64,
    pub large_allocs: u64,
    /// Allocations served from freed blocks (small bins, cached large runs).
    pub cache_hits: u64,
    /// Allocations that needed a new segment or a new mapped run.
    pub cache_misses: u64,
    /// Small segments mapped and unmapped.
    pub segments_created: u64,
    pub segments_released: u64,
    /// Large runs mapped behind a new VA range.
    pub mappings_created: u64,
    /// Backend `map` / `unmap` / `set_access` calls.
    pub map_calls: u64,
    pub unmap_calls: u64,
    pub set_access_calls: u64,
    /// Cached pages unmapped to be mapped again elsewhere (no driver allocation).
    pub pages_recycled: u64,
    /// Out-of-memory and limit errors returned.
    pub ooms: u64,
    /// Cross-stream reuses ordered with `stream_wait_event`.
    pub stream_waits: u64,
    /// Streams synchronized before unmapping.
    pub stream_syncs: u64,
    /// Frees held pending on events (`record_stream`, or freed on another stream).
    pub pending_frees: u64,
    pub sleeps: u64,
    pub wakes: u64,
    /// Times the per-thread caches' shares of the allocated-byte figures were settled with
    /// every cache locked (a cache's block passing its headroom, or a shared-path allocation
    /// passing the bound): the slow path that keeps the peaks exact with the caches on.
    pub thread_cache_settles: u64,
}

/// Per-tag figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    pub tag: TagId,
    /// Requested bytes of live allocations.
    pub allocated_bytes: u64,
    /// Block-rounded bytes of live allocations.
    pub allocated_block_bytes: u64,
    /// Bytes of pages mapped for the tag (live, cached and small segments).
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub live_allocations: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Whether the tag sleeps (pages released, VA kept).
    pub asleep: bool,
    /// Bytes held in host copies while asleep.
    pub host_copy_bytes: u64,
    /// Bytes held in a disk file while asleep (`sleep_to_disk`).
    pub disk_copy_bytes: u64,
}

/// A snapshot of the allocator's accounting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    pub device: u32,
    pub page_size: u64,
    pub arena_bytes: u64,
    /// Arena VA not mapped (free ranges), in bytes.
    pub free_va_bytes: u64,
    /// Requested bytes of live allocations.
    pub allocated_bytes: u64,
    /// Block-rounded bytes of live allocations (class size, or 512-byte multiples if large).
    pub allocated_block_bytes: u64,
    /// Bytes of pages this allocator holds mapped: live blocks, small segments and cache.
    pub reserved_bytes: u64,
    /// Pages held mapped (`reserved_bytes / page_size`).
    pub mapped_pages: u64,
    /// Bytes of freed large runs kept mapped for reuse.
    pub cached_large_bytes: u64,
    /// Bytes of pages held by large segments (live large blocks and the free room between
    /// and after them), and the free part of them.
    pub large_segment_bytes: u64,
    pub large_free_bytes: u64,
    /// Bytes of small segments with no live block, kept mapped for reuse.
    pub cached_small_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_allocated_block_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub live_allocations: u64,
    /// Freed blocks waiting for events before reuse.
    pub pending_blocks: u64,
    pub limit: Option<u64>,
    pub counts: AllocatorCounts,
    /// Every tag seen, by tag.
    pub tags: Vec<TagStats>,
}

impl AllocatorStats {
    /// Figures of one tag, if it was ever used.
    pub fn tag(&self, tag: TagId) -> Option<&TagStats> {
        self.tags.iter().find(|t| t.tag == tag)
    }
}

/// A byte figure and its peak, kept under the allocator's lock.
///
/// With thread caches (`tcache.rs`) the bytes of the blocks a cache hands out are not in
/// `value`: each cache counts its own ([`Headroom::live`]) and may raise them up to its
/// [`Headroom::cap`] without the allocator's lock; `room` is the sum of the caches' caps. While
/// `value + room <= peak`, no interleaving of the caches' fast paths can raise the total
/// (`value` plus every cache's live bytes) past `peak`, so the peak stays exact with no shared
/// write on the fast path. An increment that would break that bound goes through [`settle`]
/// with every cache locked, which measures the total, raises the peak and refits the caps.
/// Without caches `room` is 0 and this is a plain counter with its peak.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Peaked {
    value: u64,
    peak: u64,
    room: u64,
    /// `peak - room`: the fast test of [`Peaked::add`] is one compare, as without caches.
    bound: u64,
}

impl Peaked {
    /// Adds `n`; true when the caches must be settled ([`settle`]) before the lock is dropped.
    #[inline]
    #[must_use]
    pub fn add(&mut self, n: u64) -> bool {
        self.value += n;
        self.value > self.bound && self.raise()
    }

    /// Past the bound: a new peak without caches, else a settle.
    #[inline]
    fn raise(&mut self) -> bool {
        if self.room != 0 {
            return true;
        }
        self.peak = self.value;
        self.bound = self.value;
        false
    }

    /// Sets the peak and the room, and the bound from them.
    fn set(&mut self, peak: u64, room: u64) {
        self.peak = peak;
        self.room = room;
        self.bound = peak - room;
    }

    #[inline]
    pub fn sub(&mut self, n: u64) {
        self.value -= n;
    }

    /// The bytes counted here: the total, once the caches are absorbed.
    pub fn get(&self) -> u64 {
        self.value
    }

    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// The sum of the caches' caps.
    pub fn room(&self) -> u64 {
        self.room
    }

    /// Resets the peak to the current value (the caches absorbed: no room is out).
    pub fn reset_peak(&mut self) {
        debug_assert_eq!(self.room, 0, "peak reset with thread caches out");
        self.set(self.value, 0);
    }

    /// Moves `n` live bytes from a cache's figure `h` to this one (a block leaves the cache,
    /// still live), its cap with them: the total and `value + room` stay as they were.
    pub fn take_live(&mut self, h: &mut Headroom, n: u64) {
        h.live -= n;
        h.cap -= n;
        self.value += n;
        self.set(self.peak, self.room - n);
    }

    /// Takes back the cap of a cache's figure that holds no live bytes any more.
    pub fn take_cap(&mut self, h: &mut Headroom) {
        debug_assert_eq!(h.live, 0);
        self.set(self.peak, self.room - h.cap);
        h.cap = 0;
    }
}

/// One thread cache's share of a [`Peaked`] figure: the bytes of the blocks it handed out, and
/// how far they may rise before the cache must take the allocator's lock ([`settle`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Headroom {
    pub live: u64,
    pub cap: u64,
}

impl Headroom {
    #[inline]
    pub fn fits(&self, n: u64) -> bool {
        self.live + n <= self.cap
    }
}

/// Settles figure `p` with every cache's share in `shares` (all caches locked, the
/// allocator's lock held; a share's `live` may exceed its `cap` by the increment that asked):
/// the peak rises to the exact total, then caps are cut to the live bytes (the other caches'
/// first) until `value + room <= peak` holds again, and the `requester` (the index of the
/// share whose increment asked, if a cache's did) gets the slack left.
#[cold]
pub(super) fn settle(p: &mut Peaked, shares: &mut [&mut Headroom], requester: Option<usize>) {
    let live: u64 = shares.iter().map(|h| h.live).sum();
    let peak = p.peak.max(p.value + live);
    for h in shares.iter_mut() {
        h.cap = h.cap.max(h.live);
    }
    let limit = peak - p.value;
    let mut caps: u64 = shares.iter().map(|h| h.cap).sum();
    let others = (0..shares.len()).filter(|&i| Some(i) != requester);
    for i in others.chain(requester) {
        if caps <= limit {
            break;
        }
        let cut = (caps - limit).min(shares[i].cap - shares[i].live);
        shares[i].cap -= cut;
        caps -= cut;
    }
    if let Some(r) = requester {
        shares[r].cap += limit - caps;
        caps = limit;
    }
    p.set(peak, caps);
}

/// The allocator's two allocated-byte figures (requested and block-rounded), side by side:
/// an allocation or free moves both.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct AllocatedBytes {
    pub requested: Peaked,
    pub blocks: Peaked,
}

impl AllocatedBytes {
    /// True when the caches must be settled (see [`Peaked::add`]).
    #[inline]
    #[must_use]
    pub fn add(&mut self, requested: u64, block: u64) -> bool {
        self.requested.add(requested) | self.blocks.add(block)
    }

    #[inline]
    pub fn sub(&mut self, requested: u64, block: u64) {
        self.requested.sub(requested);
        self.blocks.sub(block);
    }
}

/// Running totals kept under the allocator's lock (the counts of the thread caches join these
/// when the caches are absorbed; their allocated bytes are theirs until then, `tcache.rs`).
#[derive(Clone, Debug, Default)]
pub(super) struct Totals {
    pub bytes: AllocatedBytes,
    pub live: u64,
    pub mapped_pages: u64,
    /// Of `mapped_pages`, pages of host memory or of a peer: not counted against the limit.
    pub elsewhere_pages: u64,
    pub peak_mapped_pages: u64,
    pub counts: AllocatorCounts,
}

impl Totals {
    /// True when the caches must be settled (see [`Peaked::add`]).
    #[inline]
    #[must_use]
    pub fn on_alloc(&mut self, requested: u64, block: u64) -> bool {
        self.live += 1;
        self.counts.allocs += 1;
        self.bytes.add(requested, block)
    }

    #[inline]
    pub fn on_free(&mut self, requested: u64, block: u64) {
        self.bytes.sub(requested, block);
        self.live -= 1;
        self.counts.frees += 1;
    }

    pub fn add_pages(&mut self, pages: u64) {
        self.mapped_pages += pages;
        if self.mapped_pages > self.peak_mapped_pages {
            self.peak_mapped_pages = self.mapped_pages;
        }
    }

    pub fn sub_pages(&mut self, pages: u64) {
        self.mapped_pages -= pages;
    }
}

/// Per-tag running totals.
#[derive(Clone, Debug, Default)]
pub(super) struct TagTotals {
    pub allocated: Peaked,
    pub allocated_blocks: u64,
    pub live: u64,
    pub mapped_pages: u64,
    pub allocs: u64,
    pub frees: u64,
}

impl TagTotals {
    /// True when the caches must be settled (see [`Peaked::add`]).
    #[inline]
    #[must_use]
    pub fn on_alloc(&mut self, requested: u64, block: u64) -> bool {
        self.allocated_blocks += block;
        self.live += 1;
        self.allocs += 1;
        self.allocated.add(requested)
    }

    #[inline]
    pub fn on_free(&mut self, requested: u64, block: u64) {
        self.allocated.sub(requested);
        self.allocated_blocks -= block;
        self.live -= 1;
        self.frees += 1;
    }
}

/// Live allocations listed per tag in a report.
const REPORT_PER_TAG: usize = 32;

/// One live allocation, as [`CachingAllocator::live_allocations`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveAllocation {
    pub ptr: DevicePtr,
    /// Requested bytes.
    pub size: u64,
    /// Bytes of the block that holds it (size class, or the request rounded to 512 bytes).
    pub block_size: u64,
    pub tag: TagId,
    /// The stream it was allocated on.
    pub stream: StreamHandle,
    /// Whether it is a large block (in a large segment).
    pub large: bool,
}

impl CachingAllocator {
    /// A snapshot of the accounting.
    pub fn stats(&self) -> AllocatorStats {
        let mut st = self.state.lock();
        st.absorb_caches();
        let page = self.page;
        let mut tags: Vec<TagStats> = st
            .tags
            .iter()
            .map(|t| TagStats {
                tag: t.tag,
                allocated_bytes: t.totals.allocated.get(),
                allocated_block_bytes: t.totals.allocated_blocks,
                reserved_bytes: t.totals.mapped_pages * page,
                peak_allocated_bytes: t.totals.allocated.peak(),
                live_allocations: t.totals.live,
                allocs: t.totals.allocs,
                frees: t.totals.frees,
                asleep: t.asleep(),
                host_copy_bytes: t.sleep.copy_bytes(),
                disk_copy_bytes: t.sleep.disk_bytes(),
            })
            .collect();
        tags.sort_by_key(|t| t.tag);
        AllocatorStats {
            device: self.device,
            page_size: page,
            arena_bytes: self.arena.size(),
            free_va_bytes: st.va.free_units() * page,
            allocated_bytes: st.totals.bytes.requested.get(),
            allocated_block_bytes: st.totals.bytes.blocks.get(),
            reserved_bytes: st.totals.mapped_pages * page,
            mapped_pages: st.totals.mapped_pages,
            cached_large_bytes: st.cache.pages() * page,
            large_segment_bytes: st.large.values().map(|s| s.pages).sum::<u64>() * page,
            large_free_bytes: st.extents.bytes(),
            cached_small_bytes: st
                .iter_segments()
                .filter(|&(id, s)| st.segment_live(id) == 0 && !s.mapped.is_empty())
                .map(|(_, s)| s.pages * page)
                .sum(),
            peak_allocated_bytes: st.totals.bytes.requested.peak(),
            peak_allocated_block_bytes: st.totals.bytes.blocks.peak(),
            peak_reserved_bytes: st.totals.peak_mapped_pages * page,
            live_allocations: st.totals.live,
            pending_blocks: st.pending.len() as u64,
            limit: st.limit,
            counts: st.totals.counts,
            tags,
        }
    }

    /// Resets the peaks to the current figures.
    pub fn reset_peak_stats(&self) {
        let mut st = self.state.lock();
        st.absorb_caches();
        st.totals.bytes.requested.reset_peak();
        st.totals.bytes.blocks.reset_peak();
        st.totals.peak_mapped_pages = st.totals.mapped_pages;
        for t in &mut st.tags {
            t.totals.allocated.reset_peak();
        }
    }

    /// Every live allocation, by address.
    pub fn live_allocations(&self) -> Vec<LiveAllocation> {
        let mut st = self.state.lock();
        st.absorb_caches();
        Self::live_of(&st)
    }

    pub(super) fn live_of(st: &State) -> Vec<LiveAllocation> {
        let mut v: Vec<LiveAllocation> = st
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::Live)
            .map(|b| LiveAllocation {
                ptr: b.ptr,
                size: b.requested,
                block_size: b.size,
                tag: st.tags[b.tag as usize].tag,
                stream: b.stream,
                large: b.class == LARGE,
            })
            .collect();
        v.sort_by_key(|a| a.ptr);
        v
    }

    /// A human-readable report: totals, counts, and live allocations by tag.
    pub fn report(&self) -> String {
        let stats = self.stats();
        let live = self.live_allocations();
        let mut out = String::new();
        write_summary(&mut out, &stats);
        for t in &stats.tags {
            let _ = writeln!(
                out,
                "  tag {}: {} live, {} allocated ({} blocks), {} reserved, peak {}{}",
                t.tag,
                t.live_allocations,
                human_size(t.allocated_bytes),
                human_size(t.allocated_block_bytes),
                human_size(t.reserved_bytes),
                human_size(t.peak_allocated_bytes),
                if t.asleep {
                    format!(
                        ", ASLEEP ({} in host copies)",
                        human_size(t.host_copy_bytes)
                    )
                } else {
                    String::new()
                }
            );
            write_allocations(&mut out, live.iter().filter(|a| a.tag == t.tag));
        }
        out
    }
}

pub(super) fn write_allocations<'a>(
    out: &mut String,
    allocs: impl Iterator<Item = &'a LiveAllocation>,
) {
    let mut shown = 0usize;
    let mut hidden = 0usize;
    for a in allocs {
        if shown == REPORT_PER_TAG {
            hidden += 1;
            continue;
        }
        shown += 1;
        let _ = writeln!(
            out,
            "    {:#014x}  {:>11}  (block {}, {}, stream {:#x})",
            a.ptr,
            human_size(a.size),
            human_size(a.block_size),
            if a.large { "large" } else { "small" },
            a.stream.0
        );
    }
    if hidden > 0 {
        let _ = writeln!(out, "    ... and {hidden} more");
    }
}

/// `1536` → `"1.50 KiB"`; bytes below 1 KiB print exactly.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// The summary lines of a report.
pub(super) fn write_summary(out: &mut String, s: &AllocatorStats) {
    let limit = s.limit.map_or_else(|| "none".to_string(), human_size);
    let _ = writeln!(
        out,
        "CachingAllocator on device {} (page {}, arena {}, {} of VA unmapped)",
        s.device,
        human_size(s.page_size),
        human_size(s.arena_bytes),
        human_size(s.free_va_bytes)
    );
    let _ = writeln!(
        out,
        "  allocated {} (blocks {}) in {} allocations; peak {}",
        human_size(s.allocated_bytes),
        human_size(s.allocated_block_bytes),
        s.live_allocations,
        human_size(s.peak_allocated_bytes)
    );
    let _ = writeln!(
        out,
        "  reserved {} ({} pages, {} cached large); peak {}; limit {}",
        human_size(s.reserved_bytes),
        s.mapped_pages,
        human_size(s.cached_large_bytes),
        human_size(s.peak_reserved_bytes),
        limit
    );
    let c = &s.counts;
    let _ = writeln!(
        out,
        "  {} allocs, {} frees, {} hits, {} misses, {} ooms; {} segments (+{} -{}), {} runs mapped; \
         {} map, {} unmap, {} set_access calls; {} pages recycled; {} stream waits, {} syncs, {} pending; \
         {} thread-cache settles",
        c.allocs,
        c.frees,
        c.cache_hits,
        c.cache_misses,
        c.ooms,
        c.segments_created - c.segments_released,
        c.segments_created,
        c.segments_released,
        c.mappings_created,
        c.map_calls,
        c.unmap_calls,
        c.set_access_calls,
        c.pages_recycled,
        c.stream_waits,
        c.stream_syncs,
        s.pending_blocks,
        c.thread_cache_settles
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1023), "1023 B");
        assert_eq!(human_size(1536), "1.50 KiB");
        assert_eq!(human_size(2 << 20), "2.00 MiB");
        assert_eq!(human_size(1 << 40), "1.00 TiB");
        assert_eq!(human_size(u64::MAX), "16.00 EiB");
    }

    #[test]
    fn totals_track_peaks() {
        let mut t = Totals::default();
        assert!(!t.on_alloc(100, 256));
        assert!(!t.on_alloc(300, 512));
        t.on_free(100, 256);
        let b = &mut t.bytes;
        assert_eq!((b.requested.get(), b.blocks.get(), t.live), (300, 512, 1));
        assert_eq!((b.requested.peak(), b.blocks.peak()), (400, 768));
        b.requested.reset_peak();
        assert_eq!(b.requested.peak(), 300);
        t.add_pages(3);
        t.sub_pages(2);
        assert_eq!((t.mapped_pages, t.peak_mapped_pages), (1, 3));
    }

    /// The total a figure and its caches' shares stand for.
    fn total(p: &Peaked, shares: &[Headroom]) -> u64 {
        p.get() + shares.iter().map(|h| h.live).sum::<u64>()
    }

    /// Settles `p` with `shares`, then checks the bound that makes the caches' fast paths safe.
    fn settle_all(p: &mut Peaked, shares: &mut [Headroom], requester: Option<usize>) {
        let mut refs: Vec<&mut Headroom> = shares.iter_mut().collect();
        settle(p, &mut refs, requester);
        assert!(shares.iter().all(|h| h.live <= h.cap), "{shares:?}");
        assert_eq!(p.room(), shares.iter().map(|h| h.cap).sum::<u64>());
        assert!(p.get() + p.room() <= p.peak(), "{p:?} {shares:?}");
    }

    /// Two caches taking turns, then overlapping: each increment inside its cap is safe, each
    /// one past it settles, and the peak is the largest total ever held.
    #[test]
    fn settled_caps_keep_the_peak_exact() {
        let mut p = Peaked::default();
        let mut shares = [Headroom::default(); 2];
        let mut true_peak = 0;
        // (cache, +bytes or -bytes) in program order.
        let steps: &[(usize, i64)] = &[
            (0, 100),
            (0, -100),
            (1, 100),
            (1, -100),
            (0, 100),
            (1, 100),
            (1, -100),
            (0, -100),
            (1, 300),
            (0, 50),
            (1, -300),
            (0, -50),
        ];
        for &(c, d) in steps {
            if d < 0 {
                shares[c].live -= d.unsigned_abs();
            } else {
                let n = d as u64;
                let fits = shares[c].fits(n);
                shares[c].live += n;
                if !fits {
                    settle_all(&mut p, &mut shares, Some(c));
                }
            }
            true_peak = true_peak.max(total(&p, &shares));
            assert_eq!(p.peak(), true_peak, "after {c} {d}");
        }
        // The shared path: an increment past value + room settles without a requester.
        let mut shares = [
            Headroom { live: 0, cap: 0 },
            Headroom { live: 40, cap: 400 },
        ];
        settle_all(&mut p, &mut shares, None);
        assert!(p.add(400 - p.room()), "value + room passes the peak");
        let before = p.peak();
        settle_all(&mut p, &mut shares, None);
        assert_eq!(p.peak(), before.max(total(&p, &shares)));
        // A live block leaving a cache keeps the total and the bound.
        let t = total(&p, &shares);
        let (room, peak) = (p.room(), p.peak());
        p.take_live(&mut shares[1], 40);
        assert_eq!(
            (total(&p, &shares), p.room(), p.peak()),
            (t, room - 40, peak)
        );
        p.take_cap(&mut shares[1]);
        assert_eq!(p.room(), shares[0].cap);
    }
}

/// Driver calls made with the lock dropped, added to the counts once it is held again.
#[derive(Default)]
pub(super) struct DriverCalls {
    pub(super) map: u64,
    pub(super) unmap: u64,
    pub(super) set_access: u64,
}

impl DriverCalls {
    pub(super) fn add_to(&self, counts: &mut AllocatorCounts) {
        counts.map_calls += self.map;
        counts.unmap_calls += self.unmap;
        counts.set_access_calls += self.set_access;
    }
}
