//! Size classes and per-stream free lists of small blocks. Pure: sizes and block ids in, sizes
//! and block ids out; no backend, no pointers.
//!
//! Classes are multiples of [`MIN_ALIGN`] (256 B): 256, 512, 768 and 1024 B, then four
//! geometric sub-steps per power of two (1280, 1536, 1792, 2048, 2560, ...), so a small block
//! wastes at most a quarter of its size.
//!
//! Where blocks come from: a page is cut into [`CHUNKS_PER_PAGE`] chunks, and each class whose
//! blocks fit in a page carves them from a *run* of a few contiguous chunks ([`run_units`]
//! picks a count whose tail waste is at most 1/8) inside a page shared by every class of the
//! tag. So a class in use costs one run (a 64 KiB chunk for classes up to 64 KiB, with 2 MiB
//! pages), not a page. Only classes larger than a page (small pages) get segments of their own,
//! of a few pages ([`segment_pages`]).

use strata_vmm::StreamHandle;

/// Alignment (and granule) of every small block; every pointer handed out is a multiple of it.
pub const MIN_ALIGN: u64 = 256;

/// Most pages a small segment spans (a class above this many pages is not small).
pub const MAX_SEGMENT_PAGES: u64 = 16;

/// The class index of a request of `size` bytes (any `size`, `0` behaves as `1`), in O(1).
#[inline]
pub fn class_index(size: u64) -> usize {
    let units = size.div_ceil(MIN_ALIGN).max(1);
    if units <= 4 {
        return (units - 1) as usize;
    }
    // units lies in (2^k, 2^(k+1)] with k >= 2; four sub-steps of 2^(k-2) units each.
    let k = 63 - (units - 1).leading_zeros();
    let step = 1u64 << (k - 2);
    let sub = (units - (1u64 << k)).div_ceil(step);
    (4 + (k as u64 - 2) * 4 + (sub - 1)) as usize
}

/// The block size of class `index` (inverse of [`class_index`]).
#[inline]
pub fn class_size(index: usize) -> u64 {
    if index < 4 {
        return (index as u64 + 1) * MIN_ALIGN;
    }
    let i = index as u64 - 4;
    let k = i / 4 + 2;
    let sub = i % 4 + 1;
    ((1u64 << k) + sub * (1u64 << (k - 2))) * MIN_ALIGN
}

/// Chunks a shared page is cut into (the granule of the runs classes carve blocks from).
pub const CHUNKS_PER_PAGE: u64 = 32;

/// Pages of a segment for blocks of `class_bytes`: the fewest pages (at least enough for one
/// block) whose unusable tail is at most 1/8 of the segment, else the least wasteful of the
/// first few candidates.
pub fn segment_pages(class_bytes: u64, page: u64) -> u64 {
    run_units(class_bytes, page, MAX_SEGMENT_PAGES)
}

/// Units of `unit` bytes for a run of blocks of `class_bytes`: the fewest (at least enough for
/// one block, at most `max` unless one block needs more) whose unusable tail is at most 1/8 of
/// the run, else the least wasteful of the first few candidates.
pub fn run_units(class_bytes: u64, unit: u64, max: u64) -> u64 {
    let min = class_bytes.div_ceil(unit).max(1);
    let page = unit;
    let mut best = (u64::MAX, min);
    for pages in min..=(min * 4).min(max).max(min) {
        let bytes = pages * page;
        let waste = bytes % class_bytes;
        if waste * 8 <= bytes {
            return pages;
        }
        // Compare waste fractions waste/bytes without division.
        let (bw, bp) = best;
        if bw == u64::MAX
            || (waste as u128) * (bp as u128 * page as u128) < (bw as u128) * (bytes as u128)
        {
            best = (waste, pages);
        }
    }
    best.1
}

/// The size classes below a threshold, with their run (or segment) sizes.
#[derive(Clone, Debug)]
pub struct SizeClasses {
    threshold: u64,
    sizes: Vec<u64>,
    seg_pages: Vec<u64>,
    chunk: u64,
    /// Chunks of a run in a shared page; 0 for a class that needs segments of its own.
    run_chunks: Vec<u64>,
}

impl SizeClasses {
    /// Classes for every size in `1..threshold`, carved from `page`-sized pages.
    /// `threshold` must be at least 1 and its class at most [`MAX_SEGMENT_PAGES`] pages.
    pub fn new(threshold: u64, page: u64) -> Self {
        let count = if threshold <= 1 {
            0
        } else {
            class_index(threshold - 1) + 1
        };
        let sizes: Vec<u64> = (0..count).map(class_size).collect();
        let seg_pages = sizes.iter().map(|&s| segment_pages(s, page)).collect();
        // Chunks are whole multiples of the block alignment; pages too small for that are not
        // shared (every class gets segments of its own).
        let chunk = page / CHUNKS_PER_PAGE;
        let shareable = chunk >= MIN_ALIGN && chunk % MIN_ALIGN == 0;
        let run_chunks = sizes
            .iter()
            .map(|&s| {
                if shareable && s <= page {
                    run_units(s, chunk, CHUNKS_PER_PAGE)
                } else {
                    0
                }
            })
            .collect();
        SizeClasses {
            threshold,
            sizes,
            seg_pages,
            chunk,
            run_chunks,
        }
    }

    /// Bytes of one chunk of a shared page.
    #[inline]
    pub fn chunk_size(&self) -> u64 {
        self.chunk
    }

    /// Chunks of one run of a class in a shared page, or `None` when the class needs segments
    /// of its own (blocks larger than a page, or pages too small to cut).
    #[inline]
    pub fn run_chunks(&self, class: usize) -> Option<u64> {
        Some(self.run_chunks[class]).filter(|&c| c > 0)
    }

    /// Sizes below this are small.
    #[inline]
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Number of classes.
    #[inline]
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// True when there are no small classes (threshold 0 or 1).
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// Block size of a class.
    #[inline]
    pub fn size(&self, class: usize) -> u64 {
        self.sizes[class]
    }

    /// Pages of one segment of a class.
    #[inline]
    pub fn segment_pages(&self, class: usize) -> u64 {
        self.seg_pages[class]
    }

    /// Blocks in one segment of a class.
    pub fn blocks_per_segment(&self, class: usize, page: u64) -> u64 {
        self.seg_pages[class] * page / self.sizes[class]
    }
}

/// Free block ids of one (tag, class), one LIFO list per stream they were freed on. A block on
/// stream S's list may be reused on S at once; on another stream only after an event orders it.
#[derive(Clone, Debug, Default)]
pub struct ClassBin {
    lists: Vec<(StreamHandle, Vec<u32>)>,
}

impl ClassBin {
    /// Pops a block freed on `stream` (the fast path: a short scan and a `Vec::pop`).
    #[inline]
    pub fn pop(&mut self, stream: StreamHandle) -> Option<u32> {
        for (s, ids) in &mut self.lists {
            if *s == stream {
                return ids.pop();
            }
        }
        None
    }

    /// Pushes a block freed on `stream`.
    #[inline]
    pub fn push(&mut self, stream: StreamHandle, id: u32) {
        for (s, ids) in &mut self.lists {
            if *s == stream {
                ids.push(id);
                return;
            }
        }
        self.push_new_stream(stream, id);
    }

    #[cold]
    #[inline(never)]
    fn push_new_stream(&mut self, stream: StreamHandle, id: u32) {
        self.lists.push((stream, vec![id]));
    }

    /// Streams other than `stream` that hold free blocks.
    pub fn other_streams(&self, stream: StreamHandle) -> Vec<StreamHandle> {
        self.lists
            .iter()
            .filter(|(s, ids)| *s != stream && !ids.is_empty())
            .map(|(s, _)| *s)
            .collect()
    }

    /// Moves every block of `from`'s list to `to`'s list (after the caller ordered `to` after
    /// `from` with an event).
    pub fn adopt(&mut self, from: StreamHandle, to: StreamHandle) {
        let Some(i) = self.lists.iter().position(|(s, _)| *s == from) else {
            return;
        };
        let moved = std::mem::take(&mut self.lists[i].1);
        match self.lists.iter_mut().find(|(s, _)| *s == to) {
            Some((_, ids)) => ids.extend(moved),
            None => self.lists.push((to, moved)),
        }
    }

    /// Keeps only the ids for which `keep` is true (segment release; cold).
    pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        for (_, ids) in &mut self.lists {
            ids.retain(|&id| keep(id));
        }
    }

    /// Every free id with the stream it is on.
    pub fn iter(&self) -> impl Iterator<Item = (StreamHandle, u32)> + '_ {
        self.lists
            .iter()
            .flat_map(|(s, ids)| ids.iter().map(move |&id| (*s, id)))
    }

    /// Number of free ids.
    pub fn len(&self) -> usize {
        self.lists.iter().map(|(_, ids)| ids.len()).sum()
    }

    /// True when no id is free.
    pub fn is_empty(&self) -> bool {
        self.lists.iter().all(|(_, ids)| ids.is_empty())
    }

    /// Streams with a list (empty or not).
    pub fn streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        self.lists.iter().map(|(s, _)| *s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_to_256_and_are_monotonic() {
        let mut last = 0;
        for i in 0..60 {
            let s = class_size(i);
            assert_eq!(s % MIN_ALIGN, 0, "class {i}");
            assert!(s > last, "class {i} not increasing");
            assert_eq!(class_index(s), i, "class_size/class_index disagree at {i}");
            assert_eq!(class_index(s - 1), if s - 1 <= last { i - 1 } else { i });
            last = s;
        }
        assert_eq!(
            (0..12).map(class_size).collect::<Vec<_>>(),
            vec![256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]
        );
    }

    #[test]
    fn every_size_fits_its_class_with_bounded_waste() {
        for size in (1..70_000u64).chain((1 << 20) - 1000..(1 << 20)) {
            let c = class_index(size);
            let cs = class_size(c);
            assert!(cs >= size, "size {size} class {cs}");
            if c > 0 {
                assert!(
                    class_size(c - 1) < size,
                    "size {size} not in the smallest class"
                );
            }
            // At most 25% over the request beyond the 256-byte granule.
            assert!(
                cs <= size.div_ceil(256) * 256 * 5 / 4 + 256,
                "size {size} class {cs}"
            );
        }
        assert_eq!(class_index(0), 0);
        assert!(class_index(u64::MAX) > 0); // no overflow
    }

    #[test]
    fn size_classes_cover_threshold() {
        let page = 2 << 20;
        let c = SizeClasses::new(1 << 20, page);
        assert_eq!(c.size(c.len() - 1), 1 << 20);
        assert_eq!(class_index((1 << 20) - 1), c.len() - 1);
        for i in 0..c.len() {
            let pages = c.segment_pages(i);
            assert!((1..=MAX_SEGMENT_PAGES).contains(&pages));
            let bytes = pages * page;
            assert!(bytes >= c.size(i));
            assert!(
                (bytes % c.size(i)) * 8 <= bytes,
                "class {} waste",
                c.size(i)
            );
            assert!(c.blocks_per_segment(i, page) >= 1);
        }
        assert!(SizeClasses::new(0, page).is_empty());
        assert!(SizeClasses::new(1, page).is_empty());
        assert_eq!(SizeClasses::new(257, page).len(), 1);
        assert_eq!(SizeClasses::new(258, page).len(), 2);
    }

    #[test]
    fn runs_share_pages_with_bounded_waste() {
        let page = 2 << 20;
        let c = SizeClasses::new(1 << 20, page);
        assert_eq!(c.chunk_size(), 64 << 10);
        let mut fixed = 0;
        for i in 0..c.len() {
            let k = c.run_chunks(i).expect("every class fits a page");
            assert!((1..=CHUNKS_PER_PAGE).contains(&k), "class {i}: {k} chunks");
            let bytes = k * c.chunk_size();
            assert!(bytes >= c.size(i));
            assert!(
                (bytes % c.size(i)) * 8 <= bytes,
                "class {} waste",
                c.size(i)
            );
            fixed += bytes;
        }
        // One run of every class costs a few pages, not one page per class.
        assert_eq!(c.run_chunks(0), Some(1));
        assert_eq!(c.run_chunks(c.len() - 1), Some(16));
        assert!(fixed <= 5 * page, "{fixed} bytes for one run of each class");
        // 64 KiB pages with a 1 MiB threshold: classes above a page get segments of their own.
        let tiny = SizeClasses::new(1 << 20, 64 << 10);
        assert_eq!(tiny.chunk_size(), 2 << 10);
        assert_eq!(tiny.run_chunks(0), Some(1));
        assert_eq!(tiny.run_chunks(tiny.len() - 1), None);
        // Pages too small to cut into 256-byte-aligned chunks are not shared.
        assert_eq!(SizeClasses::new(4096, 4096).run_chunks(0), None);
    }

    #[test]
    fn segment_pages_for_odd_classes() {
        let page = 2 << 20;
        assert_eq!(segment_pages(256, page), 1);
        assert_eq!(segment_pages(1 << 20, page), 1);
        // 896 KiB: two blocks in a page waste 256 KiB = 1/8.
        assert_eq!(segment_pages(896 << 10, page), 1);
        // Tiny pages: the class needs several.
        assert_eq!(segment_pages(1 << 20, 64 << 10), 16);
    }

    #[test]
    fn bin_is_lifo_per_stream_and_adopts() {
        let s1 = StreamHandle(1);
        let s2 = StreamHandle(2);
        let mut bin = ClassBin::default();
        assert_eq!(bin.pop(s1), None);
        bin.push(s1, 10);
        bin.push(s1, 11);
        bin.push(s2, 20);
        assert_eq!(bin.len(), 3);
        assert_eq!(bin.pop(s1), Some(11));
        assert_eq!(bin.other_streams(s1), vec![s2]);
        assert_eq!(bin.other_streams(s2), vec![s1]);
        bin.adopt(s2, s1);
        assert!(bin.other_streams(s1).is_empty());
        assert_eq!(bin.pop(s2), None);
        let mut got = vec![bin.pop(s1).unwrap(), bin.pop(s1).unwrap()];
        got.sort();
        assert_eq!(got, vec![10, 20]);
        assert!(bin.is_empty());
        bin.push(s2, 5);
        bin.push(s2, 6);
        bin.retain(|id| id != 5);
        assert_eq!(bin.iter().collect::<Vec<_>>(), vec![(s2, 6)]);
    }
}
