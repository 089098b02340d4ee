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
//! loop (`benches/pair_rounds.sh` alternates builds and keeps each one's best). With
//! `PAIR_THREADS=N` (N > 1) the pairs are split among N threads, each on a stream of its own
//! (and its own warm-up pair), and the figure is the aggregate: wall time over all pairs.
//! `STRATA_THREAD_CACHE=0` turns the per-thread caches off for comparison (on by default).

use std::hint::black_box;
use std::sync::{Arc, Barrier};
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
    let threads: u64 = std::env::var("PAIR_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    if threads <= 1 {
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
        return;
    }
    // Threads, each on a stream of its own, `pairs` split among them: the wall time over all
    // pairs (aggregate ns per pair; perfect scaling on two cores halves one thread's).
    let streams: Vec<StreamHandle> = (0..threads)
        .map(|_| backend.stream_create(0).expect("stream"))
        .collect();
    let per_thread = pairs / threads;
    let start = Barrier::new(threads as usize + 1);
    let elapsed = std::thread::scope(|scope| {
        for &s in &streams {
            let (caching, start) = (&caching, &start);
            scope.spawn(move || {
                let p = caching.allocate(size, s).expect("warm-up allocate");
                caching.deallocate(p, s).expect("warm-up free");
                start.wait();
                for _ in 0..per_thread {
                    let p = caching.allocate(black_box(size), s).expect("allocate");
                    caching.deallocate(black_box(p), s).expect("deallocate");
                }
            });
        }
        start.wait();
        Instant::now()
    })
    .elapsed();
    let ns = elapsed.as_nanos() as f64 / (per_thread * threads).max(1) as f64;
    println!("{size} B x {threads} threads: {ns:.2} ns per pair");
}
