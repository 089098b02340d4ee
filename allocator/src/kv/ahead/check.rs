//! The mapper's side of the space's invariant check.

use parking_lot::MutexGuard;

use super::{MapAhead, State};

impl MapAhead {
    /// Runs `check` with the mapper idle (no job in flight, none claimed until it returns) on
    /// the pages held ahead and the addresses they must have; `owed` gives the rows the space
    /// counts as owed by each slot. Returns `check`'s result.
    pub(in crate::kv) fn settled<R>(
        &self,
        owed: impl Fn(usize) -> usize,
        check: impl FnOnce(usize) -> R,
    ) -> std::result::Result<R, String> {
        let mut g = self.shared.state.lock();
        while g.in_flight.is_some() {
            self.shared.landed.wait(&mut g);
        }
        self.check_rows(&g, owed)?;
        Ok(check(g.held))
    }

    fn check_rows(
        &self,
        g: &MutexGuard<'_, State>,
        owed: impl Fn(usize) -> usize,
    ) -> std::result::Result<(), String> {
        if let Some(overlap) = &g.overlap {
            return Err(format!(
                "the mapper mapped over pages it did not own: {overlap}"
            ));
        }
        for (i, s) in g.slots.iter().enumerate() {
            if s.owed.len() != owed(i) {
                return Err(format!(
                    "slot {i} owes {} rows to the space, which counts {}",
                    s.owed.len(),
                    owed(i)
                ));
            }
            if !s.active && !s.owed.is_empty() {
                return Err(format!("slot {i} is not active but owes rows"));
            }
            let first = s.extent.checked_sub(s.owed.len()).ok_or_else(|| {
                format!(
                    "slot {i} owes {} rows below an extent of {}",
                    s.owed.len(),
                    s.extent
                )
            })?;
            for (k, row) in s.owed.iter().enumerate() {
                for (t, mapped) in row.iter().enumerate() {
                    if mapped.mapping.va() != self.shared.va(t, i, first + k) {
                        return Err(format!("slot {i}: owed row {k} of tensor {t} misplaced"));
                    }
                }
            }
        }
        let mut ready = 0;
        for (i, s) in g.slots.iter().enumerate() {
            if !s.active && !s.ready.is_empty() {
                return Err(format!("slot {i} is not active but has rows ahead"));
            }
            for (k, row) in s.ready.iter().enumerate() {
                for (t, mapped) in row.iter().enumerate() {
                    if mapped.mapping.va() != self.shared.va(t, i, s.extent + k) {
                        return Err(format!("slot {i}: ahead row {k} of tensor {t} misplaced"));
                    }
                }
                ready += row.len();
            }
        }
        if ready != g.held || ready as u64 != g.counters.pages_ready {
            return Err(format!(
                "{ready} pages ready ahead but {} held, {} counted",
                g.held, g.counters.pages_ready
            ));
        }
        if ready > g.budget {
            return Err(format!(
                "{ready} pages ready ahead, over the budget of {}",
                g.budget
            ));
        }
        Ok(())
    }
}
