//! Run-once driver of the cached allocate + free pair, for counting instructions per pair with
//! callgrind (criterion's loop runs a varying number of iterations, so its counts do not divide
//! out). Runs one warm-up pair (which maps), then `PAIRS` pairs of `SIZE` bytes on the default
//! stream, all served from the cache. Instructions per pair = the difference of two runs'
//! totals divided by the difference of their `PAIRS`:
//!
//! ```text
//! cargo build --release -p strata-allocator --example cached_pair
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/cached_pair 256 100000
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/cached_pair 256 1100000
//! ```
//!
//! (`benches/callgrind_pairs.sh` does this for several sizes and prints the figures.)
//! Host backend unless `STRATA_BACKEND` says otherwise; the pool runs no background thread, so
//! the count does not depend on timing. It also prints the wall-clock time per pair of the
//! loop (`benches/pair_rounds.sh` alternates builds and keeps each one's best).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use strata_allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata_vmm::StreamHandle;

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: cached_pair SIZE PAIRS";
    let size: u64 = args.next().and_then(|a| a.parse().ok()).expect(usage);
    let pairs: u64 = args.next().and_then(|a| a.parse().ok()).expect(usage);
    let backend = strata_vmm::from_env().expect("backend");
    let config = PoolConfig {
        background: false,
        idle_trim_after: None,
        ..PoolConfig::default()
    };
    let pool = PagePool::new(Arc::clone(&backend), 0, config).expect("pool");
    let caching = CachingAllocator::new(pool, CachingConfig::default()).expect("allocator");
    let s = StreamHandle::DEFAULT;
    let p = caching.allocate(size, s).expect("warm-up allocate");
    caching.deallocate(p, s).expect("warm-up free");
    let start = Instant::now();
    for _ in 0..pairs {
        let p = caching.allocate(black_box(size), s).expect("allocate");
        caching.deallocate(black_box(p), s).expect("deallocate");
    }
    let ns = start.elapsed().as_nanos() as f64 / pairs.max(1) as f64;
    println!("{size} B: {ns:.2} ns per pair");
}
