//! KVPR Table 1 setup on the virtual clock: one layer's KV of a decode step crosses the PCIe
//! link either whole or split by `strata_tiers::kvpr::plan_split` (Eq. 10–11). The pipeline is
//! replayed on a [`Link`] (activations first, then the KV tail; the GPU recomputes once the
//! activations are there), so the simulated time checks the planner's Eq. 10.

use strata_tiers::kvpr::{plan_split, Schedule, SplitInputs};

use crate::hw::HardwareProfile;
use crate::link::Link;

/// A Table 1 row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Table1Model {
    pub name: &'static str,
    pub hidden: u64,
    pub layers: u64,
    /// KVPR Table 1, "PCIe Latency (ms)".
    pub paper_pcie_ms: f64,
}

/// KVPR Table 1 (A100, PCIe 4.0 x16, FP16, batch 32, sequence 1024): OPT-6.7B h = 4096,
/// 512 MB, 15.6 ms; OPT-13B h = 5120, 640 MB, 19.5 ms; OPT-30B h = 7168, 896 MB, 27.3 ms.
/// Layer counts (32, 40, 48) are the OPT configurations (not in Table 1).
pub const TABLE1: [Table1Model; 3] = [
    Table1Model {
        name: "OPT-6.7B",
        hidden: 4096,
        layers: 32,
        paper_pcie_ms: 15.6,
    },
    Table1Model {
        name: "OPT-13B",
        hidden: 5120,
        layers: 40,
        paper_pcie_ms: 19.5,
    },
    Table1Model {
        name: "OPT-30B",
        hidden: 7168,
        layers: 48,
        paper_pcie_ms: 27.3,
    },
];

/// One model's result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvprRow {
    pub model: Table1Model,
    pub schedule: Schedule,
    pub kv_mib: f64,
    /// Per layer, transfer everything (l = 0), simulated.
    pub full_ms: f64,
    /// Per layer, the planned split, simulated.
    pub split_ms: f64,
    /// The planner's Eq. 10 value at its l.
    pub eq10_ms: f64,
    pub l: u64,
    /// Decode step over all layers (KV movement bound), full vs split.
    pub step_full_ms: f64,
    pub step_split_ms: f64,
}

/// Replays one layer's pipeline for split `l` and returns its duration in seconds.
pub fn replay(inputs: &SplitInputs, l: u64, schedule: Schedule) -> f64 {
    let mut link = Link::new(inputs.v_com, 0.0, 1);
    let mut done = Vec::new();
    let x_at = match schedule {
        Schedule::ColumnByColumn => {
            link.submit(0, inputs.m_x(l));
            link.run(f64::INFINITY, Some(0), &mut done)
        }
        // Row-by-row keeps the activations on the GPU: nothing to move first.
        Schedule::RowByRow => 0.0,
    };
    link.submit(1, inputs.m_kv(l));
    let kv_at = link.run(f64::INFINITY, Some(1), &mut done);
    kv_at.max(x_at + inputs.t_recomp(l))
}

/// Table 1 setup: batch 32, s' = 1024, FP16 on `hw` (the A100 profile), v_gpu = peak FP16.
pub fn table1(hw: &HardwareProfile, v_com: f64) -> Vec<KvprRow> {
    let mut out = Vec::new();
    for m in TABLE1 {
        let inputs = SplitInputs {
            batch: 32,
            seq: 1024,
            hidden: m.hidden,
            bytes_per_elem: 2,
            v_com,
            v_gpu: hw.fp16_flops,
        };
        for schedule in [Schedule::RowByRow, Schedule::ColumnByColumn] {
            let plan = plan_split(&inputs, schedule);
            let full = replay(&inputs, 0, schedule);
            let split = replay(&inputs, plan.l, schedule);
            out.push(KvprRow {
                model: m,
                schedule,
                kv_mib: inputs.m_kv(0) / 1048576.0,
                full_ms: full * 1e3,
                split_ms: split * 1e3,
                eq10_ms: plan.t * 1e3,
                l: plan.l,
                step_full_ms: full * 1e3 * m.layers as f64,
                step_split_ms: split * 1e3 * m.layers as f64,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replay_agrees_with_eq10_and_the_split_wins() {
        let hw = HardwareProfile::a100_pcie4();
        for r in table1(&hw, 32.0 * 1073741824.0) {
            assert!((r.split_ms - r.eq10_ms).abs() < 1e-6, "{r:?}");
            assert!(r.split_ms < r.full_ms, "{r:?}");
            // Table 1's PCIe latency is M_KV / 32 GiB/s.
            assert!((r.full_ms - r.model.paper_pcie_ms).abs() < 0.1, "{r:?}");
        }
    }
}
