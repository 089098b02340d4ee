//! How many rows each slot keeps ahead and which job comes next (see "Design" in the module
//! documentation of `kv/ahead`).

use std::time::{Duration, Instant};

use super::{Job, SlotAhead, State};
use super::{IDLE_AFTER, JOB_SECS_GUESS, MAX_BATCH, POLL_MAX, POLL_MIN, UNKNOWN_RATE};

impl SlotAhead {
    /// Updates the growth rate with a grow of `rows` rows.
    pub(super) fn note_grow(&mut self, rows: usize) {
        self.held_off = false;
        if rows == 0 {
            return;
        }
        let now = Instant::now();
        if let Some(last) = self.last_grow {
            let dt = now.duration_since(last).as_secs_f64().max(1e-6);
            let sample = rows as f64 / dt;
            self.rate = if self.rate == 0.0 {
                sample
            } else {
                0.75 * self.rate + 0.25 * sample
            };
        }
        self.last_grow = Some(now);
        self.last_rows = rows;
    }

    /// Whether the slot's next grow, at its growth rate, comes within `secs` of `now`.
    fn due_within(&self, now: Instant, secs: f64) -> bool {
        match self.last_grow {
            Some(last) if self.rate > 0.0 => {
                now.saturating_duration_since(last).as_secs_f64() + secs >= 1.0 / self.rate
            }
            _ => false,
        }
    }

    /// Active, refilled, and grown within [`IDLE_AFTER`] (or eight of its intervals).
    fn is_growing(&self, now: Instant) -> bool {
        let Some(last) = self.last_grow.filter(|_| self.active && !self.held_off) else {
            return false;
        };
        let idle = if self.rate > 0.0 {
            IDLE_AFTER.max(Duration::from_secs_f64((8.0 / self.rate).min(60.0)))
        } else {
            IDLE_AFTER
        };
        now.duration_since(last) < idle
    }
}

impl State {
    /// Seconds a job takes, as measured so far.
    fn job_estimate(&self) -> f64 {
        if self.job_secs > 0.0 {
            self.job_secs
        } else {
            JOB_SECS_GUESS
        }
    }

    /// Sizes every slot's rows ahead from its growth rate; returns how long the mapper may
    /// wait before it looks again (`None`: nothing grows, it parks until woken).
    pub(super) fn plan(&mut self, now: Instant) -> Option<Duration> {
        let (mut growing, mut fastest) = (0usize, 0.0f64);
        for s in &self.slots {
            if s.is_growing(now) {
                growing += 1;
                // A rate not measured yet (one grow so far) is taken as fast.
                fastest = f64::max(fastest, if s.rate > 0.0 { s.rate } else { UNKNOWN_RATE });
            }
        }
        let recent = self
            .last_grow
            .is_some_and(|t| now.duration_since(t) < IDLE_AFTER);
        if growing == 0 && recent {
            // Between one request and the next in its slot: as for a new one.
            fastest = UNKNOWN_RATE;
        }
        let poll =
            Duration::from_secs_f64((0.25 / fastest.max(1e-3)).min(1.0)).clamp(POLL_MIN, POLL_MAX);
        let job_secs = self.job_estimate();
        // Twice the time the mapper may take to notice a grow and refill every growing slot.
        let lead = 2.0 * (poll.as_secs_f64() + growing as f64 * job_secs);
        for s in &mut self.slots {
            s.want = if !s.active || s.held_off {
                0
            } else if s.is_growing(now) {
                let consumed = (s.rate * lead).ceil() as usize;
                (consumed + 1).max(s.last_rows)
            } else {
                s.last_rows.max(1)
            };
        }
        (growing > 0 || recent).then_some(poll)
    }

    /// The next job: the active slot with the fewest ready rows short of its want (round robin
    /// among equals), up to [`MAX_BATCH`] rows, within the budget; one row when the slot has
    /// none ready and its next grow is due before a job would land (a grow that needs a row in
    /// flight waits for the whole job: with the zero page a 4-row job takes a few ms).
    pub(super) fn next_job(
        &mut self,
        tensors: usize,
        pages_per_slot: usize,
        now: Instant,
    ) -> Option<Job> {
        let room = self.budget.saturating_sub(self.held) / tensors;
        if room == 0 {
            return None;
        }
        let n = self.slots.len();
        let mut best: Option<usize> = None;
        for k in 0..n {
            let i = (self.cursor + k) % n;
            let s = &self.slots[i];
            let short = s.active
                && !s.unmapping
                && s.ready.len() < s.want
                && s.extent + s.ready.len() < pages_per_slot;
            if short && best.is_none_or(|b| s.ready.len() < self.slots[b].ready.len()) {
                best = Some(i);
            }
        }
        let i = best?;
        self.cursor = (i + 1) % n;
        let s = &self.slots[i];
        let row = s.extent + s.ready.len();
        let batch = if s.ready.is_empty() && s.due_within(now, self.job_estimate()) {
            1
        } else {
            MAX_BATCH
        };
        let rows = (s.want - s.ready.len())
            .min(batch)
            .min(room)
            .min(pages_per_slot - row);
        Some(Job {
            slot: i,
            row,
            rows,
            epoch: s.epoch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::AheadCounters;
    use super::*;

    /// One active slot growing a row every 5 ms, none ready, wanting 4; jobs take 2 ms.
    fn state(since_last_grow: Duration, now: Instant) -> State {
        let slot = SlotAhead {
            active: true,
            extent: 3,
            want: 4,
            last_rows: 1,
            rate: 200.0,
            last_grow: Some(now - since_last_grow),
            ..SlotAhead::default()
        };
        State {
            slots: vec![slot],
            budget: 64,
            held: 0,
            in_flight: None,
            cursor: 0,
            job_secs: 0.002,
            last_grow: None,
            parked: false,
            overlap: None,
            stop: false,
            counters: AheadCounters::default(),
        }
    }

    #[test]
    fn a_slot_whose_grow_is_due_before_a_job_lands_gets_one_row_first() {
        let now = Instant::now();
        let rows = |since_ms| {
            let mut st = state(Duration::from_millis(since_ms), now);
            st.next_job(2, 16, now).map(|j| (j.row, j.rows))
        };
        // 1 ms after its grow: the next is 4 ms away, a 2 ms job lands first.
        assert_eq!(rows(1), Some((3, MAX_BATCH)));
        // 4 ms after: the next grow comes before a 2 ms job would land.
        assert_eq!(rows(4), Some((3, 1)));
    }
}
