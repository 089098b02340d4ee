//! The fast path under threads: 1, 2 and 8 threads, each on a stream of its own, each looping
//! a cached 4 KiB `allocate` + `deallocate` pair on one shared `CachingAllocator`. Reported
//! per pair *in aggregate*: the wall time of a round divided by the pairs all threads made in
//! it, so perfect scaling on two cores halves the 1-thread figure and a lock convoy raises it
//! (the H200 run: 52 ns on one thread, 854 ns with 8).
//!
//! Each figure is measured twice in one run: with the per-thread caches of small blocks
//! (`thread_cache: true`, the default) and with them off (`STRATA_THREAD_CACHE=0`), where every
//! pair takes the allocator's one lock.
//!
//! Run: `cargo bench --bench threads` (STRATA_BACKEND=cuda on a GPU machine). On a shared
//! machine compare the lines of one run, not runs.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use strata::allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata::vmm::{self, StreamHandle};

const SIZE: u64 = 4 << 10;

/// Wall time for `pairs` pairs split evenly over one thread per stream in `streams`.
fn round(caching: &CachingAllocator, streams: &[StreamHandle], pairs: u64) -> Duration {
    let per_thread = pairs.div_ceil(streams.len() as u64);
    let start = Barrier::new(streams.len() + 1);
    std::thread::scope(|scope| {
        for &s in streams {
            let start = &start;
            scope.spawn(move || {
                start.wait();
                for _ in 0..per_thread {
                    let p = caching.allocate(black_box(SIZE), s).expect("allocate");
                    caching.deallocate(black_box(p), s).expect("deallocate");
                }
            });
        }
        start.wait();
        // The scope returns once every thread is joined: the time covers all their pairs.
        Instant::now()
    })
    .elapsed()
}

fn bench(c: &mut Criterion) {
    let backend = vmm::from_env().expect("backend");
    let streams: Vec<StreamHandle> = (0..8)
        .map(|_| backend.stream_create(0).expect("stream"))
        .collect();
    // Per-thread caches on (the default) and off (STRATA_THREAD_CACHE=0), side by side.
    for cached in [true, false] {
        let pool = PagePool::new(Arc::clone(&backend), 0, PoolConfig::default()).expect("pool");
        let config = CachingConfig {
            thread_cache: cached,
            ..CachingConfig::default()
        };
        let caching = CachingAllocator::new(pool, config).expect("allocator");
        // Warm: each stream's first pair carves its block; every measured pair is a cache hit.
        for &s in &streams {
            let p = caching.allocate(SIZE, s).expect("warm");
            caching.deallocate(p, s).expect("warm");
        }
        let mode = if cached {
            "thread_cache"
        } else {
            "shared_bins"
        };
        let mut group = c.benchmark_group(format!("pair_per_thread/{}/{mode}", backend.kind()));
        group.measurement_time(Duration::from_secs(3));
        for threads in [1usize, 2, 8] {
            group.bench_function(BenchmarkId::new("4KiB_aggregate", threads), |b| {
                b.iter_custom(|pairs| round(&caching, &streams[..threads], pairs))
            });
        }
        group.finish();
    }
    for s in streams {
        backend.stream_destroy(s).expect("stream");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
