//! Large blocks at a finer unit than a page: mapped runs of whole pages (*large segments*, one
//! tag and one stream each) hold blocks rounded to [`LARGE_ALIGN`] bytes, so a 2.1 MiB tensor
//! no longer holds two whole pages by itself: the rest of its last page serves the next
//! allocation of the segment's stream (PyTorch's block splitting, on pages that need not be
//! physically contiguous). Pure: addresses and lengths in, addresses out.
//!
//! - Free byte ranges of segments are *extents*, indexed by address (to coalesce with
//!   neighbours of the same segment) and by `(tag, stream, length, address)` (best fit for an
//!   allocation on the segment's stream, lowest address among equals).
//! - A segment whose blocks are all free leaves the table: its pages join the cache of free
//!   page runs ([`super::RangeCache`]), where any stream may take them after an event.
//! - A segment grows in place (PyTorch's expandable segments): a request that fits no extent
//!   and no cached run maps the fewest new pages right after a segment of its stream whose
//!   free tail, joined to them, holds it, when that VA is free. New segments map only the
//!   pages their first block needs and are placed with room after them, so blocks of mid
//!   sizes share pages without reserving a 20 MiB segment up front.
//! - Whole free pages inside a segment stay mapped (a later block of the segment fills them)
//!   until growth needs pages, `empty_cache` or sleep *cuts* them out: the segment splits
//!   around them and they join the cache as a run, so trimming still returns whole pages.

use std::collections::{BTreeMap, BTreeSet};

use strata_vmm::StreamHandle;

/// Alignment and rounding unit of large blocks (PyTorch's block rounding).
pub const LARGE_ALIGN: u64 = 512;

/// Requests below this many bytes take a cached run of up to [`MID_SEGMENT_BYTES`] for their
/// segment, and new segments for them leave that much room to grow in place, so that several
/// of them share pages (PyTorch's 20 MiB segments for requests below 10 MiB).
pub const MID_SIZE_LIMIT: u64 = 10 << 20;
/// Segment size for requests below [`MID_SIZE_LIMIT`].
pub const MID_SEGMENT_BYTES: u64 = 20 << 20;

/// Pages of a segment for a block of `len` bytes, when `reserved_pages` are held: the fewest
/// that hold it, or for mid sizes up to [`MID_SEGMENT_BYTES`] but never more than are held
/// already (a small workload does not take 20 MiB for its first block). Used for the cached
/// run a new segment takes, and (with no cap) for the room left after a new segment.
pub fn segment_pages(len: u64, page: u64, reserved_pages: u64) -> u64 {
    let need = len.div_ceil(page).max(1);
    if len >= MID_SIZE_LIMIT {
        return need;
    }
    let mid = (MID_SEGMENT_BYTES / page).min(reserved_pages);
    need.max(mid)
}

/// A mapped run of whole pages holding large blocks of one tag, for one stream. `P` is what
/// the allocator keeps per page (its mappings).
#[derive(Debug)]
pub struct LargeSegment<P> {
    pub pages: u64,
    /// Tag index.
    pub tag: u32,
    /// Blocks are carved for this stream only; others reuse the pages once the segment is
    /// wholly free (cached) or its pages are cut out.
    pub stream: StreamHandle,
    /// The pages (empty while the tag sleeps).
    pub mapped: P,
}

/// Free ranges of large segments. Addresses and lengths are bytes, multiples of
/// [`LARGE_ALIGN`].
#[derive(Debug, Default)]
pub struct Extents {
    /// start → (length, tag, stream)
    by_addr: BTreeMap<u64, (u64, u32, StreamHandle)>,
    by_size: BTreeSet<(u32, StreamHandle, u64, u64)>,
    bytes: u64,
}

impl Extents {
    /// Total free bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of extents.
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// True when there is none.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// Extents as `(start, length)`, by address.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_addr.iter().map(|(&s, &(l, _, _))| (s, l))
    }

    /// Extents lying in `lo..hi`, by address.
    pub fn within(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        self.by_addr
            .range(lo..hi)
            .map(|(&s, &(l, _, _))| (s, l))
            .collect()
    }

    /// Inserts the free range `start..start+len` of a segment spanning `lo..hi` (of `tag`, on
    /// `stream`), merged with free neighbours inside the same segment. Returns the merged
    /// extent. The caller guarantees it overlaps no extent.
    pub fn insert(
        &mut self,
        start: u64,
        len: u64,
        (lo, hi): (u64, u64),
        tag: u32,
        stream: StreamHandle,
    ) -> (u64, u64) {
        let (mut s, mut e) = (start, start + len);
        if s > lo {
            let prev = self
                .by_addr
                .range(..s)
                .next_back()
                .map(|(&ps, &(pl, _, _))| (ps, pl));
            if let Some((ps, _)) = prev.filter(|&(ps, pl)| ps + pl == s && ps >= lo) {
                self.remove(ps);
                s = ps;
            }
        }
        if e < hi {
            if let Some(&(nl, _, _)) = self.by_addr.get(&e) {
                self.remove(e);
                e += nl;
            }
        }
        self.by_addr.insert(s, (e - s, tag, stream));
        self.by_size.insert((tag, stream, e - s, s));
        self.bytes += e - s;
        (s, e - s)
    }

    /// The extent that ends at `end` and starts at or after `lo`: `(start, length)`.
    pub fn ending_at(&self, end: u64, lo: u64) -> Option<(u64, u64)> {
        self.by_addr
            .range(lo..end)
            .next_back()
            .map(|(&s, &(l, _, _))| (s, l))
            .filter(|&(s, l)| s + l == end)
    }

    /// Removes the extent at `start`; returns its length.
    pub fn remove(&mut self, start: u64) -> Option<u64> {
        let (len, tag, stream) = self.by_addr.remove(&start)?;
        self.by_size.remove(&(tag, stream, len, start));
        self.bytes -= len;
        Some(len)
    }

    /// The smallest extent of `tag` on `stream` with at least `len` bytes.
    pub fn best_fit(&self, tag: u32, stream: StreamHandle, len: u64) -> Option<u64> {
        self.by_size
            .range((tag, stream, len, 0)..=(tag, stream, u64::MAX, u64::MAX))
            .next()
            .map(|&(_, _, _, s)| s)
    }

    /// Extents holding at least one whole page, largest first: `(start, length)`.
    pub fn with_whole_pages(&self, page: u64) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .by_addr
            .iter()
            .map(|(&s, &(l, _, _))| (s, l))
            .filter(|&(s, l)| whole_pages(s, l, page).1 > 0)
            .collect();
        v.sort_unstable_by_key(|&(s, l)| (std::cmp::Reverse(l), s));
        v
    }

    /// The tag and stream an extent was filed under.
    pub fn owner(&self, start: u64) -> Option<(u32, StreamHandle)> {
        self.by_addr.get(&start).map(|&(_, t, s)| (t, s))
    }

    /// Internal consistency: indexes agree, extents are disjoint, non-empty and aligned.
    pub fn check(&self) -> Result<(), String> {
        if self.by_addr.len() != self.by_size.len() {
            return Err("extent indexes disagree in size".into());
        }
        let mut prev_end = 0u64;
        let mut total = 0u64;
        for (&s, &(l, t, st)) in &self.by_addr {
            if l == 0 || s % LARGE_ALIGN != 0 || l % LARGE_ALIGN != 0 {
                return Err(format!("extent {s:#x}+{l:#x} empty or misaligned"));
            }
            if s < prev_end {
                return Err(format!("extent {s:#x} overlaps the previous one"));
            }
            if !self.by_size.contains(&(t, st, l, s)) {
                return Err(format!("extent {s:#x} missing from the size index"));
            }
            prev_end = s + l;
            total += l;
        }
        if total != self.bytes {
            return Err(format!("extents count {} bytes, hold {total}", self.bytes));
        }
        Ok(())
    }
}

/// The whole pages inside `start..start+len`: (first page's byte address, page count).
pub fn whole_pages(start: u64, len: u64, page: u64) -> (u64, u64) {
    let first = start.div_ceil(page) * page;
    let end = (start + len) / page * page;
    if end > first {
        (first, (end - first) / page)
    } else {
        (first, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StreamHandle = StreamHandle(0);
    const S1: StreamHandle = StreamHandle(1);
    const P: u64 = 2 << 20;

    #[test]
    fn extents_merge_inside_a_segment_only() {
        let mut x = Extents::default();
        let seg_a = (0, 2 * P);
        let seg_b = (2 * P, 4 * P);
        x.insert(P, P, seg_a, 0, S0);
        x.insert(2 * P, 1024, seg_b, 0, S0); // adjacent, other segment: no merge
        assert_eq!(x.len(), 2);
        assert_eq!(x.insert(512, P - 512, seg_a, 0, S0), (512, 2 * P - 512));
        assert_eq!(x.len(), 2);
        x.check().unwrap();
        assert_eq!(x.best_fit(0, S0, 1024), Some(2 * P));
        assert_eq!(x.best_fit(0, S0, 2048), Some(512));
        assert_eq!(x.best_fit(0, S1, 512), None);
        assert_eq!(x.best_fit(1, S0, 512), None);
        assert_eq!(x.remove(512), Some(2 * P - 512));
        assert_eq!(x.bytes(), 1024);
        assert_eq!(x.within(0, 2 * P), vec![]);
        assert_eq!(x.owner(2 * P), Some((0, S0)));
        x.check().unwrap();
    }

    #[test]
    fn whole_pages_and_segment_sizes() {
        assert_eq!(whole_pages(512, 3 * P, P), (P, 2));
        assert_eq!(whole_pages(P, P, P), (P, 1));
        assert_eq!(whole_pages(512, P, P).1, 0);
        let mut x = Extents::default();
        x.insert(512, P, (0, 4 * P), 0, S0);
        x.insert(2 * P, 2 * P, (0, 4 * P), 0, S0);
        assert_eq!(x.with_whole_pages(P), vec![(2 * P, 2 * P)]);
        // Mid sizes grow to 20 MiB segments once the allocator holds that much.
        assert_eq!(segment_pages(P + 1, P, 0), 2);
        assert_eq!(segment_pages(P + 1, P, 4), 4);
        assert_eq!(segment_pages(P + 1, P, 100), 10);
        assert_eq!(segment_pages(12 << 20, P, 100), 6);
        assert_eq!(segment_pages(1, P, 0), 1);
    }
}
