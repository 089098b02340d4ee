//! The fast path under threads: 1, 2 and 8 threads, each on a stream of its own, each looping
//! a cached 4 KiB `allocate` + `deallocate` pair on one shared `CachingAllocator`. The threads
//! live across criterion's rounds (started once per figure, told by barriers when to run), as
//! an engine's threads do, so a round times pairs, not thread starts and exits. Reported
//! per pair *in aggregate*: a round's time divided by all the pairs its threads made, so
//! perfect scaling on two cores halves the 1-thread figure and a lock convoy raises it (the
//! H200 run: 52 ns on one thread, 854 ns with 8).
//!
//! How a round is timed (so the figure is the crew's throughput, not the harness's):
//! - The workers claim the round's pairs in chunks of [`CHUNK`] from a shared counter (one
//!   atomic add per chunk) rather than an even share each: with even shares on this 2-vCPU VM
//!   one worker finished 3-6 ms of a ~50 ms round before the other (a wake-up, an interrupt,
//!   another process on its core), and its core idled meanwhile.
//! - The time is from the first worker's first pair to the last worker's last, each worker
//!   reading the clock itself, so the barriers' futex wake-ups around a round (0.1-0.7 ms
//!   here) are not timed.
//!
//! Each allocator figure is measured twice in one run: with the per-thread caches of small blocks
//! (`thread_cache: true`, the default) and with them off (`STRATA_THREAD_CACHE=0`), where every
//! pair takes the allocator's one lock.
//!
//! `own_locks/2_lock_pairs` is the machine's own ceiling under the same crew: per pair, two
//! lock/unlock pairs of the thread's own mutex (as a cached pair takes its cache's lock
//! twice), nothing shared between threads. Its 2-thread figure is half its 1-thread one when
//! both cores are free; a run where it is not was disturbed (other load, a busy host).
//!
//! Also a handoff: blocks allocated on one thread and freed on another (`4KiB_handoff`).
//!
//! On the CUDA backend, `cuda_malloc_async/4KiB_aggregate`: the same crew and pairs through the
//! driver's stream-ordered allocator (`cuMemAllocAsync`/`cuMemFreeAsync`, what PyTorch's
//! `cudaMallocAsync` backend calls; `vmm::MallocAsync`, a stream of its own per thread), the
//! baseline issue 30 compares the 8-thread figure with.
//!
//! Run: `cargo bench --bench threads` (STRATA_BACKEND=cuda on a GPU machine). On a shared
//! machine compare the lines of one run, not runs.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use strata::allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata::vmm::{self, DevicePtr, MallocAsync, StreamHandle};

const SIZE: u64 = 4 << 10;

/// Pairs a worker claims at a time from a round's total.
const CHUNK: u64 = 1024;

/// Long-lived threads that run rounds of pairs when told (engine threads live long: their
/// caches stay warm from round to round, as they would). Worker `i` runs `pairs(i, n)` for
/// each chunk of `n` pairs it claims.
struct Crew<F> {
    pairs: F,
    /// This round's pairs, and how many the workers have claimed so far.
    total: AtomicU64,
    claimed: AtomicU64,
    stop: AtomicBool,
    go: Barrier,
    done: Barrier,
    /// Each worker's first and last instant in the round (`None`: it claimed no chunk).
    spans: Mutex<Vec<Option<(Instant, Instant)>>>,
}

impl<F: Fn(usize, u64) + Sync> Crew<F> {
    fn new(threads: usize, pairs: F) -> Self {
        Crew {
            pairs,
            total: AtomicU64::new(0),
            claimed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            go: Barrier::new(threads + 1),
            done: Barrier::new(threads + 1),
            spans: Mutex::new(Vec::with_capacity(threads)),
        }
    }

    /// Worker `i`'s loop: each round, chunks of [`CHUNK`] pairs until the round's are all
    /// claimed, so a worker that runs slower (or starts later: a wake-up, another process on
    /// its core) does fewer, and no core idles while another finishes an even share.
    fn work(&self, i: usize) {
        loop {
            self.go.wait();
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let total = self.total.load(Ordering::Acquire);
            let mut span: Option<(Instant, Instant)> = None;
            loop {
                let from = self.claimed.fetch_add(CHUNK, Ordering::Relaxed);
                if from >= total {
                    break;
                }
                let start = span.map_or_else(Instant::now, |(start, _)| start);
                (self.pairs)(i, CHUNK.min(total - from));
                span = Some((start, Instant::now()));
            }
            self.spans.lock().expect("spans").push(span);
            self.done.wait();
        }
    }

    /// Time for `pairs` pairs over the crew: from the first worker's first pair to the last
    /// worker's last (the barriers' wake-ups before and after are not timed).
    fn round(&self, pairs: u64) -> Duration {
        self.total.store(pairs, Ordering::Release);
        self.claimed.store(0, Ordering::Relaxed);
        self.go.wait();
        self.done.wait();
        let spans = std::mem::take(&mut *self.spans.lock().expect("spans"));
        let spans = spans.iter().flatten();
        let first = spans.clone().map(|s| s.0).min();
        let last = spans.map(|s| s.1).max();
        first
            .zip(last)
            .map_or(Duration::ZERO, |(first, last)| last - first)
    }

    fn dismiss(&self) {
        self.stop.store(true, Ordering::Release);
        self.go.wait();
    }
}

/// `name`'s figures for 1, 2 and 8 threads, each a [`Crew`] doing `pairs`.
fn crew_figures(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    pairs: &(dyn Fn(usize, u64) + Sync),
) {
    for threads in [1usize, 2, 8] {
        let crew = Crew::new(threads, pairs);
        std::thread::scope(|scope| {
            for i in 0..threads {
                let crew = &crew;
                scope.spawn(move || crew.work(i));
            }
            group.bench_function(BenchmarkId::new(name, threads), |b| {
                b.iter_custom(|pairs| crew.round(pairs))
            });
            crew.dismiss();
        });
    }
}

/// A thread's own mutex for `own_locks` (aligned so that no two share a cache line).
#[repr(align(128))]
#[derive(Default)]
struct OwnLock(Mutex<u64>);

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
        crew_figures(&mut group, "4KiB_aggregate", &|i, n| {
            let s = streams[i];
            for _ in 0..n {
                let p = caching.allocate(black_box(SIZE), s).expect("allocate");
                caching.deallocate(black_box(p), s).expect("deallocate");
            }
        });
        // Threads started per round here: a round is many batches, so their start is noise.
        group.bench_function("4KiB_handoff", |b| {
            b.iter_custom(|pairs| handoff(&caching, streams[0], pairs))
        });
        group.finish();
    }
    for s in streams {
        backend.stream_destroy(s).expect("stream");
    }
    cuda_malloc_async(c, &backend);
    let locks: Vec<OwnLock> = (0..8).map(|_| OwnLock::default()).collect();
    let mut group = c.benchmark_group("pair_per_thread/own_locks");
    group.measurement_time(Duration::from_secs(3));
    crew_figures(&mut group, "2_lock_pairs", &|i, n| {
        let lock = &locks[i].0;
        for _ in 0..n {
            *black_box(lock).lock().expect("lock") += 1;
            *black_box(lock).lock().expect("lock") -= 1;
        }
    });
    group.finish();
}

/// The crew's pairs through `cudaMallocAsync`'s driver calls, on the CUDA backend only.
fn cuda_malloc_async(c: &mut Criterion, backend: &Arc<dyn vmm::Backend>) {
    let pools: Vec<Mutex<MallocAsync>> = match (0..8)
        .map(|_| MallocAsync::new(backend, 0).map(Mutex::new))
        .collect()
    {
        Ok(pools) => pools,
        Err(vmm::Error::Unsupported(_)) => return,
        Err(e) => panic!("cudaMallocAsync: {e}"),
    };
    let mut group = c.benchmark_group("pair_per_thread/cuda_malloc_async");
    group.measurement_time(Duration::from_secs(3));
    crew_figures(&mut group, "4KiB_aggregate", &|i, n| {
        // Locked once per chunk, by worker `i` only: uncontended.
        let mut pool = pools[i].lock().expect("pool");
        for _ in 0..n {
            let p = pool.allocate(black_box(SIZE)).expect("cuMemAllocAsync");
            pool.free(black_box(p)).expect("cuMemFreeAsync");
        }
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
