//! RMM-style random-allocation benchmark: a fixed-seed random sequence of allocations and frees
//! of mixed sizes under a live-memory cap, on the caching allocator. Reports peak reserved ÷ peak
//! allocated (the fragmentation overhead) and time per operation, for three size mixes.
//!
//! Run: `cargo bench --bench random_allocations` (options: `-- --ops N --seed S`; `--quick`:
//! 5000 operations).

use std::sync::Arc;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata::allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata::vmm::{self, Location, StreamHandle};

const S: StreamHandle = StreamHandle::DEFAULT;

struct Mix {
    name: &'static str,
    /// Inclusive size range in bytes.
    min: u64,
    max: u64,
    /// Log-uniform (many small sizes) instead of uniform (RMM's distribution).
    log: bool,
}

fn main() {
    let mut ops = 20_000usize;
    let mut seed = 2026u64;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ops" => ops = args.next().and_then(|v| v.parse().ok()).expect("--ops N"),
            "--seed" => seed = args.next().and_then(|v| v.parse().ok()).expect("--seed S"),
            "--quick" => ops = 5000, // .ci/gpu-run --quick
            _ => {}                  // cargo bench passes --bench
        }
    }
    let backend = vmm::from_env().expect("backend");
    let page = backend
        .granularity(Location::Device(0))
        .expect("granularity");
    let capacity = backend.mem_info(0).expect("mem info").total;
    let cap = capacity / 2;
    let mixes = [
        Mix {
            name: "above one page, uniform (1–32 pages)",
            min: page + 1,
            max: 32 * page,
            log: false,
        },
        Mix {
            name: "above one page, log-uniform (1–32 pages)",
            min: page + 1,
            max: 32 * page,
            log: true,
        },
        Mix {
            name: "mixed, log-uniform (256 B – 64 MiB)",
            min: 256,
            max: 64 << 20,
            log: true,
        },
        Mix {
            name: "small, log-uniform (256 B – 1 MiB)",
            min: 256,
            max: 1 << 20,
            log: true,
        },
    ];
    println!(
        "backend {}, page {} KiB, live cap {} MiB, {ops} operations, seed {seed}\n",
        backend.kind(),
        page >> 10,
        cap >> 20
    );
    println!("| size mix | peak allocated | peak block-rounded | peak reserved | reserved ÷ allocated | ns per op |");
    println!("|---|---|---|---|---|---|");
    for mix in &mixes {
        let pool = PagePool::new(Arc::clone(&backend), 0, PoolConfig::default()).expect("pool");
        let alloc = CachingAllocator::new(pool, CachingConfig::default()).expect("allocator");
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut live_bytes = 0u64;
        let start = Instant::now();
        for _ in 0..ops {
            let size = if mix.log {
                log_uniform(&mut rng, mix.min, mix.max)
            } else {
                rng.random_range(mix.min..=mix.max)
            };
            if live.is_empty() || (rng.random_bool(0.5) && live_bytes + size <= cap) {
                match alloc.allocate(size, S) {
                    Ok(p) => {
                        live.push((p, size));
                        live_bytes += size;
                    }
                    Err(e) if e.is_out_of_memory() => {}
                    Err(e) => panic!("allocate: {e}"),
                }
            } else {
                let (p, size) = live.swap_remove(rng.random_range(0..live.len()));
                alloc.deallocate(p, S).expect("deallocate");
                live_bytes -= size;
            }
        }
        let elapsed = start.elapsed();
        let stats = alloc.stats();
        for (p, _) in live {
            alloc.deallocate(p, S).expect("deallocate");
        }
        println!(
            "| {} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.3} | {:.0} |",
            mix.name,
            stats.peak_allocated_bytes as f64 / (1 << 20) as f64,
            stats.peak_allocated_block_bytes as f64 / (1 << 20) as f64,
            stats.peak_reserved_bytes as f64 / (1 << 20) as f64,
            stats.peak_reserved_bytes as f64 / stats.peak_allocated_bytes as f64,
            elapsed.as_nanos() as f64 / ops as f64,
        );
    }
}

fn log_uniform(rng: &mut SmallRng, min: u64, max: u64) -> u64 {
    let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
    (rng.random_range(lo..=hi).exp() as u64).clamp(min, max)
}
