//! Replays the committed allocation traces (`benches/traces/`, recorded from a random-initialised
//! Llama on the CPU with `python -m strata.trace record`) through a fresh `CachingAllocator`
//! each: peak allocated, peak reserved, their ratio and the time per operation. At the peak of
//! reserved, where the pages were: large segments (and the free room inside them), cached runs,
//! small pages.
//!
//! Run: `cargo bench --bench replay` (options: `-- FILE...` to replay other traces, `--ops N`
//! for the first N operations of each).

use std::sync::Arc;

use strata::allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata::replay::{replay, BenchArgs, Trace};
use strata::vmm::{self, StreamHandle};

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() {
    let args = BenchArgs::parse(std::env::args().skip(1)).unwrap_or_else(|e| panic!("{e}"));
    let files = args.files_or_standard(std::path::Path::new(env!("CARGO_MANIFEST_DIR")));
    let backend = vmm::from_env().expect("backend");
    let fresh = || {
        let pool = PagePool::new(Arc::clone(&backend), 0, PoolConfig::default()).expect("pool");
        CachingAllocator::new(pool, CachingConfig::default()).expect("allocator")
    };
    println!("backend {}\n", backend.kind());
    println!("| trace | ops | peak allocated | peak reserved | reserved ÷ allocated | ns per op | at the peak: large segments (free inside) / cached / small |");
    println!("|---|---|---|---|---|---|---|");
    for file in &files {
        let trace = args.cut(
            Trace::load(file, None).unwrap_or_else(|e| panic!("trace {}: {e}", file.display())),
        );
        let timed = replay(&fresh(), &trace, StreamHandle::DEFAULT, None).expect("replay");
        // Again, stopping where reserved first reaches its peak, to see where the pages are.
        let alloc = fresh();
        let sampled = replay(&alloc, &trace, StreamHandle::DEFAULT, Some(1)).expect("replay");
        let at = sampled
            .samples
            .iter()
            .find(|s| s.reserved == sampled.peak_reserved)
            .map_or(0, |s| s.op as usize);
        let prefix = Trace {
            ops: trace.ops[..at].to_vec(),
            ..trace.clone()
        };
        let alloc = fresh();
        let (mut live, mut ptrs) = (std::collections::HashMap::new(), Vec::new());
        for op in &prefix.ops {
            match *op {
                strata::replay::Op::Alloc { id, bytes, .. } => {
                    let p = alloc.allocate(bytes, StreamHandle::DEFAULT).expect("alloc");
                    live.insert(id, p);
                }
                strata::replay::Op::Free { id } => {
                    if let Some(p) = live.remove(&id) {
                        alloc.deallocate(p, StreamHandle::DEFAULT).expect("free");
                    }
                }
            }
        }
        let s = alloc.stats();
        ptrs.extend(live.into_values());
        for p in ptrs {
            alloc.deallocate(p, StreamHandle::DEFAULT).expect("free");
        }
        let small = s.reserved_bytes - s.large_segment_bytes - s.cached_large_bytes;
        println!(
            "| {} | {} | {:.1} MiB | {:.1} MiB | {:.3} | {:.0} | {:.1} ({:.1}) / {:.1} / {:.1} MiB |",
            file.file_name().unwrap_or_default().to_string_lossy(),
            timed.ops,
            mib(timed.peak_allocated),
            mib(timed.peak_reserved),
            timed.ratio(),
            timed.ns_per_op(),
            mib(s.large_segment_bytes),
            mib(s.large_free_bytes),
            mib(s.cached_large_bytes),
            mib(small),
        );
    }
}
