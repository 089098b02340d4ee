//! `strata bench copy`: scattered blocks moved between host memory and HBM, one copy per block
//! (naive) vs coalesced into one batch vs the block-copy kernel (its CPU twin on the host
//! backend), through the tiers' transfer engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use strata_tiers::{Direction, Submission, TransferEngine};
use strata_vmm::{
    Access, Backend, CopyScope, CreateFlags, DevicePtr, HostBuffer, Location, Mapping,
    PhysicalMemory, Reservation, Result,
};

/// One measured configuration.
#[derive(Clone, Debug)]
pub struct CopyResult {
    pub block: u64,
    pub blocks: u64,
    pub direction: Direction,
    pub method: Submission,
    /// Median time to move all blocks once.
    pub time: Duration,
    pub descriptors: u64,
}

impl CopyResult {
    pub fn gbps(&self) -> f64 {
        (self.block * self.blocks) as f64 / self.time.as_secs_f64() / 1e9
    }
}

/// Runs the benchmark: `bytes` per round in blocks of each size, runs of `run` adjacent blocks
/// placed at shuffled positions on the other side (seed fixed), `reps` rounds (median kept).
pub fn copy(
    backend: &Arc<dyn Backend>,
    device: u32,
    sizes: &[u64],
    bytes: u64,
    run: u64,
    reps: usize,
) -> Result<Vec<CopyResult>> {
    let g = backend.granularity(Location::Device(device))?;
    let span = bytes.div_ceil(g) * g;
    let res = Arc::new(Reservation::new(backend, span, 0)?);
    let phys = Arc::new(PhysicalMemory::create(
        backend,
        Location::Device(device),
        span,
        CreateFlags::empty(),
    )?);
    let _map = Mapping::new(
        &res,
        res.ptr(),
        phys,
        0,
        span,
        &[(Location::Device(device), Access::ReadWrite)],
    )?;
    let host = HostBuffer::new(backend, span)?;
    let engine = TransferEngine::new(backend, device)?;
    let mut out = Vec::new();
    for &block in sizes {
        let blocks = bytes / block;
        let runs = blocks.div_ceil(run);
        let mut order: Vec<u64> = (0..runs).collect();
        order.shuffle(&mut SmallRng::seed_from_u64(2026));
        // Block i of run r sits at device slot r*run+i and host slot order[r]*run+i.
        let mut h2d: Vec<(DevicePtr, DevicePtr)> = Vec::with_capacity(blocks as usize);
        for r in 0..runs {
            for i in 0..run.min(blocks - r * run) {
                let d = res.ptr() + (r * run + i) * block;
                let h = host.ptr() + (order[r as usize] * run + i) * block;
                h2d.push((h, d));
            }
        }
        let d2h: Vec<_> = h2d.iter().map(|&(h, d)| (d, h)).collect();
        for (direction, pairs) in [
            (Direction::HostToDevice, &h2d),
            (Direction::DeviceToHost, &d2h),
        ] {
            for method in [Submission::Naive, Submission::Coalesced, Submission::Kernel] {
                let mut times = Vec::with_capacity(reps);
                let before = engine.stats().descriptors;
                for _ in 0..reps {
                    let t = Instant::now();
                    let scope = CopyScope {
                        buffers: &[&host],
                        reservations: &[&res],
                    };
                    let ev = engine.submit(direction, pairs, block, method, scope)?;
                    ev.synchronize()?;
                    times.push(t.elapsed());
                }
                engine.synchronize()?;
                times.sort_unstable();
                out.push(CopyResult {
                    block,
                    blocks,
                    direction,
                    method,
                    time: times[times.len() / 2],
                    descriptors: (engine.stats().descriptors - before) / reps as u64,
                });
            }
        }
    }
    Ok(out)
}
