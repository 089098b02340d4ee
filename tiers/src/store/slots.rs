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
pub(super) struct Slots {
    pub(super) free: Vec<u32>,
    pub(super) owner: Vec<Option<u32>>,
    pub(super) fence: Vec<Option<Arc<Event>>>,
    pub(super) retired: Vec<bool>,
}

impl Slots {
    pub(super) fn new(n: u32) -> Self {
        Slots {
            free: (0..n).rev().collect(),
            owner: vec![None; n as usize],
            fence: vec![None; n as usize],
            retired: vec![false; n as usize],
        }
    }

    pub(super) fn total(&self) -> u64 {
        self.owner.len() as u64 - self.retired.iter().filter(|&&r| r).count() as u64
    }

    pub(super) fn used(&self) -> u64 {
        self.owner.iter().filter(|o| o.is_some()).count() as u64
    }

    pub(super) fn take(&mut self, obj: u32) -> Option<u32> {
        let s = self.free.pop()?;
        self.owner[s as usize] = Some(obj);
        Some(s)
    }

    /// Frees `s`; `fence` (when given) is the last copy that touched it.
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
