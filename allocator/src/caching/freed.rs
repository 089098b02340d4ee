//! Recently freed pointers, so that a double free is told from an unknown pointer.

use std::collections::{BTreeMap, VecDeque};

/// Recently freed pointers and released segments (start → (length, stride)), bounded, so a
/// double free is told from an unknown pointer. Entries are dropped when their VA is reused.
#[derive(Default)]
pub(super) struct FreedLog {
    entries: BTreeMap<u64, (u64, u64)>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl FreedLog {
    /// A log of the last `capacity` entries (0: keeps none).
    pub(super) fn new(capacity: usize) -> Self {
        FreedLog {
            capacity,
            ..FreedLog::default()
        }
    }

    pub(super) fn record(&mut self, start: u64, len: u64, stride: u64) {
        if self.capacity == 0 {
            return;
        }
        self.entries.insert(start, (len, stride.max(1)));
        self.order.push_back(start);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.entries.remove(&old);
            }
        }
    }

    pub(super) fn contains(&self, ptr: u64) -> bool {
        self.entries
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&s, &(len, stride))| ptr - s < len && (ptr - s) % stride == 0)
    }

    pub(super) fn invalidate(&mut self, start: u64, len: u64) {
        if self.entries.is_empty() {
            return;
        }
        let end = start.saturating_add(len);
        let mut doomed: Vec<u64> = self.entries.range(start..end).map(|(&s, _)| s).collect();
        if let Some((&s, &(l, _))) = self.entries.range(..start).next_back() {
            if s.saturating_add(l) > start {
                doomed.push(s);
            }
        }
        for s in doomed {
            self.entries.remove(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_log_tells_double_frees_and_forgets_reused_ranges() {
        let mut log = FreedLog {
            capacity: 3,
            ..FreedLog::default()
        };
        log.record(0x1000, 1, 1); // a large pointer
        log.record(0x10_0000, 0x1000, 0x100); // a released segment of 256-byte blocks
        assert!(log.contains(0x1000));
        assert!(!log.contains(0x1001));
        assert!(log.contains(0x10_0000) && log.contains(0x10_0f00));
        assert!(!log.contains(0x10_0080)); // not a block start
        assert!(!log.contains(0x10_1000)); // past the segment
        log.invalidate(0x10_0800, 0x100); // part of the segment is reused
        assert!(!log.contains(0x10_0000));
        assert!(log.contains(0x1000));
        log.record(0x2000, 1, 1);
        log.record(0x3000, 1, 1);
        log.record(0x4000, 1, 1); // the oldest entries fall out
        assert!(!log.contains(0x1000));
        assert!(log.contains(0x4000));
        let mut off = FreedLog::default();
        off.record(0x1000, 1, 1);
        assert!(!off.contains(0x1000));
    }
}
