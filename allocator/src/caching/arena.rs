//! The VA range allocator of the arena, on offsets in pages. Pure: it knows nothing of the
//! reservation behind it.
//!
//! Free ranges are kept twice: by start (to coalesce with neighbours on free) and by
//! `(length, start)` (best fit, lowest address among equals, in O(log n)).

use std::collections::{BTreeMap, BTreeSet};

/// Unmapped VA of the arena, in page units.
#[derive(Clone, Debug)]
pub struct VaArena {
    capacity: u64,
    by_start: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    free: u64,
}

impl VaArena {
    /// An arena of `capacity` units, all free.
    pub fn new(capacity: u64) -> Self {
        let mut arena = VaArena {
            capacity,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free: 0,
        };
        if capacity > 0 {
            arena.insert(0, capacity);
        }
        arena
    }

    /// Total units.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Free units.
    pub fn free_units(&self) -> u64 {
        self.free
    }

    /// Length of the largest free range.
    pub fn largest(&self) -> u64 {
        self.by_len.iter().next_back().map_or(0, |&(len, _)| len)
    }

    /// Number of free ranges.
    pub fn fragments(&self) -> usize {
        self.by_start.len()
    }

    /// Free ranges as `(start, len)`, by address.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_start.iter().map(|(&s, &l)| (s, l))
    }

    /// Takes `len` units from the smallest free range that holds them (its lowest part).
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let &(flen, start) = self.by_len.range((len, 0)..).next()?;
        self.remove(start, flen);
        if flen > len {
            self.insert(start + len, flen - len);
        }
        Some(start)
    }

    /// Takes `len` units from the smallest free range that holds them with `room` more units
    /// free after them (so that what is placed there can grow in place), else from the
    /// smallest that holds them.
    pub fn alloc_with_room(&mut self, len: u64, room: u64) -> Option<u64> {
        let roomy = len.checked_add(room).filter(|&want| want <= self.largest());
        match roomy.and_then(|want| self.by_len.range((want, 0)..).next().copied()) {
            Some((_, start)) => self.alloc_at(start, len).then_some(start),
            None => self.alloc(len),
        }
    }

    /// Takes exactly `start..start+len` if it is entirely free; false (and nothing changes)
    /// otherwise.
    pub fn alloc_at(&mut self, start: u64, len: u64) -> bool {
        if len == 0 || !self.is_free(start, len) {
            return false;
        }
        let Some((&fs, &fl)) = self.by_start.range(..=start).next_back() else {
            return false;
        };
        self.remove(fs, fl);
        if start > fs {
            self.insert(fs, start - fs);
        }
        let (end, fend) = (start + len, fs + fl);
        if fend > end {
            self.insert(end, fend - end);
        }
        true
    }

    /// Returns `start..start+len`, coalescing with free neighbours. A range outside the arena
    /// or overlapping a free range is refused (and nothing changes).
    pub fn free(&mut self, start: u64, len: u64) -> Result<(), String> {
        let end = start
            .checked_add(len)
            .filter(|&e| len > 0 && e <= self.capacity)
            .ok_or_else(|| format!("range {start}+{len} outside arena of {}", self.capacity))?;
        let prev = self
            .by_start
            .range(..=start)
            .next_back()
            .map(|(&s, &l)| (s, l));
        if let Some((ps, pl)) = prev {
            if ps + pl > start {
                return Err(format!("range {start}+{len} overlaps free range {ps}+{pl}"));
            }
        }
        let next = self.by_start.range(start..).next().map(|(&s, &l)| (s, l));
        if let Some((ns, nl)) = next {
            if ns < end {
                return Err(format!("range {start}+{len} overlaps free range {ns}+{nl}"));
            }
        }
        let (mut s, mut e) = (start, end);
        if let Some((ps, pl)) = prev.filter(|&(ps, pl)| ps + pl == start) {
            self.remove(ps, pl);
            s = ps;
        }
        if let Some((ns, nl)) = next.filter(|&(ns, _)| ns == end) {
            self.remove(ns, nl);
            e = ns + nl;
        }
        self.insert(s, e - s);
        Ok(())
    }

    /// True when `start..start+len` is entirely free.
    pub fn is_free(&self, start: u64, len: u64) -> bool {
        self.by_start
            .range(..=start)
            .next_back()
            .is_some_and(|(&s, &l)| s + l >= start.saturating_add(len))
    }

    /// Internal consistency: the two indexes agree, ranges are disjoint, non-adjacent and
    /// inside the arena, and the free count matches.
    pub fn check(&self) -> Result<(), String> {
        if self.by_start.len() != self.by_len.len() {
            return Err("arena indexes disagree in size".into());
        }
        let mut end_prev: Option<u64> = None;
        let mut total = 0u64;
        for (&s, &l) in &self.by_start {
            if l == 0 {
                return Err(format!("empty free range at {s}"));
            }
            if !self.by_len.contains(&(l, s)) {
                return Err(format!("free range {s}+{l} missing from the length index"));
            }
            if let Some(pe) = end_prev {
                if s < pe {
                    return Err(format!("free range {s}+{l} overlaps the previous one"));
                }
                if s == pe {
                    return Err(format!(
                        "free range {s}+{l} not coalesced with the previous one"
                    ));
                }
            }
            let e = s.checked_add(l).ok_or("free range overflows")?;
            if e > self.capacity {
                return Err(format!("free range {s}+{l} beyond the arena"));
            }
            end_prev = Some(e);
            total += l;
        }
        if total != self.free {
            return Err(format!(
                "free count {} but ranges sum to {total}",
                self.free
            ));
        }
        Ok(())
    }

    fn insert(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free += len;
    }

    fn remove(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_and_coalesce() {
        let mut a = VaArena::new(100);
        let x = a.alloc(10).unwrap();
        let y = a.alloc(20).unwrap();
        let z = a.alloc(10).unwrap();
        assert_eq!((x, y, z), (0, 10, 30));
        assert_eq!(a.free_units(), 60);
        a.free(x, 10).unwrap();
        a.free(z, 10).unwrap();
        a.check().unwrap();
        // Best fit: the 10-unit hole at 0 before the 70 at 30 (30..40 merged with 40..100).
        assert_eq!(a.fragments(), 2);
        assert_eq!(a.alloc(5), Some(0));
        assert_eq!(a.alloc(5), Some(5));
        assert_eq!(a.alloc(71), None);
        a.free(y, 20).unwrap();
        a.check().unwrap();
        a.free(0, 10).unwrap();
        a.check().unwrap();
        assert_eq!(a.fragments(), 1);
        // Exact ranges: taken only when wholly free; room left after a placement.
        assert!(a.alloc_at(40, 10));
        assert!(!a.alloc_at(45, 10));
        assert!(!a.alloc_at(95, 10));
        a.check().unwrap();
        assert_eq!(a.alloc_with_room(5, 20), Some(0)); // 0..40 is the smallest with room
        assert!(a.is_free(5, 35));
        assert_eq!(a.alloc_with_room(30, 40), Some(5)); // room nowhere: best fit
        a.check().unwrap();
        a.free(0, 35).unwrap();
        a.free(40, 10).unwrap();
        assert_eq!(a.free_units(), 100);
        assert_eq!(a.largest(), 100);
        assert_eq!(a.free_units(), 100);
    }

    #[test]
    fn refuses_overlaps_and_out_of_range() {
        let mut a = VaArena::new(50);
        let x = a.alloc(10).unwrap();
        assert!(a.free(x, 11).is_err()); // overlaps the free tail
        assert!(a.free(45, 10).is_err()); // beyond the arena
        assert!(a.free(u64::MAX - 1, 5).is_err()); // overflow
        assert!(a.free(x, 0).is_err());
        a.free(x, 10).unwrap();
        assert!(a.free(x, 10).is_err()); // double free
        a.check().unwrap();
        assert_eq!(a.alloc(0), None);
        assert!(a.is_free(0, 50));
    }

    #[test]
    fn random_walk_against_a_bitmap() {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(7);
        let cap = 256u64;
        let mut a = VaArena::new(cap);
        let mut used = vec![false; cap as usize];
        let mut live: Vec<(u64, u64)> = Vec::new();
        for _ in 0..5000 {
            if rng.random_bool(0.55) {
                let len = rng.random_range(1..20);
                match a.alloc(len) {
                    Some(s) => {
                        for u in s..s + len {
                            assert!(!used[u as usize], "double allocation of unit {u}");
                            used[u as usize] = true;
                        }
                        live.push((s, len));
                    }
                    None => assert!(a.largest() < len),
                }
            } else if !live.is_empty() {
                let (s, len) = live.swap_remove(rng.random_range(0..live.len()));
                for u in s..s + len {
                    used[u as usize] = false;
                }
                a.free(s, len).unwrap();
            }
            a.check().unwrap();
            assert_eq!(a.free_units(), used.iter().filter(|u| !**u).count() as u64);
        }
    }
}
