//! [`KvStats`]: what a [`KvSpace`] counts.

use super::{KvSpace, SlotState};

/// Counters of a [`KvSpace`]. "Pages" are pool pages (one per tensor per slot page).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Slots admitted and not freed.
    pub slots_active: u32,
    /// Freed slots that still hold mapped pages (deferred reclamation).
    pub slots_deferred: u32,
    /// Pool pages mapped now (active and deferred slots together).
    pub pages_mapped: u64,
    /// Pool pages unmapped since creation.
    pub pages_unmapped_total: u64,
    /// Pool pages mapped since creation.
    pub pages_mapped_total: u64,
    /// Backend `map` calls since creation (pool pages and zero-page mappings).
    pub map_calls: u64,
    /// Backend `unmap` calls since creation (pool pages and zero-page mappings).
    pub unmap_calls: u64,
    /// Backend `set_access` calls since creation.
    pub set_access_calls: u64,
    /// Tokens of all active slots together.
    pub tokens: u64,
    /// Slot pages (each one page in every tensor) evicted by [`KvSpace::evict_pages`] and not
    /// restored: the holes of all active slots together.
    pub pages_evicted: u64,
    /// Pool pages the background mapper holds mapped ahead of active slots, not yet published
    /// by a grow ([`KvSpace::start_map_ahead`]); not in `pages_mapped`, in the pool's `in_use`.
    pub pages_ahead: u64,
    /// Pool pages that grows published from the mapper's rows since creation (no driver call
    /// on the caller's path).
    pub pages_from_ahead: u64,
    /// Grows and admits that had to wake the parked background mapper (a syscall on the
    /// caller's path); while slots grow steadily it polls, and grows wake it not at all.
    pub mapper_wakeups: u64,
}

impl KvSpace {
    /// Counters and current totals.
    pub fn stats(&self) -> KvStats {
        let mut stats = KvStats {
            pages_mapped: self.counters.pages_mapped,
            pages_unmapped_total: self.counters.pages_unmapped_total,
            pages_mapped_total: self.counters.pages_mapped_total,
            map_calls: self.counters.map_calls,
            unmap_calls: self.counters.unmap_calls,
            set_access_calls: self.counters.set_access_calls,
            pages_from_ahead: self.counters.pages_from_ahead,
            ..KvStats::default()
        };
        stats.pages_evicted = self.holes.iter().map(|h| h.len() as u64).sum();
        if let Some(ahead) = &self.ahead {
            let c = ahead.counters();
            stats.pages_ahead = c.pages_ready;
            stats.pages_mapped_total += c.pages_mapped_total;
            stats.pages_unmapped_total += c.pages_unmapped_total;
            stats.map_calls += c.map_calls;
            stats.unmap_calls += c.unmap_calls;
            stats.set_access_calls += c.set_access_calls;
            stats.mapper_wakeups = c.wakeups;
        }
        for slot in &self.slots {
            match slot.state {
                SlotState::Active => {
                    stats.slots_active += 1;
                    stats.tokens += u64::from(slot.tokens);
                }
                SlotState::Deferred => stats.slots_deferred += 1,
                SlotState::Free => {}
            }
        }
        stats
    }
}
