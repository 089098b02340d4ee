//! The blocks one thread cache holds: found by address, each kept in a slot of a slab, so that
//! a magazine's entry (address and slot) reaches its block without a hash lookup.

use rustc_hash::FxHashMap;
use strata_vmm::DevicePtr;

use super::Held;

#[derive(Default)]
pub(super) struct HeldBlocks {
    slots: FxHashMap<DevicePtr, u32>,
    slab: Vec<Held>,
    /// Slab slots free for reuse.
    spare: Vec<u32>,
}

impl HeldBlocks {
    /// Holds block `h` at `ptr`; returns its slot.
    pub(super) fn insert(&mut self, ptr: DevicePtr, h: Held) -> u32 {
        let slot = match self.spare.pop() {
            Some(slot) => {
                self.slab[slot as usize] = h;
                slot
            }
            None => {
                self.slab.push(h);
                (self.slab.len() - 1) as u32
            }
        };
        self.slots.insert(ptr, slot);
        slot
    }

    /// The block in `slot` (a slot a magazine or [`Self::get_mut`] gave).
    #[inline]
    pub(super) fn at(&mut self, slot: u32) -> &mut Held {
        &mut self.slab[slot as usize]
    }

    pub(super) fn get(&self, ptr: DevicePtr) -> Option<&Held> {
        self.slots.get(&ptr).map(|&slot| &self.slab[slot as usize])
    }

    #[inline]
    pub(super) fn get_mut(&mut self, ptr: DevicePtr) -> Option<(u32, &mut Held)> {
        let slot = *self.slots.get(&ptr)?;
        Some((slot, &mut self.slab[slot as usize]))
    }

    pub(super) fn remove(&mut self, ptr: DevicePtr) -> Option<Held> {
        let slot = self.slots.remove(&ptr)?;
        self.spare.push(slot);
        Some(self.slab[slot as usize])
    }

    /// Every block, the cache left empty.
    pub(super) fn drain(&mut self) -> Vec<Held> {
        let all = self
            .slots
            .values()
            .map(|&s| self.slab[s as usize])
            .collect();
        self.slots.clear();
        self.slab.clear();
        self.spare.clear();
        all
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (DevicePtr, &Held)> {
        self.slots
            .iter()
            .map(|(&ptr, &s)| (ptr, &self.slab[s as usize]))
    }
}
