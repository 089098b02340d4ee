//! MIRAGE's per-model equations, pure (numbers in, numbers out): how many layers may be remapped
//! (§5.3, `T_T · N ≤ T_compute`), which layers stream (§5.4, uniform intervals over the layer
//! ring) and how many slots they share (§5.4, `m = α + 1` by Eq. 4 or `m = α + 2` by Eq. 5).
//!
//! Terms as in the paper: `n` layers, `α` layers whose parameter memory is remapped to the KV
//! cache, `m = α + β` layers transferred CPU→GPU per token sharing `β` slots, `T_T` the transfer
//! time of one layer, `T_c` the compute time of one layer.

use std::time::Duration;

/// How the `m` streamed layers share GPU memory: `β` slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buffering {
    /// `β = 1`, `m = α + 1`: one shared slot; a transfer starts only after the previous
    /// occupant's compute finished (Eq. 4).
    Single,
    /// `β = 2`, `m = α + 2`: double buffering; the next layer loads while the current one
    /// computes (Eq. 5).
    Double,
}

impl Buffering {
    /// `β`: the number of slots.
    pub fn beta(self) -> u32 {
        match self {
            Buffering::Single => 1,
            Buffering::Double => 2,
        }
    }
}

/// Eq. 4: `T_T × (α + 1) ≤ T_c × (n − α − 1)`.
pub fn eq4_holds(n: u32, alpha: u32, t_t: Duration, t_c: Duration) -> bool {
    if alpha + 1 > n {
        return false;
    }
    t_t.as_secs_f64() * f64::from(alpha + 1) <= t_c.as_secs_f64() * f64::from(n - alpha - 1)
}

/// Eq. 5: `T_T × (α + 2) ≤ T_c × n`.
pub fn eq5_holds(n: u32, alpha: u32, t_t: Duration, t_c: Duration) -> bool {
    if alpha + 2 > n {
        return false;
    }
    t_t.as_secs_f64() * f64::from(alpha + 2) <= t_c.as_secs_f64() * f64::from(n)
}

/// The smallest valid `m` (objective 2: least CPU→GPU traffic) whose timing condition holds:
/// `m = α + 1` when Eq. 4 holds, else `m = α + 2` when Eq. 5 holds, else none (remapping `α`
/// layers would make parameter transfer the bottleneck). `α = 0` needs no buffering: `None`.
pub fn choose_buffering(n: u32, alpha: u32, t_t: Duration, t_c: Duration) -> Option<Buffering> {
    if alpha == 0 {
        None
    } else if eq4_holds(n, alpha, t_t, t_c) {
        Some(Buffering::Single)
    } else if eq5_holds(n, alpha, t_t, t_c) {
        Some(Buffering::Double)
    } else {
        None
    }
}

/// §5.3: the most layers `N` with `T_T · N ≤ T_compute` (`u32::MAX` when `T_T` is zero).
pub fn max_layers_for(t_t: Duration, t_compute: Duration) -> u32 {
    if t_t.is_zero() {
        return u32::MAX;
    }
    let n = (t_compute.as_secs_f64() / t_t.as_secs_f64()).floor();
    if n >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        n as u32
    }
}

/// §5.4: `m` evenly spaced layers of the `n`-layer ring, starting at `offset`: layer
/// `(offset + ⌊i·n/m⌋) mod n` for `i < m`, sorted. Gaps between ring neighbours differ by at
/// most one layer, which maximizes the smallest gap (the RHS of Eq. 3).
pub fn uniform_layers(n: u32, m: u32, offset: u32) -> Vec<u32> {
    if n == 0 || m == 0 {
        return Vec::new();
    }
    let m = m.min(n);
    let mut v: Vec<u32> = (0..m)
        .map(|i| {
            ((u64::from(offset) + u64::from(i) * u64::from(n) / u64::from(m)) % u64::from(n)) as u32
        })
        .collect();
    v.sort_unstable();
    v
}

/// The uniform selection of `m` layers (over every offset within one interval) that keeps the
/// most of `current` streamed, so that growing `α` by one reloads as few layers as possible.
/// Ties go to the smallest offset.
pub fn uniform_layers_near(n: u32, m: u32, current: &[u32]) -> Vec<u32> {
    if n == 0 || m == 0 {
        return Vec::new();
    }
    let interval = n.div_ceil(m.min(n));
    let mut best = uniform_layers(n, m, 0);
    let mut best_overlap = overlap(&best, current);
    for offset in 1..interval {
        let cand = uniform_layers(n, m, offset);
        let o = overlap(&cand, current);
        if o > best_overlap {
            best = cand;
            best_overlap = o;
        }
    }
    best
}

fn overlap(a: &[u32], b: &[u32]) -> usize {
    a.iter().filter(|x| b.contains(x)).count()
}

/// Gaps between ring neighbours of a sorted selection (layers from one selected layer to the
/// next, wrapping from the last to the first of the next token): `k_1 … k_m` of Eq. 2.
pub fn ring_gaps(n: u32, selected: &[u32]) -> Vec<u32> {
    let m = selected.len();
    (0..m)
        .map(|i| {
            let a = selected[i];
            let b = selected[(i + 1) % m];
            if m == 1 {
                n
            } else {
                (b + n - a) % n
            }
        })
        .collect()
}

/// Where one model stands: `α` layers remapped, and (when `α > 0`) the `m` streamed layers and
/// their `β` slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerPlan {
    /// `n`.
    pub layers: u32,
    /// `α`: layers' worth of parameter memory given to the KV cache.
    pub alpha: u32,
    /// `β` slots (`None` when `α = 0`).
    pub buffering: Option<Buffering>,
    /// The `m = α + β` streamed layers, sorted, evenly spaced.
    pub streamed: Vec<u32>,
}

impl LayerPlan {
    /// Nothing remapped: every layer resident.
    pub fn resident(layers: u32) -> Self {
        LayerPlan {
            layers,
            alpha: 0,
            buffering: None,
            streamed: Vec::new(),
        }
    }

    /// `β`, 0 when nothing is remapped.
    pub fn beta(&self) -> u32 {
        self.buffering.map_or(0, Buffering::beta)
    }

    /// `m = α + β`.
    pub fn m(&self) -> u32 {
        self.alpha + self.beta()
    }

    /// Whether `layer` streams through the slots.
    pub fn is_streamed(&self, layer: u32) -> bool {
        self.streamed.binary_search(&layer).is_ok()
    }

    /// Layers' worth of parameter memory the model holds on the GPU: `n − α`.
    pub fn gpu_layers(&self) -> u32 {
        self.layers - self.alpha
    }
}

/// The plan for `α` layers of an `n`-layer model, or `None` when Eq. 4 and Eq. 5 both fail
/// (or `α + β > n`). Keeps as many of `current` streamed layers as a uniform selection allows.
pub fn plan_for(
    n: u32,
    alpha: u32,
    t_t: Duration,
    t_c: Duration,
    current: &[u32],
) -> Option<LayerPlan> {
    if alpha == 0 {
        return Some(LayerPlan::resident(n));
    }
    let buffering = choose_buffering(n, alpha, t_t, t_c)?;
    let m = alpha + buffering.beta();
    Some(LayerPlan {
        layers: n,
        alpha,
        buffering: Some(buffering),
        streamed: uniform_layers_near(n, m, current),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn eq4_wins_when_alpha_is_small() {
        // n = 40, T_T = 2 ms, T_c = 1 ms, α = 4: Eq. 4: 2×5 = 10 ≤ 1×35 → m = α + 1.
        assert!(eq4_holds(40, 4, ms(2), ms(1)));
        assert_eq!(
            choose_buffering(40, 4, ms(2), ms(1)),
            Some(Buffering::Single)
        );
    }

    #[test]
    fn eq5_wins_when_eq4_fails() {
        // n = 40, T_T = 2 ms, T_c = 1 ms, α = 12: Eq. 4: 2×13 = 26 > 1×27? no, 26 ≤ 27 holds.
        assert_eq!(
            choose_buffering(40, 12, ms(2), ms(1)),
            Some(Buffering::Single)
        );
        // α = 13: Eq. 4: 2×14 = 28 > 26 fails; Eq. 5: 2×15 = 30 ≤ 40 holds → m = α + 2.
        assert!(!eq4_holds(40, 13, ms(2), ms(1)));
        assert!(eq5_holds(40, 13, ms(2), ms(1)));
        assert_eq!(
            choose_buffering(40, 13, ms(2), ms(1)),
            Some(Buffering::Double)
        );
    }

    #[test]
    fn neither_holds_means_no_plan() {
        // α = 19: Eq. 5: 2×21 = 42 > 40.
        assert_eq!(choose_buffering(40, 19, ms(2), ms(1)), None);
        assert_eq!(plan_for(40, 19, ms(2), ms(1), &[]), None);
        // α = 18: Eq. 5: 2×20 = 40 ≤ 40 still holds.
        assert_eq!(
            choose_buffering(40, 18, ms(2), ms(1)),
            Some(Buffering::Double)
        );
        assert_eq!(choose_buffering(40, 0, ms(2), ms(1)), None);
    }

    #[test]
    fn paper_example_switches_to_double_buffering_at_nine() {
        // §5.4: for n = 40, m = α + 2 becomes preferable from α ≥ 9; with T_T = 3.1 T_c Eq. 4
        // fails from α = 9 (3.1×10 = 31 > 30) while Eq. 5 holds (3.1×11 = 34.1 ≤ 40).
        let t_c = Duration::from_micros(1000);
        let t_t = Duration::from_micros(3100);
        assert_eq!(choose_buffering(40, 8, t_t, t_c), Some(Buffering::Single));
        assert_eq!(choose_buffering(40, 9, t_t, t_c), Some(Buffering::Double));
    }

    #[test]
    fn transfer_budget_caps_layers() {
        assert_eq!(max_layers_for(ms(3), ms(10)), 3);
        assert_eq!(max_layers_for(ms(5), ms(10)), 2);
        assert_eq!(max_layers_for(ms(11), ms(10)), 0);
        assert_eq!(max_layers_for(Duration::ZERO, ms(1)), u32::MAX);
    }

    #[test]
    fn uniform_layers_are_evenly_spaced() {
        // The paper's 8-layer example: layers 1 and 5 (0-based 0 and 4).
        assert_eq!(uniform_layers(8, 2, 0), vec![0, 4]);
        for n in 1..50u32 {
            for m in 1..=n {
                for offset in [0, 1, n / 2] {
                    let s = uniform_layers(n, m, offset);
                    assert_eq!(s.len(), m as usize, "n={n} m={m}");
                    let gaps = ring_gaps(n, &s);
                    assert_eq!(gaps.iter().sum::<u32>(), n);
                    let (lo, hi) = (gaps.iter().min().unwrap(), gaps.iter().max().unwrap());
                    assert!(hi - lo <= 1, "n={n} m={m} gaps {gaps:?}");
                    assert_eq!(*lo, n / m, "min gap is ⌊n/m⌋ (optimal RHS of Eq. 3)");
                }
            }
        }
    }

    #[test]
    fn near_selection_keeps_streamed_layers_when_it_can() {
        let a = uniform_layers(40, 4, 0);
        let b = uniform_layers_near(40, 8, &a);
        assert!(a.iter().all(|l| b.contains(l)), "{a:?} ⊂ {b:?}");
        let gaps = ring_gaps(40, &b);
        assert!(gaps.iter().all(|&g| g == 5));
    }

    #[test]
    fn plans_count_layers_as_the_paper_does() {
        let p = plan_for(40, 13, ms(2), ms(1), &[]).unwrap();
        assert_eq!((p.alpha, p.beta(), p.m()), (13, 2, 15));
        assert_eq!(p.streamed.len(), 15);
        assert_eq!(p.gpu_layers(), 27);
        assert_eq!(
            plan_for(8, 0, ms(1), ms(1), &[]),
            Some(LayerPlan::resident(8))
        );
    }
}
