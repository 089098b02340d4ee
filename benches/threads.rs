//! The fast path under threads: 1, 2 and 8 threads, each on a stream of its own, each looping
//! a cached 4 KiB `allocate` + `deallocate` pair on one shared `CachingAllocator`. The threads
//! live across criterion's rounds (started once per figure, told by barriers when to run), as
//! an engine's threads do, so a round times pairs, not thread starts and exits. Reported
//! per pair *in aggregate*: the wall time of a round divided by the pairs all threads made in
//! it, so perfect scaling on two cores halves the 1-thread figure and a lock convoy raises it
//! (the H200 run: 52 ns on one thread, 854 ns with 8).
//!
//! Each figure is measured twice in one run: with the per-thread caches of small blocks
//! (`thread_cache: true`, the default) and with them off (`STRATA_THREAD_CACHE=0`), where every
//! pair takes the allocator's one lock.
//!
//! Also a handoff: blocks allocated on one thread and freed on another (`4KiB_handoff`).
//!
//! Run: `cargo bench --bench threads` (STRATA_BACKEND=cuda on a GPU machine). On a shared
//! machine compare the lines of one run, not runs.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use strata::allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata::vmm::{self, DevicePtr, StreamHandle};

const SIZE: u64 = 4 << 10;

/// Long-lived threads, one per stream, that run rounds of pairs when told (engine threads live
/// long: their caches stay warm from round to round, as they would).
struct Crew<'a> {
    caching: &'a CachingAllocator,
    per_thread: AtomicU64,
    stop: AtomicBool,
    go: Barrier,
    done: Barrier,
}

impl<'a> Crew<'a> {
    fn new(caching: &'a CachingAllocator, threads: usize) -> Self {
        Crew {
            caching,
            per_thread: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            go: Barrier::new(threads + 1),
            done: Barrier::new(threads + 1),
        }
    }

    /// One thread's loop on stream `s`.
    fn work(&self, s: StreamHandle) {
        loop {
            self.go.wait();
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            for _ in 0..self.per_thread.load(Ordering::Acquire) {
                let p = self.caching.allocate(black_box(SIZE), s).expect("allocate");
                self.caching
                    .deallocate(black_box(p), s)
                    .expect("deallocate");
            }
            self.done.wait();
        }
    }

    /// Wall time for `pairs` pairs split evenly over the crew.
    fn round(&self, threads: usize, pairs: u64) -> Duration {
        self.per_thread
            .store(pairs.div_ceil(threads as u64), Ordering::Release);
        let start = Instant::now();
        self.go.wait();
        self.done.wait();
        start.elapsed()
    }

    fn dismiss(&self) {
        self.stop.store(true, Ordering::Release);
        self.go.wait();
    }
}

/// Blocks per batch in [`handoff`].
const HANDOFF_BATCH: usize = 64;

/// Wall time for `pairs` blocks allocated on this thread and freed on another, in batches of
/// [`HANDOFF_BATCH`] sent through a channel, both on `stream`: a pipeline whose consumer frees
/// what its producer allocated (an autograd thread, a detokenizer). With thread caches every
/// such free takes the shared path and reclaims the block from the producer's cache.
fn handoff(caching: &CachingAllocator, stream: StreamHandle, pairs: u64) -> Duration {
    let batches = pairs.div_ceil(HANDOFF_BATCH as u64);
    let (to_consumer, batches_in) = sync_channel::<Vec<DevicePtr>>(2);
    let start = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for batch in batches_in {
                for p in batch {
                    caching.deallocate(p, stream).expect("deallocate");
                }
            }
        });
        for _ in 0..batches {
            let batch = (0..HANDOFF_BATCH)
                .map(|_| caching.allocate(black_box(SIZE), stream).expect("allocate"))
                .collect();
            to_consumer.send(batch).expect("send");
        }
        drop(to_consumer);
    });
    start.elapsed()
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
            let crew = Crew::new(&caching, threads);
            std::thread::scope(|scope| {
                for &s in &streams[..threads] {
                    let crew = &crew;
                    scope.spawn(move || crew.work(s));
                }
                group.bench_function(BenchmarkId::new("4KiB_aggregate", threads), |b| {
                    b.iter_custom(|pairs| crew.round(threads, pairs))
                });
                crew.dismiss();
            });
        }
        // Threads started per round here: a round is many batches, so their start is noise.
        group.bench_function("4KiB_handoff", |b| {
            b.iter_custom(|pairs| handoff(&caching, streams[0], pairs))
        });
        group.finish();
    }
    for s in streams {
        backend.stream_destroy(s).expect("stream");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
