//! The cache of freed large blocks: mapped page runs of the arena, indexed by start (to coalesce
//! neighbours) and by `(tag, pages, start)` (best fit per tag). Pure over its payload: the
//! allocator stores the page mappings in `P`; tests store plain vectors.
//!
//! A run bigger than a request is split (its head serves the request, its tail stays cached), so
//! reusing a cached run never wastes pages; adjacent runs of one tag freed on one stream merge.

use std::collections::{BTreeMap, BTreeSet};

use strata_vmm::StreamHandle;

/// What a cached run carries per page, splittable and joinable.
pub trait Run: Sized {
    /// Splits off everything from page `at` on.
    fn split_off(&mut self, at: usize) -> Self;
    /// Appends the pages of `other` (which follows `self` in the arena).
    fn append(&mut self, other: Self);
}

impl<T> Run for Vec<T> {
    fn split_off(&mut self, at: usize) -> Self {
        Vec::split_off(self, at)
    }

    fn append(&mut self, mut other: Self) {
        Vec::append(self, &mut other)
    }
}

/// One cached run of `pages` pages.
#[derive(Debug)]
pub struct CachedRun<P> {
    pub pages: u64,
    /// Tag index it belongs to (tags never share pages).
    pub tag: u32,
    /// Stream it was freed on: reusable at once there, elsewhere after an event.
    pub stream: StreamHandle,
    pub payload: P,
}

/// Cached runs by start page.
#[derive(Debug)]
pub struct RangeCache<P> {
    by_start: BTreeMap<u64, CachedRun<P>>,
    by_size: BTreeSet<(u32, u64, u64)>,
    pages: u64,
}

impl<P> Default for RangeCache<P> {
    fn default() -> Self {
        RangeCache {
            by_start: BTreeMap::new(),
            by_size: BTreeSet::new(),
            pages: 0,
        }
    }
}

impl<P: Run> RangeCache<P> {
    /// Total cached pages.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Number of runs.
    pub fn len(&self) -> usize {
        self.by_start.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }

    /// Runs by start.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &CachedRun<P>)> {
        self.by_start.iter().map(|(&s, r)| (s, r))
    }

    /// The run starting at `start`.
    pub fn get(&self, start: u64) -> Option<&CachedRun<P>> {
        self.by_start.get(&start)
    }

    /// Cached pages of one tag.
    pub fn pages_of_tag(&self, tag: u32) -> u64 {
        self.by_size
            .range((tag, 0, 0)..=(tag, u64::MAX, u64::MAX))
            .map(|&(_, p, _)| p)
            .sum()
    }

    /// Starts of every run of a tag.
    pub fn starts_of_tag(&self, tag: u32) -> Vec<u64> {
        self.by_size
            .range((tag, 0, 0)..=(tag, u64::MAX, u64::MAX))
            .map(|&(_, _, s)| s)
            .collect()
    }

    /// Starts of all runs, smallest first (the order in which runs give their pages back).
    pub fn starts_smallest_first(&self) -> Vec<u64> {
        let mut v: Vec<(u64, u64)> = self.by_start.iter().map(|(&s, r)| (r.pages, s)).collect();
        v.sort_unstable();
        v.into_iter().map(|(_, s)| s).collect()
    }

    /// Inserts a run at `start`, merging it with an adjacent run of the same tag and stream on
    /// either side. The caller guarantees it overlaps no cached run.
    pub fn insert(&mut self, start: u64, mut run: CachedRun<P>) {
        let mut start = start;
        let prev = self
            .by_start
            .range(..start)
            .next_back()
            .map(|(&s, r)| (s, r.pages, r.tag, r.stream));
        if let Some((ps, pp, ptag, pstream)) = prev {
            if ps + pp == start && ptag == run.tag && pstream == run.stream {
                if let Some(mut p) = self.remove(ps) {
                    p.payload.append(run.payload);
                    p.pages += run.pages;
                    run = p;
                    start = ps;
                }
            }
        }
        let end = start + run.pages;
        let next = self.by_start.get(&end).map(|r| (r.tag, r.stream));
        if next == Some((run.tag, run.stream)) {
            if let Some(n) = self.remove(end) {
                run.payload.append(n.payload);
                run.pages += n.pages;
            }
        }
        self.by_size.insert((run.tag, run.pages, start));
        self.pages += run.pages;
        self.by_start.insert(start, run);
    }

    /// The smallest run of `tag` with at least `pages` pages (lowest address among equals).
    pub fn best_fit(&self, tag: u32, pages: u64) -> Option<u64> {
        self.by_size
            .range((tag, pages, 0)..=(tag, u64::MAX, u64::MAX))
            .next()
            .map(|&(_, _, s)| s)
    }

    /// Removes the run at `start` whole.
    pub fn remove(&mut self, start: u64) -> Option<CachedRun<P>> {
        let run = self.by_start.remove(&start)?;
        self.by_size.remove(&(run.tag, run.pages, start));
        self.pages -= run.pages;
        Some(run)
    }

    /// Takes the first `pages` pages of the run at `start`; the rest stays cached.
    pub fn take_head(&mut self, start: u64, pages: u64) -> Option<CachedRun<P>> {
        let run = self.by_start.get(&start)?;
        if pages == 0 || pages > run.pages {
            return None;
        }
        let mut head = self.remove(start)?;
        if pages < head.pages {
            let tail = CachedRun {
                pages: head.pages - pages,
                tag: head.tag,
                stream: head.stream,
                payload: head.payload.split_off(pages as usize),
            };
            head.pages = pages;
            self.reinsert(start + pages, tail);
        }
        Some(head)
    }

    /// Takes the last `pages` pages of the run at `start`; returns their start and the run.
    pub fn take_tail(&mut self, start: u64, pages: u64) -> Option<(u64, CachedRun<P>)> {
        let run = self.by_start.get(&start)?;
        if pages == 0 || pages > run.pages {
            return None;
        }
        let keep = run.pages - pages;
        let mut whole = self.remove(start)?;
        if keep == 0 {
            return Some((start, whole));
        }
        let tail = CachedRun {
            pages,
            tag: whole.tag,
            stream: whole.stream,
            payload: whole.payload.split_off(keep as usize),
        };
        whole.pages = keep;
        self.reinsert(start, whole);
        Some((start + keep, tail))
    }

    /// Inserts without merging (a split part of a run that was already maximal).
    fn reinsert(&mut self, start: u64, run: CachedRun<P>) {
        self.by_size.insert((run.tag, run.pages, start));
        self.pages += run.pages;
        self.by_start.insert(start, run);
    }

    /// Internal consistency: indexes agree, runs are disjoint and non-empty.
    pub fn check(&self) -> Result<(), String> {
        if self.by_size.len() != self.by_start.len() {
            return Err("cache indexes disagree in size".into());
        }
        let mut prev_end = 0u64;
        let mut total = 0;
        for (&s, r) in &self.by_start {
            if r.pages == 0 {
                return Err(format!("empty cached run at page {s}"));
            }
            if s < prev_end {
                return Err(format!("cached run at page {s} overlaps the previous one"));
            }
            if !self.by_size.contains(&(r.tag, r.pages, s)) {
                return Err(format!(
                    "cached run at page {s} missing from the size index"
                ));
            }
            prev_end = s + r.pages;
            total += r.pages;
        }
        if total != self.pages {
            return Err(format!(
                "cache counts {} pages, runs hold {total}",
                self.pages
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StreamHandle = StreamHandle(0);
    const S1: StreamHandle = StreamHandle(1);

    fn run(start: u64, pages: u64, tag: u32, stream: StreamHandle) -> CachedRun<Vec<u64>> {
        CachedRun {
            pages,
            tag,
            stream,
            payload: (start..start + pages).collect(),
        }
    }

    #[test]
    fn merges_neighbours_of_same_tag_and_stream_only() {
        let mut c = RangeCache::default();
        c.insert(0, run(0, 4, 0, S0));
        c.insert(8, run(8, 4, 0, S0));
        c.insert(4, run(4, 4, 0, S0));
        c.check().unwrap();
        assert_eq!(c.len(), 1);
        let r = c.iter().next().unwrap().1;
        assert_eq!(r.payload, (0..12).collect::<Vec<_>>());
        c.insert(12, run(12, 2, 1, S0)); // other tag
        c.insert(14, run(14, 2, 1, S1)); // other stream
        c.check().unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c.pages(), 16);
        assert_eq!(c.pages_of_tag(0), 12);
        assert_eq!(c.pages_of_tag(1), 4);
    }

    #[test]
    fn best_fit_splits_head_and_tail() {
        let mut c = RangeCache::default();
        c.insert(0, run(0, 10, 0, S0));
        c.insert(20, run(20, 3, 0, S0));
        c.insert(30, run(30, 3, 7, S0));
        assert_eq!(c.best_fit(0, 3), Some(20));
        assert_eq!(c.best_fit(0, 4), Some(0));
        assert_eq!(c.best_fit(0, 11), None);
        assert_eq!(c.best_fit(7, 3), Some(30));
        assert_eq!(c.best_fit(5, 1), None);
        let head = c.take_head(0, 4).unwrap();
        assert_eq!(head.payload, vec![0, 1, 2, 3]);
        assert_eq!(c.best_fit(0, 6), Some(4));
        let (ts, tail) = c.take_tail(4, 2).unwrap();
        assert_eq!((ts, tail.payload), (8, vec![8, 9]));
        c.check().unwrap();
        assert_eq!(c.pages(), 4 + 3 + 3);
        assert!(c.take_head(4, 5).is_none());
        let (ts, whole) = c.take_tail(4, 4).unwrap();
        assert_eq!((ts, whole.pages), (4, 4));
        assert_eq!(c.starts_smallest_first(), vec![20, 30]);
        assert_eq!(c.starts_of_tag(7), vec![30]);
        c.check().unwrap();
    }
}
