//! Generation-checked handle tables: the opaque `uint64_t` handles of the C ABI (KV spaces,
//! parameter sets). A handle is `generation << 32 | (index + 1)`; 0 is never valid. Removing
//! an entry bumps its slot's generation, so a freed (stale) handle is
//! [`Error::StaleId`](strata_vmm::Error::StaleId) (`STRATA_INVALID_HANDLE`) forever after,
//! never another object.
//!
//! Lookups clone the entry's `Arc` under a short lock and return it: the call then runs without
//! the table's lock, and an entry removed meanwhile lives on until the calls using it return.

use std::sync::Arc;

use parking_lot::Mutex;
use strata_vmm::{Error, Result};

struct Slot<T> {
    generation: u32,
    value: Option<Arc<T>>,
}

/// See the module documentation.
pub struct HandleTable<T> {
    kind: &'static str,
    slots: Mutex<Vec<Slot<T>>>,
}

fn split(handle: u64) -> (Option<usize>, u32) {
    let index = (handle & 0xffff_ffff) as usize;
    (index.checked_sub(1), (handle >> 32) as u32)
}

impl<T> HandleTable<T> {
    /// An empty table whose errors name `kind` ("kv space").
    pub const fn new(kind: &'static str) -> Self {
        HandleTable {
            kind,
            slots: Mutex::new(Vec::new()),
        }
    }

    fn stale(&self, handle: u64) -> Error {
        let (index, generation) = split(handle);
        Error::StaleId {
            kind: self.kind,
            index: index.map_or(u32::MAX, |i| i as u32),
            generation,
        }
    }

    /// Stores `value` and returns its handle (a free slot is reused with the next generation).
    pub fn insert(&self, value: Arc<T>) -> Result<u64> {
        let mut slots = self.slots.lock();
        let index = match slots.iter().position(|s| s.value.is_none()) {
            Some(i) => i,
            None => {
                if slots.len() >= u32::MAX as usize - 1 {
                    return Err(Error::InvalidState(format!("too many live {}s", self.kind)));
                }
                slots.push(Slot {
                    generation: 1,
                    value: None,
                });
                slots.len() - 1
            }
        };
        let slot = &mut slots[index];
        slot.value = Some(value);
        Ok(u64::from(slot.generation) << 32 | (index as u64 + 1))
    }

    /// The entry of `handle`; unknown, freed or 0 is [`Error::StaleId`].
    #[inline]
    pub fn get(&self, handle: u64) -> Result<Arc<T>> {
        let (index, generation) = split(handle);
        let slots = self.slots.lock();
        index
            .and_then(|i| slots.get(i))
            .filter(|s| s.generation == generation)
            .and_then(|s| s.value.clone())
            .ok_or_else(|| self.stale(handle))
    }

    /// Every live entry (figures of all of them; each lives on while the caller holds it).
    pub fn values(&self) -> Vec<Arc<T>> {
        let slots = self.slots.lock();
        slots.iter().filter_map(|s| s.value.clone()).collect()
    }

    /// Removes the entry of `handle` (its handle becomes stale) and returns it.
    pub fn remove(&self, handle: u64) -> Result<Arc<T>> {
        let (index, generation) = split(handle);
        let mut slots = self.slots.lock();
        let slot = index
            .and_then(|i| slots.get_mut(i))
            .filter(|s| s.generation == generation && s.value.is_some())
            .ok_or_else(|| self.stale(handle))?;
        // Generation 0 is skipped on wrap-around so that handle 0 stays invalid.
        slot.generation = slot.generation.wrapping_add(1).max(1);
        slot.value.take().ok_or_else(|| self.stale(handle))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_handles_never_reach_a_new_entry() {
        let t: HandleTable<u32> = HandleTable::new("thing");
        let a = t.insert(Arc::new(1)).unwrap();
        assert_eq!(*t.get(a).unwrap(), 1);
        assert_eq!(*t.remove(a).unwrap(), 1);
        let b = t.insert(Arc::new(2)).unwrap();
        assert_ne!(a, b, "the slot is reused with a new generation");
        assert!(matches!(
            t.get(a),
            Err(Error::StaleId { kind: "thing", .. })
        ));
        assert!(t.remove(a).is_err());
        assert_eq!(*t.get(b).unwrap(), 2);
        assert_eq!(t.values().iter().map(|v| **v).collect::<Vec<_>>(), [2]);
        for bad in [0, u64::MAX, b + 1, b ^ (1 << 32)] {
            assert!(t.get(bad).is_err(), "{bad:#x}");
        }
    }
}
