//! KVPR (seed 003): transfer part of the KV cache, recompute the rest from activations.
//!
//! The planner minimizes Eq. 10 over the split point `l` (Eq. 11) for one layer:
//!
//! ```text
//! M_X[0:l]   = b·l·h·p                       (Eq. 6)
//! M_KV[l:s'] = 2·b·(s'−l)·h·p                (Eq. 6)
//! N_KV[0:l]  = 4·b·l·h²                      (Eq. 8)
//! t_recomp   = N_KV[0:l] / v_gpu             (Eq. 9)
//! t          = M_X[0:l]/v_com + max(t_recomp, M_KV[l:s']/v_com)   (Eq. 10, column-by-column)
//! ```
//!
//! and for the row-by-row schedule the first term is omitted (§3.2: "If the first term in
//! Eq. (10) is omitted, the problem simplifies to the row-by-row schedule"). Eq. 11 writes the
//! constraint as `0 ≤ l ≤ s`; the text before Eq. 6 says `0 ≤ l ≤ s'`, and Appendix A.4 reports
//! l = 182 for a prompt of 128, so we search `0 ≤ l ≤ s'`.
//!
//! The runtime piece ([`transfer_recompute`]) runs on the CPU: it moves `K,V[l:s']` on a copy
//! thread while the caller's thread recomputes `K,V[0:l] = X[0:l]·W_K, X[0:l]·W_V` with a plain
//! matmul, then the two halves form the merged cache. (The GPU version with cuBLAS is owed.)

/// Profiled inputs of the planner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitInputs {
    /// b: batch size.
    pub batch: u64,
    /// s': current sequence length.
    pub seq: u64,
    /// h: hidden (embedding) dimension.
    pub hidden: u64,
    /// p: bytes per element (2 for FP16).
    pub bytes_per_elem: u64,
    /// v_com: bytes/s over the CPU→GPU link.
    pub v_com: f64,
    /// v_gpu: FLOP/s the GPU sustains for the recomputation.
    pub v_gpu: f64,
}

/// Which pipeline the plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Latency-oriented: Eq. 10 without its first term.
    RowByRow,
    /// Throughput-oriented: Eq. 10 in full.
    ColumnByColumn,
}

/// A chosen split and its predicted time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Split {
    /// l: tokens whose KV is recomputed from transferred activations.
    pub l: u64,
    /// t^i (Eq. 10) at that l, seconds.
    pub t: f64,
    /// t^i at l = 0 (transfer everything), seconds.
    pub t_full_transfer: f64,
}

impl SplitInputs {
    /// `M_X[0:l]` (Eq. 6), bytes.
    pub fn m_x(&self, l: u64) -> f64 {
        (self.batch * l * self.hidden * self.bytes_per_elem) as f64
    }
    /// `M_KV[l:s']` (Eq. 6), bytes.
    pub fn m_kv(&self, l: u64) -> f64 {
        (2 * self.batch * (self.seq - l.min(self.seq)) * self.hidden * self.bytes_per_elem) as f64
    }
    /// `N_KV[0:l]` (Eq. 8), FLOPs.
    pub fn n_kv(&self, l: u64) -> f64 {
        4.0 * self.batch as f64 * l as f64 * (self.hidden as f64).powi(2)
    }
    /// t_recomp (Eq. 9), seconds.
    pub fn t_recomp(&self, l: u64) -> f64 {
        self.n_kv(l) / self.v_gpu
    }
    /// t^i (Eq. 10) for `schedule`, seconds.
    pub fn time(&self, l: u64, schedule: Schedule) -> f64 {
        let overlap = self.t_recomp(l).max(self.m_kv(l) / self.v_com);
        match schedule {
            Schedule::ColumnByColumn => self.m_x(l) / self.v_com + overlap,
            Schedule::RowByRow => overlap,
        }
    }
}

/// Eq. 11: the `l` in `0..=s'` minimizing Eq. 10 (the smallest such `l` on ties). One integer
/// variable, so an exhaustive search is exact and cheap (s' evaluations).
pub fn plan_split(inputs: &SplitInputs, schedule: Schedule) -> Split {
    let mut best = (0u64, inputs.time(0, schedule));
    for l in 1..=inputs.seq {
        let t = inputs.time(l, schedule);
        if t < best.1 {
            best = (l, t);
        }
    }
    Split {
        l: best.0,
        t: best.1,
        t_full_transfer: inputs.time(0, schedule),
    }
}

/// `out[r][c] = Σ_k a[r][k] · w[k][c]` for row-major `a` (rows × k) and `w` (k × cols).
pub fn matmul(a: &[f32], w: &[f32], rows: usize, k: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(a.len(), rows * k);
    assert_eq!(w.len(), k * cols);
    assert_eq!(out.len(), rows * cols);
    for r in 0..rows {
        let o = &mut out[r * cols..(r + 1) * cols];
        o.fill(0.0);
        for (kk, &x) in a[r * k..(r + 1) * k].iter().enumerate() {
            let wr = &w[kk * cols..(kk + 1) * cols];
            for (oc, &wc) in o.iter_mut().zip(wr) {
                *oc += x * wc;
            }
        }
    }
}

/// One layer's host-resident state for a sequence: activations and the KV cache, row-major,
/// `seq × hidden` each, and the projection weights (`hidden × hidden`).
pub struct HostLayer<'a> {
    pub x: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub w_k: &'a [f32],
    pub w_v: &'a [f32],
    pub seq: usize,
    pub hidden: usize,
}

/// KVPR's runtime on the CPU: the first `l` rows of K and V are recomputed from `X[0:l]`
/// (which is "transferred" first: copied to the destination side), while a copy thread moves
/// `K,V[l:s']`; returns the merged `(K, V)`.
pub fn transfer_recompute(layer: &HostLayer<'_>, l: usize) -> (Vec<f32>, Vec<f32>) {
    let (s, h) = (layer.seq, layer.hidden);
    assert!(l <= s);
    let mut k = vec![0f32; s * h];
    let mut v = vec![0f32; s * h];
    let (k_re, k_tx) = k.split_at_mut(l * h);
    let (v_re, v_tx) = v.split_at_mut(l * h);
    // X[0:l] crosses the link first.
    let x_dev: Vec<f32> = layer.x[..l * h].to_vec();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            k_tx.copy_from_slice(&layer.k[l * h..]);
            v_tx.copy_from_slice(&layer.v[l * h..]);
        });
        matmul(&x_dev, layer.w_k, l, h, h, k_re);
        matmul(&x_dev, layer.w_v, l, h, h, v_re);
    });
    (k, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table1(hidden: u64) -> SplitInputs {
        // KVPR Table 1 / Fig. 1: A100, PCIe 4.0 x16 at 32 GB/s, FP16, batch 32, s' = 1024,
        // 312 TFLOPS.
        SplitInputs {
            batch: 32,
            seq: 1024,
            hidden,
            bytes_per_elem: 2,
            v_com: 32e9,
            v_gpu: 312e12,
        }
    }

    #[test]
    fn the_plan_is_the_exhaustive_minimum_and_beats_full_transfer() {
        for h in [4096, 5120, 7168] {
            let i = table1(h);
            for sched in [Schedule::RowByRow, Schedule::ColumnByColumn] {
                let p = plan_split(&i, sched);
                assert!(p.l > 0 && p.l < i.seq, "{h} {sched:?} {p:?}");
                assert!(p.t < p.t_full_transfer);
                for l in 0..=i.seq {
                    assert!(i.time(l, sched) >= p.t);
                }
            }
            // Transferring X costs time, so the column plan recomputes no more than the row one.
            let row = plan_split(&i, Schedule::RowByRow);
            let col = plan_split(&i, Schedule::ColumnByColumn);
            assert!(col.l <= row.l && col.t >= row.t);
        }
    }

    #[test]
    fn eq6_matches_table1_kv_size() {
        // OPT-6.7B: 2·32·1024·4096·2 B = 512 MiB per layer (Table 1 "KV Cache (MB)": 512).
        assert_eq!(table1(4096).m_kv(0), 512.0 * 1048576.0);
        assert_eq!(table1(5120).m_kv(0), 640.0 * 1048576.0);
        assert_eq!(table1(7168).m_kv(0), 896.0 * 1048576.0);
    }

    #[test]
    fn a_slow_gpu_transfers_everything() {
        let mut i = table1(4096);
        i.v_gpu = 1e6;
        assert_eq!(plan_split(&i, Schedule::RowByRow).l, 0);
    }

    #[test]
    fn merged_kv_equals_the_transferred_kv() {
        let (s, h) = (37, 16);
        let gen = |n: usize, seed: u32| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let x = (i as u32 ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(2_654_435_761);
                    (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
                })
                .collect()
        };
        let x = gen(s * h, 1);
        let w_k = gen(h * h, 2);
        let w_v = gen(h * h, 3);
        let mut k = vec![0f32; s * h];
        let mut v = vec![0f32; s * h];
        matmul(&x, &w_k, s, h, h, &mut k);
        matmul(&x, &w_v, s, h, h, &mut v);
        let layer = HostLayer {
            x: &x,
            k: &k,
            v: &v,
            w_k: &w_k,
            w_v: &w_v,
            seq: s,
            hidden: h,
        };
        for l in [0, 1, 20, s] {
            let (mk, mv) = transfer_recompute(&layer, l);
            assert!(mk == k, "K differs at l = {l}");
            assert!(mv == v, "V differs at l = {l}");
        }
        // A wrong weight shows up: the test can fail.
        let bad = HostLayer { w_k: &w_v, ..layer };
        assert!(transfer_recompute(&bad, 5).0 != k);
    }
}
