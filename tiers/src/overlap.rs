//! TierKV's prefetch overlap condition (seed 002, §3.2–3.3) for per-layer swapping (Pie, seed
//! 004): whether a layer's transfer, started now, is hidden behind the compute of the layers in
//! between, and how many layers ahead it must start to be.
//!
//! - Eq. 2 ([`TransferTerms`]): one layer's transfer over a link, `ℓ + n_blocks · S_block / BW`.
//!   `ℓ` and `BW` come from the caller's own transfers, measured as they run and fitted by least
//!   squares ([`calibrate::fit`]; a proportional rate until two distinct sizes were seen). A layer
//!   whose blocks sit partly on disk takes the two-hop path (§3.3): its disk blocks cross disk →
//!   host first, then every block crosses host → device; the hops add, as in Algorithm 1.
//! - Eq. 1 ([`prefetch_fits`]): the transfer for layer `L` started when layer `f` begins is
//!   hidden when it takes at most the compute of layers `f, f+1, …, L−1` (each layer is one of
//!   TierKV's iterations; their times `T_iter` are measured per layer) plus `δ_sched`. Layers run
//!   cyclically (layer 0 of the next token follows the last).
//! - The lookahead `K` a transfer needs is the least number of layers before `L` whose compute
//!   window satisfies Eq. 1 (`K_SSD > K_DRAM` for a layer on disk: §3.3). Pure logic: no clock,
//!   no copies.
//!
//! [`calibrate::fit`]: crate::calibrate::fit

use std::collections::VecDeque;
use std::time::Duration;

use crate::calibrate::{fit, LinkFit};
use crate::policy::{prefetch_fits, TransferTerms};

/// Samples kept per link (the most recent ones).
const WINDOW: usize = 32;
/// Weight of a new per-layer compute time in its running mean.
const EWMA: f64 = 0.25;

/// A link of a layer's swap-in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// Host memory → device (T1 → T0).
    HostToDevice = 0,
    /// Disk → host memory (T2 → T1).
    DiskToHost = 1,
}

/// One layer's transfer and its compute window (both `None` until measured).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Overlap {
    /// Eq. 2: the transfer time of the layer's bytes (both hops for its disk blocks).
    pub t_transfer: Option<Duration>,
    /// Σ T_iter of the layers from the start layer up to (not including) the layer, + δ_sched.
    pub window: Option<Duration>,
    /// Eq. 1 for that window.
    pub fits: Option<bool>,
    /// The least number of layers before the layer whose compute hides the transfer (`None`:
    /// not measured yet, or not even all the other layers' compute does).
    pub steps: Option<usize>,
}

/// Measured per-layer compute times and link fits of one swapping cache.
#[derive(Clone, Debug)]
pub struct LayerOverlap {
    compute: Vec<Option<f64>>,
    samples: [VecDeque<(u64, f64)>; 2],
    links: [Option<LinkFit>; 2],
    block_bytes: u64,
    delta_sched: Duration,
}

impl LayerOverlap {
    /// `layers` layers moved in blocks of `block_bytes` (Eq. 2's `S_block`); `delta_sched` is
    /// Eq. 1's scheduling slack.
    pub fn new(layers: usize, block_bytes: u64, delta_sched: Duration) -> Self {
        LayerOverlap {
            compute: vec![None; layers],
            samples: [VecDeque::new(), VecDeque::new()],
            links: [None, None],
            block_bytes: block_bytes.max(1),
            delta_sched,
        }
    }

    pub fn layers(&self) -> usize {
        self.compute.len()
    }

    /// Layer `layer` computed for `seconds` (from its start to the next layer's start).
    pub fn observe_compute(&mut self, layer: usize, seconds: f64) {
        if let Some(c) = self.compute.get_mut(layer) {
            *c = Some(match *c {
                Some(mean) => mean + EWMA * (seconds - mean),
                None => seconds,
            });
        }
    }

    /// A transfer of `bytes` over `hop` took `seconds`; the link is fitted again.
    pub fn observe_transfer(&mut self, hop: Hop, bytes: u64, seconds: f64) {
        if bytes == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let s = &mut self.samples[hop as usize];
        if s.len() == WINDOW {
            s.pop_front();
        }
        s.push_back((bytes, seconds));
        let samples: Vec<(u64, f64)> = s.iter().copied().collect();
        self.links[hop as usize] = fit(&samples).ok().or_else(|| proportional(&samples));
    }

    /// The fitted link of `hop` (`None` before its first transfer).
    pub fn link(&self, hop: Hop) -> Option<LinkFit> {
        self.links[hop as usize]
    }

    /// The mean compute time of `layer` (`None` before it was measured).
    pub fn compute(&self, layer: usize) -> Option<Duration> {
        self.compute
            .get(layer)
            .copied()
            .flatten()
            .map(|s| Duration::from_secs_f64(s.max(0.0)))
    }

    /// Eq. 2 for one layer of `host_bytes` in host memory and `disk_bytes` on disk: the disk
    /// blocks' hop to host memory, then every block's hop to the device.
    pub fn t_transfer(&self, host_bytes: u64, disk_bytes: u64) -> Option<Duration> {
        let hop = |link: Option<LinkFit>, bytes: u64| -> Option<Duration> {
            if bytes == 0 {
                return Some(Duration::ZERO);
            }
            let l = link?;
            Some(
                TransferTerms {
                    latency: l.latency,
                    n_blocks: bytes.div_ceil(self.block_bytes),
                    block_bytes: self.block_bytes,
                    bandwidth: l.bandwidth,
                }
                .t_transfer(),
            )
        };
        let up = hop(self.link(Hop::HostToDevice), host_bytes + disk_bytes)?;
        let first = hop(self.link(Hop::DiskToHost), disk_bytes)?;
        Some(up.saturating_add(first))
    }

    /// The compute times of the `k` layers before `layer` (nearest last), if all were measured.
    fn before(&self, layer: usize, k: usize) -> Option<Vec<Duration>> {
        let n = self.layers();
        (1..=k)
            .rev()
            .map(|j| self.compute((layer + n * k - j) % n))
            .collect()
    }

    /// Eq. 1 for `layer`'s transfer started when layer `from` begins, and the lookahead the
    /// transfer needs.
    pub fn overlap(&self, from: usize, layer: usize, host_bytes: u64, disk_bytes: u64) -> Overlap {
        let n = self.layers();
        if n == 0 || from >= n || layer >= n {
            return Overlap::default();
        }
        let t_transfer = self.t_transfer(host_bytes, disk_bytes);
        let distance = (layer + n - from) % n;
        let t_iter = self.before(layer, distance);
        let window = t_iter
            .as_ref()
            .map(|t| t.iter().fold(self.delta_sched, |a, &x| a.saturating_add(x)));
        let fits = t_transfer
            .zip(t_iter.as_ref())
            .map(|(t, w)| prefetch_fits(t, w, self.delta_sched));
        let steps = t_transfer.and_then(|t| {
            (0..n).find(|&k| {
                self.before(layer, k)
                    .is_some_and(|w| prefetch_fits(t, &w, self.delta_sched))
            })
        });
        Overlap {
            t_transfer,
            window,
            fits,
            steps,
        }
    }
}

/// `seconds = bytes / bandwidth` through the samples' totals: the link before a fit is possible
/// (one size only, or times that do not grow with the size).
fn proportional(samples: &[(u64, f64)]) -> Option<LinkFit> {
    let bytes: u64 = samples.iter().map(|s| s.0).sum();
    let seconds: f64 = samples.iter().map(|s| s.1).sum();
    (bytes > 0 && seconds > 0.0).then(|| LinkFit {
        bandwidth: bytes as f64 / seconds,
        latency: Duration::ZERO,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1e3)
    }

    fn measured(layers: usize, compute_ms: f64) -> LayerOverlap {
        let mut o = LayerOverlap::new(layers, 1 << 20, Duration::ZERO);
        for l in 0..layers {
            o.observe_compute(l, compute_ms / 1e3);
        }
        // Host → device: 1 ms + 1 ms per MiB; disk → host: 2 ms per MiB.
        for mib in [1u64, 2, 4] {
            o.observe_transfer(Hop::HostToDevice, mib << 20, (1.0 + mib as f64) / 1e3);
            o.observe_transfer(Hop::DiskToHost, mib << 20, 2.0 * mib as f64 / 1e3);
        }
        o
    }

    #[test]
    fn eq2_fits_the_measured_links_and_adds_the_disk_hop() {
        let o = measured(4, 3.0);
        let host = o.link(Hop::HostToDevice).unwrap();
        let per_ms = (1u64 << 20) as f64 * 1e3;
        assert!((host.bandwidth - per_ms).abs() / per_ms < 1e-6, "{host:?}");
        assert!((host.latency.as_secs_f64() - 1e-3).abs() < 1e-9);
        let t = o.t_transfer(2 << 20, 0).unwrap();
        assert!((t.as_secs_f64() - 3e-3).abs() < 1e-6, "{t:?}");
        // 2 MiB in host memory and 2 on disk: 1 + 4 ms up, 4 ms from disk.
        let t = o.t_transfer(2 << 20, 2 << 20).unwrap();
        assert!((t.as_secs_f64() - 9e-3).abs() < 1e-6, "{t:?}");
    }

    #[test]
    fn eq1_window_is_the_compute_of_the_layers_in_between() {
        let o = measured(4, 3.0);
        // 5 ms from host: hidden by two layers (6 ms), not one (3 ms).
        let near = o.overlap(2, 3, 4 << 20, 0);
        assert_eq!(near.window, Some(ms(3.0)));
        assert_eq!(near.fits, Some(false));
        assert_eq!(near.steps, Some(2));
        let far = o.overlap(1, 3, 4 << 20, 0);
        assert_eq!(far.fits, Some(true));
        // Cyclic: started at layer 3 for layer 1, the window is layers 3 and 0.
        assert_eq!(o.overlap(3, 1, 4 << 20, 0).window, Some(ms(6.0)));
        // 2 MiB from host memory (3 ms) needs one layer; from disk (3 + 4 ms) three: the
        // two-hop path needs the longer lookahead (K_SSD > K_DRAM).
        assert_eq!(o.overlap(1, 3, 2 << 20, 0).steps, Some(1));
        assert_eq!(o.overlap(1, 3, 0, 2 << 20).steps, Some(3));
        // 40 ms never fits the 9 ms of the three other layers.
        assert_eq!(o.overlap(0, 3, 0, 13 << 20).steps, None);
    }

    #[test]
    fn nothing_is_claimed_before_it_is_measured() {
        let mut o = LayerOverlap::new(3, 4096, Duration::ZERO);
        assert_eq!(o.overlap(0, 2, 4096, 0), Overlap::default());
        o.observe_transfer(Hop::HostToDevice, 8192, 1e-3);
        // One size: a proportional rate.
        assert_eq!(o.t_transfer(16384, 0), Some(ms(2.0)));
        assert_eq!(o.overlap(0, 2, 4096, 0).window, None);
        assert_eq!(o.t_transfer(0, 4096), None, "the disk link is not measured");
        o.observe_compute(0, 1e-3);
        o.observe_compute(1, 1e-3);
        assert_eq!(o.overlap(0, 2, 4096, 0).fits, Some(true));
        // The running mean moves a quarter of the way.
        o.observe_compute(0, 5e-3);
        let mean = o.compute(0).unwrap().as_secs_f64();
        assert!((mean - 2e-3).abs() < 1e-12, "{mean}");
    }
}
