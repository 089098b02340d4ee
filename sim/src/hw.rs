//! Hardware profiles. Every number is quoted with its source; numbers that are not in the seed
//! papers come from vendor datasheets and say so.

/// A GPU with its memory tiers and links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HardwareProfile {
    pub name: &'static str,
    /// T0 capacity, bytes.
    pub hbm_bytes: u64,
    /// T0 bandwidth, bytes/s.
    pub hbm_bw: f64,
    /// T1 (host DRAM or the far memory) capacity, bytes.
    pub host_bytes: u64,
    /// T1 → T0 link bandwidth, bytes/s (per direction).
    pub host_link_bw: f64,
    /// T1 → T0 access latency, seconds.
    pub host_link_latency: f64,
    /// T2 (SSD) capacity, bytes.
    pub disk_bytes: u64,
    /// T2 → T1 bandwidth, bytes/s.
    pub disk_bw: f64,
    /// T2 access latency, seconds.
    pub disk_latency: f64,
    /// Dense FP16 throughput, FLOP/s.
    pub fp16_flops: f64,
    /// Concurrent DMA streams that share a link fairly (TierKV App. A: `n_lanes = 4`).
    pub dma_lanes: usize,
}

const GB: f64 = 1e9;

impl HardwareProfile {
    /// H100 with PCIe Gen5 x16, host DRAM and an NVMe SSD: TierKV Table 3 ("Simulated hardware
    /// configuration": HBM 80 GB, 3350 GB/s, <1 µs; DRAM 512 GB, 64 GB/s, 1 µs; SSD 4 TB,
    /// 7 GB/s, 10 µs) and Table 2 (H100 FP16 990 TFLOPS in the simulator), `n_lanes = 4`
    /// (Appendix A).
    pub fn h100_pcie5() -> Self {
        HardwareProfile {
            name: "H100 PCIe Gen5 (TierKV Table 3)",
            hbm_bytes: 80_000_000_000,
            hbm_bw: 3350.0 * GB,
            host_bytes: 512_000_000_000,
            host_link_bw: 64.0 * GB,
            host_link_latency: 1e-6,
            disk_bytes: 4_000_000_000_000,
            disk_bw: 7.0 * GB,
            disk_latency: 10e-6,
            fp16_flops: 990e12,
            dma_lanes: 4,
        }
    }

    /// GH200 Grace Hopper: Pie §5.1 ("480GB of LPDDR5X DRAM on the CPU and 96GB of HBM3 on the
    /// GPU, interconnected via 900GB/s NVLink"). 900 GB/s is the bidirectional NVLink-C2C figure;
    /// we model 450 GB/s per direction. HBM3 bandwidth 4000 GB/s and 990 TFLOPS FP16 are NVIDIA
    /// datasheet figures (not in the seeds).
    pub fn gh200_c2c() -> Self {
        HardwareProfile {
            name: "GH200 NVLink-C2C (Pie §5.1)",
            hbm_bytes: 96_000_000_000,
            hbm_bw: 4000.0 * GB,
            host_bytes: 480_000_000_000,
            host_link_bw: 450.0 * GB,
            host_link_latency: 1e-6,
            disk_bytes: 4_000_000_000_000,
            disk_bw: 7.0 * GB,
            disk_latency: 10e-6,
            fp16_flops: 990e12,
            dma_lanes: 4,
        }
    }

    /// Two H100 SXM over NVLink 4: the far tier is the peer GPU's HBM (80 GB). 450 GB/s per
    /// direction (900 GB/s bidirectional) is the NVIDIA datasheet figure (not in the seeds).
    pub fn h100x2_nvlink() -> Self {
        HardwareProfile {
            name: "2x H100 NVLink (peer HBM as T1)",
            hbm_bytes: 80_000_000_000,
            hbm_bw: 3350.0 * GB,
            host_bytes: 80_000_000_000,
            host_link_bw: 450.0 * GB,
            host_link_latency: 1e-6,
            disk_bytes: 4_000_000_000_000,
            disk_bw: 7.0 * GB,
            disk_latency: 10e-6,
            fp16_flops: 990e12,
            dma_lanes: 4,
        }
    }

    /// A100 40 GB with PCIe 4.0 x16: KVPR Figure 1 / §4 ("A100 GPU with 40 GB of memory ...
    /// PCIe 4.0 x16 ... 32 GB/s"; CPU DRAM 512 GB; FP16 312 TFLOPS). HBM2 1555 GB/s is the
    /// NVIDIA datasheet figure (not in the seed).
    pub fn a100_pcie4() -> Self {
        HardwareProfile {
            name: "A100 PCIe Gen4 (KVPR Fig. 1)",
            hbm_bytes: 40_000_000_000,
            hbm_bw: 1555.0 * GB,
            host_bytes: 512_000_000_000,
            host_link_bw: 32.0 * GB,
            host_link_latency: 0.0,
            disk_bytes: 4_000_000_000_000,
            disk_bw: 7.0 * GB,
            disk_latency: 10e-6,
            fp16_flops: 312e12,
            dma_lanes: 4,
        }
    }

    /// All profiles, for `--hw` lookup.
    pub fn all() -> [HardwareProfile; 4] {
        [
            Self::h100_pcie5(),
            Self::gh200_c2c(),
            Self::h100x2_nvlink(),
            Self::a100_pcie4(),
        ]
    }

    /// Short key for the CLI.
    pub fn by_key(key: &str) -> Option<Self> {
        match key {
            "h100" | "h100-pcie5" => Some(Self::h100_pcie5()),
            "gh200" | "gh200-c2c" => Some(Self::gh200_c2c()),
            "h100x2" | "h100x2-nvlink" => Some(Self::h100x2_nvlink()),
            "a100" | "a100-pcie4" => Some(Self::a100_pcie4()),
            _ => None,
        }
    }
}

/// A model's serving dimensions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelProfile {
    pub name: &'static str,
    /// KV bytes per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Weight bytes resident in HBM.
    pub weight_bytes: u64,
    /// Per-iteration decode compute time at the profiled batch, seconds.
    pub t_iter: f64,
}

impl ModelProfile {
    /// Llama-2-7B (TierKV §4.1: 32 heads, 128 dim, 32 layers, FP16):
    /// 2 (K,V) × 32 layers × 32 × 128 × 2 B = 512 KiB per token. 6.74 B parameters × 2 B of
    /// weights. `T_iter` = 4.0 ms "for 7B ... at batch size 32" (TierKV App. A).
    pub fn llama2_7b() -> Self {
        ModelProfile {
            name: "Llama-2-7B",
            kv_bytes_per_token: 2 * 32 * 32 * 128 * 2,
            weight_bytes: 13_480_000_000,
            t_iter: 4.0e-3,
        }
    }

    /// Llama-2-13B: 40 layers, 40 heads, 128 dim; T_iter scaled from 7B by weight bytes
    /// (decode is weight-bandwidth bound; TierKV gives no 13B figure).
    pub fn llama2_13b() -> Self {
        ModelProfile {
            name: "Llama-2-13B",
            kv_bytes_per_token: 2 * 40 * 40 * 128 * 2,
            weight_bytes: 26_030_000_000,
            t_iter: 4.0e-3 * 26.03 / 13.48,
        }
    }

    /// 30B (60 layers, 52 heads, 128 dim, LLaMA-30B shape): T_iter = 17.6 ms (TierKV App. A).
    pub fn llama_30b() -> Self {
        ModelProfile {
            name: "LLaMA-30B",
            kv_bytes_per_token: 2 * 60 * 52 * 128 * 2,
            weight_bytes: 65_000_000_000,
            t_iter: 17.6e-3,
        }
    }

    pub fn by_key(key: &str) -> Option<Self> {
        match key {
            "7b" => Some(Self::llama2_7b()),
            "13b" => Some(Self::llama2_13b()),
            "30b" => Some(Self::llama_30b()),
            _ => None,
        }
    }
}
