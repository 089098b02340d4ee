//! Slot tables of one tier, and the lease that puts a taken slot back unless it is kept.

use std::sync::Arc;

use parking_lot::Mutex;
use strata_vmm::Event;

/// Which slot table a slot belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotTier {
    Hbm,
    Host,
    Disk,
}

/// Fixed-size slots of one tier: free list, owner, the event of the last copy that read or
/// wrote each slot (`fence`), and slots retired by a revocation (never free again).
///
/// The tables cover only the slots taken at least once (`owner.len()` of them); the slots
/// above were never taken and are free too, so the bookkeeping grows with the slots used, not
/// with the tier's size (a disk tier of 2^46 bytes costs nothing up front).
pub(super) struct Slots {
    /// Free slots among those the tables cover.
    pub(super) free: Vec<u32>,
    pub(super) owner: Vec<Option<u32>>,
    pub(super) fence: Vec<Option<Arc<Event>>>,
    pub(super) retired: Vec<bool>,
    capacity: u32,
}

impl Slots {
    /// `capacity` free slots, none of them in the tables yet.
    pub(super) fn new(capacity: u32) -> Self {
        Slots {
            free: Vec::new(),
            owner: Vec::new(),
            fence: Vec::new(),
            retired: Vec::new(),
            capacity,
        }
    }

    /// `capacity` free slots, all in the tables (HBM: slots of pages the store holds, which a
    /// revocation retires by index).
    pub(super) fn covered(capacity: u32) -> Self {
        Slots {
            free: (0..capacity).rev().collect(),
            owner: vec![None; capacity as usize],
            fence: vec![None; capacity as usize],
            retired: vec![false; capacity as usize],
            capacity,
        }
    }

    pub(super) fn total(&self) -> u64 {
        u64::from(self.capacity) - self.retired.iter().filter(|&&r| r).count() as u64
    }

    pub(super) fn used(&self) -> u64 {
        self.owner.iter().filter(|o| o.is_some()).count() as u64
    }

    /// Free slots, those never taken included.
    pub(super) fn free_count(&self) -> usize {
        self.free.len() + (self.capacity as usize - self.owner.len())
    }

    pub(super) fn take(&mut self, obj: u32) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            self.owner[s as usize] = Some(obj);
            return Some(s);
        }
        let s = u32::try_from(self.owner.len())
            .ok()
            .filter(|&s| s < self.capacity)?;
        self.owner.push(Some(obj));
        self.fence.push(None);
        self.retired.push(false);
        Some(s)
    }

    /// Frees `s` (a slot [`Slots::take`] gave out); `fence` (when given) is the last copy that
    /// touched it.
    pub(super) fn put_back(&mut self, s: u32, fence: Option<Arc<Event>>) {
        self.owner[s as usize] = None;
        if fence.is_some() {
            self.fence[s as usize] = fence;
        }
        if !self.retired[s as usize] {
            self.free.push(s);
        }
    }
}

/// Slots whose leases were dropped; the store puts them back the next time it takes its lock
/// (a lease may be dropped while the lock is held or while it is not).
pub(super) type Returns = Mutex<Vec<(SlotTier, u32)>>;

/// A slot taken for an object but not yet part of its residency. Dropped, it goes back to its
/// free list (holding no data, its fence unchanged); [`SlotLease::keep`] makes it the object's.
#[must_use]
pub(super) struct SlotLease<'s> {
    tier: SlotTier,
    slot: u32,
    returns: &'s Returns,
}

impl<'s> SlotLease<'s> {
    pub(super) fn new(tier: SlotTier, slot: u32, returns: &'s Returns) -> Self {
        SlotLease {
            tier,
            slot,
            returns,
        }
    }

    pub(super) fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot stays taken; the caller records it in the object's residency.
    pub(super) fn keep(self) -> u32 {
        let slot = self.slot;
        std::mem::forget(self);
        slot
    }
}

impl Drop for SlotLease<'_> {
    fn drop(&mut self) {
        self.returns.lock().push((self.tier, self.slot));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_tier_costs_only_the_slots_taken() {
        let mut s = Slots::new(u32::MAX);
        assert_eq!(s.free_count(), u32::MAX as usize);
        assert_eq!(s.total(), u64::from(u32::MAX));
        assert_eq!((s.take(7), s.take(8)), (Some(0), Some(1)));
        assert_eq!(s.owner.len(), 2, "tables cover the slots taken only");
        s.put_back(0, None);
        assert_eq!(s.free_count(), u32::MAX as usize - 1);
        assert_eq!(s.take(9), Some(0));
        assert_eq!(s.used(), 2);
        let mut one = Slots::new(1);
        assert_eq!((one.take(1), one.take(2)), (Some(0), None));
        assert_eq!(one.free_count(), 0);
    }
}
