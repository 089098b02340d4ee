//! A shared DMA link on the virtual clock (TierKV App. A): "when n concurrent DMA streams
//! compete, each receives BW / min(n, n_lanes)". We read this as `n_lanes` streams in flight at
//! most (later transfers queue in FIFO order) sharing the bandwidth fairly, so the aggregate
//! never exceeds BW. A transfer first waits the link latency ℓ (Eq. 2), then moves its bytes.

use std::collections::VecDeque;

#[derive(Clone, Copy, Debug)]
struct Active {
    id: u64,
    /// Virtual time its latency phase ends.
    ready: f64,
    /// Bytes still to move.
    remaining: f64,
}

/// One direction of one link.
#[derive(Clone, Debug)]
pub struct Link {
    bw: f64,
    latency: f64,
    lanes: usize,
    now: f64,
    active: Vec<Active>,
    queue: VecDeque<(u64, f64)>,
    /// Transfers that may not start before a time (the second hop of a two-hop move).
    delayed: Vec<(f64, u64, f64)>,
    /// Bytes moved so far.
    pub bytes: f64,
    /// Virtual seconds with at least one transfer in flight.
    pub busy: f64,
}

impl Link {
    pub fn new(bw: f64, latency: f64, lanes: usize) -> Self {
        Link {
            bw,
            latency,
            lanes: lanes.max(1),
            now: 0.0,
            active: Vec::new(),
            queue: VecDeque::new(),
            delayed: Vec::new(),
            bytes: 0.0,
            busy: 0.0,
        }
    }

    pub fn now(&self) -> f64 {
        self.now
    }

    /// Transfers queued or in flight.
    pub fn pending(&self) -> usize {
        self.active.len() + self.queue.len() + self.delayed.len()
    }

    /// Submits `bytes` to start no earlier than `at` (and no earlier than the link's time).
    pub fn submit_at(&mut self, id: u64, bytes: f64, at: f64) {
        if at <= self.now {
            self.submit(id, bytes);
        } else {
            self.delayed.push((at, id, bytes));
        }
    }

    fn release_delayed(&mut self) {
        let now = self.now;
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                let (_, id, bytes) = self.delayed.swap_remove(i);
                self.queue.push_back((id, bytes));
            } else {
                i += 1;
            }
        }
    }

    /// Submits `bytes` at the link's current time (callers advance the link first).
    pub fn submit(&mut self, id: u64, bytes: f64) {
        self.queue.push_back((id, bytes));
        self.admit();
    }

    fn admit(&mut self) {
        while self.active.len() < self.lanes {
            let Some((id, bytes)) = self.queue.pop_front() else {
                break;
            };
            self.active.push(Active {
                id,
                ready: self.now + self.latency,
                remaining: bytes,
            });
        }
    }

    /// Runs the link until `t` (or until `until_done` completes, if given), appending completed
    /// `(id, time)` pairs to `done`. Returns the time reached.
    pub fn run(&mut self, t: f64, until_done: Option<u64>, done: &mut Vec<(u64, f64)>) -> f64 {
        loop {
            if let Some(id) = until_done {
                if !self.active.iter().any(|a| a.id == id)
                    && !self.queue.iter().any(|q| q.0 == id)
                    && !self.delayed.iter().any(|d| d.1 == id)
                {
                    return self.now;
                }
            } else if self.now >= t {
                return self.now;
            }
            if self.active.is_empty() {
                let wake = self
                    .delayed
                    .iter()
                    .map(|d| d.0)
                    .fold(f64::INFINITY, f64::min);
                let stop = if until_done.is_some() {
                    wake
                } else {
                    wake.min(t)
                };
                if !stop.is_finite() {
                    return self.now;
                }
                self.now = self.now.max(stop);
                self.release_delayed();
                self.admit();
                continue;
            }
            let moving = self.active.iter().filter(|a| a.ready <= self.now).count();
            let rate = if moving == 0 {
                0.0
            } else {
                self.bw / moving.min(self.lanes) as f64
            };
            // The next event: a latency phase ends or a transfer completes.
            let mut next = f64::INFINITY;
            for a in &self.active {
                let at = if a.ready > self.now {
                    a.ready
                } else {
                    self.now + a.remaining / rate
                };
                next = next.min(at);
            }
            for d in &self.delayed {
                next = next.min(d.0);
            }
            if until_done.is_none() {
                next = next.min(t);
            }
            let dt = next - self.now;
            for a in &mut self.active {
                if a.ready <= self.now {
                    // A transfer whose completion is the next event finishes exactly (no
                    // floating-point residue left to chase).
                    let moved = if self.now + a.remaining / rate <= next {
                        a.remaining
                    } else {
                        (rate * dt).min(a.remaining)
                    };
                    a.remaining -= moved;
                    self.bytes += moved;
                }
            }
            self.busy += dt;
            self.now = next;
            let now = self.now;
            self.active.retain(|a| {
                let finished = a.ready <= now && a.remaining <= 0.0;
                if finished {
                    done.push((a.id, now));
                }
                !finished
            });
            self.release_delayed();
            self.admit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharing_never_exceeds_the_bandwidth() {
        // 8 transfers of 1 GB over a 10 GB/s link with 4 lanes: 0.8 s in total whatever the
        // interleaving; the first four finish together at 0.4 s.
        let mut l = Link::new(10e9, 0.0, 4);
        for i in 0..8 {
            l.submit(i, 1e9);
        }
        let mut done = Vec::new();
        l.run(10.0, None, &mut done);
        assert_eq!(done.len(), 8);
        assert!((done[0].1 - 0.4).abs() < 1e-9, "{:?}", done[0]);
        assert!((done[7].1 - 0.8).abs() < 1e-9, "{:?}", done[7]);
        assert!((l.bytes - 8e9).abs() < 1.0);
    }

    #[test]
    fn latency_then_bandwidth_is_eq2() {
        let mut l = Link::new(64e9, 1e-6, 4);
        l.submit(1, 8.0 * 1048576.0);
        let mut done = Vec::new();
        let t = l.run(0.0, Some(1), &mut done);
        let eq2 = 1e-6 + 8.0 * 1048576.0 / 64e9;
        assert!((t - eq2).abs() < 1e-12, "{t} vs {eq2}");
    }
}
