//! The invariant checker of [`KvSpace`], run after every step of the tests.

use std::sync::Arc;

use rustc_hash::FxHashSet;
use strata_vmm::Mapping;

use super::tensor::Backing;
use super::{KvSpace, SlotState};
use crate::mapped::MappedPage;

impl KvSpace {
    /// Checks every structural invariant (run after every step in tests):
    ///
    /// - a free slot has no tokens and no pages and is on the free list only; a deferred slot has
    ///   no tokens, at least one page, and is on the deferred list only; an active slot is on
    ///   neither list, has `tokens <= max_tokens` and `pages_for(tokens) <= mapped <=
    ///   pages_per_slot`, with equality unless it was admitted from the deferred list and has not
    ///   been shrunk since (reused capacity);
    /// - only an active slot has holes, and every hole is below its extent (`p < mapped`);
    /// - in every tensor, page `p` of slot `s` is a pool page exactly when `p < mapped(s)` and
    ///   `p` is not a hole of `s`;
    ///   every other page is the zero page (with [`KvConfig::zero_page`](super::KvConfig::zero_page)) or unmapped;
    ///   with the mapper on, that includes the rows it holds ahead and the rows grows took from
    ///   it that the tables have not filed yet (owed: the top `owed` pages of the extent, counted
    ///   mapped): their zero mapping stays in the tables, lent to the mapper (which checks that
    ///   each row sits at its place: owed rows just below the extent, ready rows from it on);
    /// - every mapping is one page at its own address inside its tensor's reservation; pool pages
    ///   are page-sized; no pool page is mapped twice and none is the zero page;
    /// - the pages counted as mapped equal the pool pages found, and equal the growth of the
    ///   pool's `in_use` since creation, with the pages the mapper holds ahead (its rows are
    ///   checked too, with the mapper idle; this last check assumes nothing else took or gave pages
    ///   of this pool meanwhile, as in the tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_layout()?;
        self.settled_ahead(|ahead| {
            let in_use = self.pool.stats().in_use as u64;
            let delta = in_use.wrapping_sub(self.pool_in_use_base);
            if delta != self.counters.pages_mapped + ahead {
                return Err(format!(
                    "pool in_use grew by {delta} (from {} to {in_use}) but {} pages are mapped \
                     and {ahead} ahead",
                    self.pool_in_use_base, self.counters.pages_mapped
                ));
            }
            Ok(())
        })?
    }

    /// [`KvSpace::check_invariants`] without the pool `in_use` comparison, for a shared pool.
    pub fn check_layout(&self) -> Result<(), String> {
        let free: FxHashSet<u32> = self.free.iter().copied().collect();
        let deferred: FxHashSet<u32> = self.deferred.iter().copied().collect();
        if free.len() != self.free.len() || deferred.len() != self.deferred.len() {
            return Err("a slot is listed twice on the free or deferred list".into());
        }
        if self.holes.len() != self.slots.len() {
            return Err(format!(
                "{} hole sets for {} slots",
                self.holes.len(),
                self.slots.len()
            ));
        }
        for (i, slot) in self.slots.iter().enumerate() {
            let holes = &self.holes[i];
            if (slot.state != SlotState::Active && !holes.is_empty())
                || holes.last().is_some_and(|&p| p >= slot.mapped)
            {
                return Err(format!("slot {i} ({slot:?}) has holes {holes:?}"));
            }
            let index = i as u32;
            let (on_free, on_deferred) = (free.contains(&index), deferred.contains(&index));
            let need = self.pages_for(slot.tokens);
            if slot.owed > slot.mapped || (slot.owed > 0 && slot.state != SlotState::Active) {
                return Err(format!("slot {i} ({slot:?}) owes rows it cannot"));
            }
            let ok = match slot.state {
                SlotState::Free => slot.tokens == 0 && slot.mapped == 0 && on_free && !on_deferred,
                SlotState::Deferred => {
                    slot.tokens == 0 && slot.mapped > 0 && !on_free && on_deferred
                }
                SlotState::Active => {
                    !on_free
                        && !on_deferred
                        && slot.tokens <= self.config.max_tokens
                        && slot.mapped >= need
                        && slot.mapped <= self.pages_per_slot
                        && (slot.reused || slot.mapped == need)
                }
            };
            if !ok {
                return Err(format!(
                    "slot {i} inconsistent: {slot:?} (needs {need} pages, on free list: {on_free}, \
                     on deferred list: {on_deferred})"
                ));
            }
        }
        let zero_handle = self.zero.as_ref().map(|z| z.handle());
        let mut seen = FxHashSet::default();
        let mut real = 0u64;
        for (t, tensor) in self.tensors.iter().enumerate() {
            let res = &tensor.reservation;
            let expected_size = self.slot_stride * u64::from(self.config.max_slots);
            if res.size() != expected_size {
                return Err(format!(
                    "tensor {t}: reservation of {:#x} bytes",
                    res.size()
                ));
            }
            if tensor.pages.len() != self.pages_per_slot * self.slots.len() {
                return Err(format!("tensor {t}: {} page entries", tensor.pages.len()));
            }
            for (p, backing) in tensor.pages.iter().enumerate() {
                let (s, in_slot) = (p / self.pages_per_slot, p % self.pages_per_slot);
                // Owed rows are counted mapped but still with the mapper (checked there).
                let filed = self.slots[s].mapped - self.slots[s].owed;
                let should_be_real = in_slot < filed && !self.holes[s].contains(&in_slot);
                let va = tensor.va(p, self.page);
                let where_ = || format!("tensor {t} page {p} ({va:#x})");
                let check_mapping = |m: &Mapping| -> Result<(), String> {
                    if m.va() != va
                        || m.size() != self.page
                        || !Arc::ptr_eq(m.reservation(), res)
                        || !res.contains(m.va(), m.size())
                    {
                        return Err(format!("{}: misplaced mapping {m:?}", where_()));
                    }
                    Ok(())
                };
                match backing {
                    Backing::Real(MappedPage { mapping: m, page }) => {
                        if !should_be_real {
                            return Err(format!("{}: pool page beyond the slot's pages", where_()));
                        }
                        check_mapping(m)?;
                        if !Arc::ptr_eq(m.phys(), page.phys()) || page.size() != self.page {
                            return Err(format!("{}: mapping and page disagree", where_()));
                        }
                        let handle = page.phys().handle();
                        if Some(handle) == zero_handle || !seen.insert(handle) {
                            return Err(format!("{}: page {handle:?} mapped twice", where_()));
                        }
                        real += 1;
                    }
                    Backing::Zero(m) => {
                        if should_be_real || zero_handle.is_none() {
                            return Err(format!("{}: zero page where none belongs", where_()));
                        }
                        check_mapping(m)?;
                        if Some(m.phys().handle()) != zero_handle {
                            return Err(format!("{}: zero mapping of another page", where_()));
                        }
                    }
                    Backing::Unmapped => {
                        if should_be_real || zero_handle.is_some() {
                            return Err(format!("{}: unexpectedly unmapped", where_()));
                        }
                    }
                }
            }
        }
        let owed: usize = self.slots.iter().map(|s| s.owed).sum();
        let owed = (owed * self.tensors.len()) as u64;
        if real + owed != self.counters.pages_mapped {
            return Err(format!(
                "{real} pool pages in the tables and {owed} owed by the mapper, but {} counted \
                 mapped",
                self.counters.pages_mapped
            ));
        }
        Ok(())
    }
}
