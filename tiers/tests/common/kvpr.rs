//! One KVPR layer for the runtime tests: X, W_K, W_V and the fully transferred K = X·W_K,
//! V = X·W_V computed by the GEMM twin.

use strata_kernels::gemm::Gemm;
use strata_tiers::kvpr::HostLayer;

pub struct Data {
    pub seq: usize,
    pub hidden: usize,
    pub x: Vec<f32>,
    pub w_k: Vec<f32>,
    pub w_v: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Deterministic pseudo-random `u64`s per seed (xorshift).
fn stream(seed: u64) -> impl Iterator<Item = u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    })
}

impl Data {
    /// Small integers (|x| ≤ 3, |w| ≤ 2): every FP32 partial sum of the products is exact, in
    /// any order.
    pub fn integers(seq: usize, hidden: usize) -> Self {
        let ints = |n: usize, seed: u64, span: u64| -> Vec<f32> {
            stream(seed)
                .take(n)
                .map(|r| (r % (2 * span + 1)) as f32 - span as f32)
                .collect()
        };
        Self::with(seq, hidden, |n, seed| {
            ints(n, seed, 3 - u64::from(seed > 1))
        })
    }

    /// Fractions in `[-0.5, 0.5)`: sums round, so only the twin itself reproduces them exactly.
    pub fn fractions(seq: usize, hidden: usize) -> Self {
        Self::with(seq, hidden, |n, seed| {
            stream(seed)
                .take(n)
                .map(|r| (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .collect()
        })
    }

    /// `values(count, seed)`: seed 1 for X, 2 for W_K, 3 for W_V.
    fn with(seq: usize, hidden: usize, values: impl Fn(usize, u64) -> Vec<f32>) -> Self {
        let x = values(seq * hidden, 1);
        let w_k = values(hidden * hidden, 2);
        let w_v = values(hidden * hidden, 3);
        let mut k = vec![0f32; seq * hidden];
        let mut v = vec![0f32; seq * hidden];
        let full = Gemm::packed(seq, hidden, hidden);
        full.run(&x, &w_k, &mut k).unwrap();
        full.run(&x, &w_v, &mut v).unwrap();
        Data {
            seq,
            hidden,
            x,
            w_k,
            w_v,
            k,
            v,
        }
    }

    pub fn layer(&self) -> HostLayer<'_> {
        HostLayer {
            x: &self.x,
            k: &self.k,
            v: &self.v,
            w_k: &self.w_k,
            w_v: &self.w_v,
            seq: self.seq,
            hidden: self.hidden,
        }
    }
}
