//! Harvest Figures 3 and 7 setup on the virtual clock: the fetch latency of expert- and KV-sized
//! chunks from a peer GPU's HBM over NVLink against host DRAM over PCIe.
//!
//! Chunks are placed by the runtime's pure ranking (`strata_tiers::harvest::fit::rank`: direct
//! links, then hints, then best fit) over peers whose harvestable bytes are drawn from the
//! seed; a chunk no peer can hold stays on the host (its authoritative copy). Each fetch is
//! replayed alone on a [`Link`] of the tier it was placed in: the peer link of the NVLink profile
//! or the host link of the PCIe profile.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_tiers::harvest::fit::{rank, Candidate};

use crate::hw::HardwareProfile;
use crate::link::Link;

/// A chunk kind of Figure 3 or 7.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkKind {
    pub name: &'static str,
    pub bytes: u64,
}

/// DeepSeek-V3 / Kimi-K2 KV entry (MLA, FP16): 61 layers × (512 + 64) × 2 B (model configs,
/// not in the seed).
pub const MLA_KV_ENTRY: u64 = 61 * 576 * 2;

/// The default chunks: KV pages (32 KiB, 2 MiB), Figure 7's DeepSeek-V3/Kimi-K2 chunks of 100,
/// 1000 and 8000 KV entries, and one expert (gate, up and down projections, FP16) of
/// Qwen1.5-MoE-A2.7B (2048 × 1408), Phi-3.5-MoE (4096 × 6400) and Mixtral-8×7B (4096 × 14336);
/// the expert shapes are the models' configs (not in the seed).
pub fn default_chunks() -> Vec<ChunkKind> {
    vec![
        ChunkKind {
            name: "KV page 32 KiB",
            bytes: 32 << 10,
        },
        ChunkKind {
            name: "KV page 2 MiB",
            bytes: 2 << 20,
        },
        ChunkKind {
            name: "KV 100 entries (DeepSeek-V3/Kimi-K2)",
            bytes: 100 * MLA_KV_ENTRY,
        },
        ChunkKind {
            name: "KV 1000 entries (DeepSeek-V3/Kimi-K2)",
            bytes: 1000 * MLA_KV_ENTRY,
        },
        ChunkKind {
            name: "KV 8000 entries (DeepSeek-V3/Kimi-K2)",
            bytes: 8000 * MLA_KV_ENTRY,
        },
        ChunkKind {
            name: "expert Qwen1.5-MoE-A2.7B",
            bytes: 3 * 2048 * 1408 * 2,
        },
        ChunkKind {
            name: "expert Phi-3.5-MoE",
            bytes: 3 * 4096 * 6400 * 2,
        },
        ChunkKind {
            name: "expert Mixtral-8x7B",
            bytes: 3 * 4096 * 14336 * 2,
        },
    ]
}

/// The experiment's setup.
#[derive(Clone, Debug, PartialEq)]
pub struct HarvestConfig {
    /// The peer tier: `host_link_*` is the GPU↔GPU link.
    pub peer_hw: HardwareProfile,
    /// The host tier: `host_link_*` is the CPU→GPU link.
    pub host_hw: HardwareProfile,
    /// Peers (all directly linked).
    pub peers: u32,
    /// Each peer's harvestable bytes are drawn uniformly from this range.
    pub harvestable: (u64, u64),
    /// Chunks of each kind to place.
    pub count: u32,
    pub chunks: Vec<ChunkKind>,
    pub seed: u64,
}

impl HarvestConfig {
    /// Peer HBM over the 2×H100 NVLink profile, host DRAM over the H100 PCIe Gen5 profile,
    /// 3 peers with 1–4 GiB harvestable each, 16 chunks of each kind.
    pub fn paper(seed: u64) -> Self {
        HarvestConfig {
            peer_hw: HardwareProfile::h100x2_nvlink(),
            host_hw: HardwareProfile::h100_pcie5(),
            peers: 3,
            harvestable: (1 << 30, 4 << 30),
            count: 16,
            chunks: default_chunks(),
            seed,
        }
    }
}

/// One chunk kind's result.
#[derive(Clone, Debug, PartialEq)]
pub struct HarvestRow {
    pub chunk: ChunkKind,
    /// One fetch from host DRAM, µs.
    pub host_us: f64,
    /// One fetch from peer HBM, µs.
    pub peer_us: f64,
    /// Chunks the ranking placed on a peer (of `count`).
    pub on_peer: u32,
    pub count: u32,
    /// Mean fetch over the placed chunks (peer or host, as placed), µs.
    pub placed_mean_us: f64,
}

impl HarvestRow {
    pub fn speedup(&self) -> f64 {
        self.host_us / self.peer_us
    }
}

/// One fetch of `bytes` alone on the link of `hw`, seconds.
pub fn fetch(hw: &HardwareProfile, bytes: u64) -> f64 {
    let mut link = Link::new(hw.host_link_bw, hw.host_link_latency, hw.dma_lanes);
    link.submit(0, bytes as f64);
    let mut done = Vec::new();
    link.run(f64::INFINITY, Some(0), &mut done)
}

/// Runs every chunk kind: each kind starts from a fresh draw of the peers' harvestable bytes
/// (seeded per kind), places `count` chunks by `fit::rank`, and fetches each once.
pub fn run(cfg: &HarvestConfig) -> Vec<HarvestRow> {
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    cfg.chunks
        .iter()
        .map(|&chunk| {
            let mut peers: Vec<Candidate> = (0..cfg.peers)
                .map(|d| Candidate {
                    device: d + 1,
                    harvestable: rng.random_range(cfg.harvestable.0..=cfg.harvestable.1),
                    direct: true,
                    preferred: false,
                })
                .collect();
            let host = fetch(&cfg.host_hw, chunk.bytes);
            let peer = fetch(&cfg.peer_hw, chunk.bytes);
            let mut on_peer = 0u32;
            let mut sum = 0.0;
            for _ in 0..cfg.count {
                match rank(&peers, chunk.bytes, false).first() {
                    Some(&dev) => {
                        if let Some(p) = peers.iter_mut().find(|p| p.device == dev) {
                            p.harvestable -= chunk.bytes;
                        }
                        on_peer += 1;
                        sum += peer;
                    }
                    None => sum += host,
                }
            }
            HarvestRow {
                chunk,
                host_us: host * 1e6,
                peer_us: peer * 1e6,
                on_peer,
                count: cfg.count,
                placed_mean_us: if cfg.count == 0 {
                    0.0
                } else {
                    sum / f64::from(cfg.count) * 1e6
                },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_per_seed() {
        assert_eq!(run(&HarvestConfig::paper(7)), run(&HarvestConfig::paper(7)));
    }

    #[test]
    fn peer_beats_host_for_large_chunks() {
        let rows = run(&HarvestConfig::paper(1));
        for r in &rows {
            assert!(r.peer_us <= r.host_us, "{r:?}");
            if r.chunk.bytes >= 1 << 20 {
                // 450 GB/s NVLink vs 64 GB/s PCIe: bandwidth dominates past a MiB.
                assert!(r.speedup() > 5.0, "{r:?}");
            }
        }
    }

    #[test]
    fn placement_spills_to_host_when_peers_are_full() {
        let mut cfg = HarvestConfig::paper(3);
        cfg.peers = 1;
        cfg.harvestable = (1 << 30, 1 << 30);
        cfg.chunks = vec![ChunkKind {
            name: "300 MiB",
            bytes: 300 << 20,
        }];
        let r = &run(&cfg)[0];
        // 1 GiB holds three 300 MiB chunks; the other 13 stay on the host.
        assert_eq!(r.on_peer, 3);
        let want = (3.0 * r.peer_us + 13.0 * r.host_us) / 16.0;
        assert!((r.placed_mean_us - want).abs() < 1e-6, "{r:?}");
    }
}
