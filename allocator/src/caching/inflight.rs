//! In-flight reservations: driver work that runs with the allocator's lock dropped.
//!
//! Growth (create + map + set_access of new pages) and shrinking (unmap + release of cached
//! pages) take what they need under the lock, record it here, drop the lock for the driver
//! calls, and take the lock again to publish or roll back. While a record lives:
//!
//! - its arena VA ranges (the new run, and the old ranges of pages being unmapped) belong to
//!   nobody else, so concurrent growers never collide;
//! - its physical pages count against the limit, so concurrent growers never overshoot it;
//! - the invariant checker counts its ranges in the arena's tiling and its pages apart from
//!   the tables.

/// One unit of driver work running outside the lock.
#[derive(Debug)]
pub(super) struct InFlight {
    id: u64,
    /// Tag index a growth publishes to (`sleep` of that tag waits for it); `None`: a shrink.
    pub tag: Option<u32>,
    /// Arena pages a growth maps and publishes.
    pub target: Option<(u64, u64)>,
    /// Arena pages whose old mappings are being unmapped; free once the record ends.
    pub retiring: Vec<(u64, u64)>,
    /// Physical pages held outside the tables (counted against the limit).
    pub pages: u64,
}

/// The in-flight records of one allocator.
#[derive(Debug, Default)]
pub(super) struct InFlightTable {
    records: Vec<InFlight>,
    next_id: u64,
    pages: u64,
}

impl InFlightTable {
    /// Records work holding `pages` physical pages and the given ranges; returns its id.
    pub fn begin(
        &mut self,
        tag: Option<u32>,
        target: Option<(u64, u64)>,
        retiring: Vec<(u64, u64)>,
        pages: u64,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.pages += pages;
        self.records.push(InFlight {
            id,
            tag,
            target,
            retiring,
            pages,
        });
        id
    }

    /// Ends record `id` (its pages stop counting) and returns it for the caller to settle.
    pub fn end(&mut self, id: u64) -> Option<InFlight> {
        let at = self.records.iter().position(|r| r.id == id)?;
        let record = self.records.swap_remove(at);
        self.pages -= record.pages;
        Some(record)
    }

    /// Physical pages held by all records.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Whether a growth for tag index `tag` is in flight.
    pub fn growing(&self, tag: u32) -> bool {
        self.records.iter().any(|r| r.tag == Some(tag))
    }

    pub fn iter(&self) -> impl Iterator<Item = &InFlight> {
        self.records.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_count_their_pages_until_they_end() {
        let mut table = InFlightTable::default();
        let grow = table.begin(Some(2), Some((10, 4)), vec![(0, 1)], 4);
        let shrink = table.begin(None, None, vec![(5, 2)], 2);
        assert_eq!(table.pages(), 6);
        assert!(table.growing(2) && !table.growing(0));
        let record = table.end(grow).expect("growth record");
        assert_eq!(
            (record.target, record.retiring),
            (Some((10, 4)), vec![(0, 1)])
        );
        assert!(table.end(grow).is_none());
        assert_eq!(table.pages(), 2);
        assert!(!table.growing(2));
        assert!(table.end(shrink).is_some());
        assert_eq!((table.pages(), table.iter().count()), (0, 0));
    }
}
