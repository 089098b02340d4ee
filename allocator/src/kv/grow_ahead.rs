//! The space's side of map-ahead ([`super::ahead`]): starting the mapper, growing from the rows
//! it mapped, and handing rows back on shrink, free and out of memory.

use std::sync::Arc;

use strata_vmm::{Error, Result};

use super::ahead::{AheadSetup, MapAhead, Row, Taken};
use super::tensor::Backing;
use super::{invalid, KvSpace, SlotState};

/// Env switch: pages (all tensors together) that every space keeps mapped ahead, as if
/// [`KvSpace::start_map_ahead`] had been called at creation; `0` or unset: off.
pub const MAP_AHEAD_ENV: &str = "STRATA_KV_MAP_AHEAD";

impl KvSpace {
    /// Starts the background mapper: it keeps pool pages mapped ahead of every active slot, as
    /// many rows (one page in every tensor) as the slot's recent growth rate calls for, at most
    /// `budget_pages` pages in all; a grow then publishes mapped pages with no driver call and,
    /// while growth is steady, no syscall (the mapper polls instead of being woken). See the
    /// design in `kv/ahead/mod.rs`: pages ahead belong to their slot (counted in
    /// [`KvStats::pages_ahead`](super::KvStats::pages_ahead) and the pool's `in_use`), go back
    /// first when the pool is out of memory, and no lock is held across a wait on the mapper.
    ///
    /// With a zero page, the mapper lifts it off a row before mapping fresh pages there and lays
    /// it back behind any row it gives up unpublished; a row past a slot's extent has no mapping
    /// while its job runs (the driver has no atomic remap): see "The swap window" in
    /// `kv/ahead/mod.rs` before turning it on for kernels that read past the extent.
    ///
    /// A budget below one row (`2 × layers` pages) or a mapper already running is
    /// [`Error::InvalidArgument`].
    pub fn start_map_ahead(&mut self, budget_pages: usize) -> Result<()> {
        if budget_pages < self.tensors.len() {
            return Err(invalid(format!(
                "kv map-ahead budget of {budget_pages} pages is below one row of {} pages",
                self.tensors.len()
            )));
        }
        if self.ahead.is_some() {
            return Err(invalid("kv map-ahead is already running"));
        }
        let ahead = MapAhead::start(AheadSetup {
            pool: Arc::clone(&self.pool),
            reservations: self
                .tensors
                .iter()
                .map(|t| Arc::clone(&t.reservation))
                .collect(),
            location: self.location,
            page: self.page,
            pages_per_slot: self.pages_per_slot,
            slots: self.slots.len(),
            budget_pages,
            zero: self.zero.clone(),
        })?;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.state == SlotState::Active {
                ahead.admit(i, slot.mapped);
            }
        }
        self.ahead = Some(ahead);
        Ok(())
    }

    /// Whether the background mapper runs.
    pub fn maps_ahead(&self) -> bool {
        self.ahead.is_some()
    }

    /// Starts the mapper when [`MAP_AHEAD_ENV`] names a budget (raised to one row if below).
    pub(super) fn map_ahead_from_env(&mut self) -> Result<()> {
        let Ok(value) = std::env::var(MAP_AHEAD_ENV) else {
            return Ok(());
        };
        let budget: usize = value.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!("{MAP_AHEAD_ENV}={value:?} is not a page count"))
        })?;
        if budget == 0 {
            return Ok(());
        }
        self.start_map_ahead(budget.max(self.tensors.len()))
    }

    /// Backs pages `mapped..need` of slot `index`: the mapper's ready rows first (no driver
    /// call), the rest mapped here. All or nothing, like [`KvSpace::back_slot`]. Ready rows that
    /// cover the whole grow stay with the mapper, owed to the tables ([`KvSpace::file_owed`]).
    pub(super) fn grow_ahead(&mut self, index: usize, mapped: usize, need: usize) -> Result<()> {
        let ahead = self.ahead.as_ref().expect("grow_ahead with a mapper");
        let pages_per_row = self.tensors.len() as u64;
        let rows = match ahead.take_rows(index, mapped, need) {
            Taken::Owed(k) => {
                self.slots[index].owed += k;
                self.counters.pages_mapped += k as u64 * pages_per_row;
                self.counters.pages_from_ahead += k as u64 * pages_per_row;
                return Ok(());
            }
            Taken::Rows(rows) => rows,
        };
        self.file_owed(index);
        let from = mapped + rows.len();
        if let Err(e) = self.back_slot(index, from, need) {
            let ahead = self.ahead.as_ref().expect("mapper");
            let stale = ahead.put_back(index, mapped, rows);
            ahead.release(stale);
            ahead.resume(index);
            return Err(e);
        }
        let pages = rows.len() as u64 * pages_per_row;
        self.counters.pages_from_ahead += pages;
        self.counters.pages_mapped += pages;
        self.file_rows(index, mapped, rows);
        Ok(())
    }

    /// Files the rows grows of slot `index` took from the mapper into the tables (they are
    /// already counted as mapped); a no-op without any.
    pub(super) fn file_owed(&mut self, index: usize) {
        let owed = self.slots[index].owed;
        if owed == 0 {
            return;
        }
        let rows = self
            .ahead
            .as_ref()
            .expect("owed rows come from a mapper")
            .take_owed(index);
        debug_assert_eq!(rows.len(), owed);
        self.slots[index].owed = 0;
        let at = self.slots[index].mapped - owed;
        self.file_rows(index, at, rows);
    }

    /// Puts `rows` (mapped at pages `at..` of slot `index`) into the tables; the callers count
    /// them mapped. A zero mapping there was lent to the mapper, which unmapped it: it goes
    /// without a driver call.
    fn file_rows(&mut self, index: usize, at: usize, rows: impl IntoIterator<Item = Row>) {
        let base = index * self.pages_per_slot + at;
        for (k, row) in rows.into_iter().enumerate() {
            for (tensor, mapped) in self.tensors.iter_mut().zip(row) {
                let lent = std::mem::replace(&mut tensor.pages[base + k], Backing::Real(mapped));
                if let Backing::Zero(zero) = lent {
                    zero.disown();
                }
            }
        }
    }

    /// A slot is being freed: its owed rows are filed, and its ready rows become part of its
    /// extent (kept mapped for the next admit, like the rest of a deferred slot), unless it has
    /// holes (it is truncated to its first hole, so they are unmapped).
    pub(super) fn retire_ahead(&mut self, index: usize) {
        let Some(ahead) = &self.ahead else {
            return;
        };
        let mapped = self.slots[index].mapped;
        let rows = ahead.retire(index, 0, false);
        self.file_owed(index);
        let ahead = self.ahead.as_ref().expect("mapper");
        if self.holes[index].is_empty() {
            let n = rows.len();
            self.counters.pages_mapped += (n * self.tensors.len()) as u64;
            self.file_rows(index, mapped, rows);
            self.slots[index].mapped += n;
        } else {
            ahead.release(rows);
        }
    }

    /// The pool is out of memory for a synchronous caller: every row mapped ahead goes back.
    /// Returns whether any did.
    pub(super) fn release_ahead(&mut self) -> bool {
        let Some(ahead) = &self.ahead else {
            return false;
        };
        let rows = ahead.drain_all();
        let any = !rows.is_empty();
        ahead.release(rows);
        any
    }

    /// With the mapper idle, the pages it holds ahead (0 without one) and a check of its rows.
    pub(super) fn settled_ahead<R>(
        &self,
        check: impl FnOnce(u64) -> R,
    ) -> std::result::Result<R, String> {
        match &self.ahead {
            Some(ahead) => ahead.settled(|i| self.slots[i].owed, |held| check(held as u64)),
            None => Ok(check(0)),
        }
    }
}
