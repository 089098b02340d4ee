//! The caching allocator under threads: one random walk per thread (its own stream, its own
//! tag and the untagged one, fill patterns written on allocate and checked on free) against a
//! per-thread model, with an invariant checker running alongside. At each round's barrier the
//! stats must equal the sum of the models exactly (bytes, live blocks, counts, per tag), and
//! the main thread flushes what it can while the walkers hold blocks: `empty_cache`, a sleep
//! and wake of a tag, an offload and onload of a tag. These are the guards any per-thread
//! caching in front of the shared bins must keep green.

mod common;

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_allocator::{AllocatorStats, TagId};
use strata_vmm::StreamHandle;

const THREADS: u64 = 4;
const ROUNDS: usize = 4;
const STEPS: usize = 100;
/// Tags the walkers use besides the untagged one: thread `t` uses tag `1 + t % 2`.
const TAGS: [TagId; 3] = [0, 1, 2];

/// What one walker has done and holds, per tag (indexed like [`TAGS`]).
#[derive(Clone, Copy, Default)]
struct Model {
    allocs: [u64; 3],
    frees: [u64; 3],
    live: [u64; 3],
    live_bytes: [u64; 3],
    /// Its largest live bytes, per tag and over all tags: the allocator's peaks can never
    /// exceed the sum of the walkers' peaks.
    peak_bytes: [u64; 3],
    peak_total: u64,
}

struct Live {
    ptr: u64,
    size: u64,
    seed: u64,
    tag: usize,
}

fn sum(models: &[Model], f: impl Fn(&Model) -> u64) -> u64 {
    models.iter().map(f).sum()
}

/// The stats at a barrier (every walker stopped) against the walkers' models.
fn exact(stats: &AllocatorStats, models: &[Model], when: &str) {
    let all = |f: fn(&Model) -> &[u64; 3]| sum(models, |m| f(m).iter().sum());
    let live_bytes = all(|m| &m.live_bytes);
    for (what, got, want) in [
        ("allocated", stats.allocated_bytes, live_bytes),
        ("live", stats.live_allocations, all(|m| &m.live)),
        ("allocs", stats.counts.allocs, all(|m| &m.allocs)),
        ("frees", stats.counts.frees, all(|m| &m.frees)),
    ] {
        assert_eq!(got, want, "{when}: {what}");
    }
    assert!(stats.peak_allocated_bytes >= live_bytes, "{when}: peak");
    assert!(
        stats.peak_allocated_bytes <= sum(models, |m| m.peak_total),
        "{when}: peak {} above any reachable total",
        stats.peak_allocated_bytes
    );
    for (i, &tag) in TAGS.iter().enumerate() {
        let Some(t) = stats.tag(tag) else {
            assert_eq!(sum(models, |m| m.allocs[i]), 0, "{when}: tag {tag} missing");
            continue;
        };
        for (what, got, want) in [
            (
                "allocated",
                t.allocated_bytes,
                sum(models, |m| m.live_bytes[i]),
            ),
            ("live", t.live_allocations, sum(models, |m| m.live[i])),
            ("allocs", t.allocs, sum(models, |m| m.allocs[i])),
            ("frees", t.frees, sum(models, |m| m.frees[i])),
        ] {
            assert_eq!(got, want, "{when}: tag {tag} {what}");
        }
        assert!(
            t.peak_allocated_bytes <= sum(models, |m| m.peak_bytes[i]),
            "{when}: tag {tag} peak"
        );
    }
}

/// Stats that must hold at any moment, walkers running or not.
fn coherent(stats: &AllocatorStats) {
    let tagged: u64 = stats.tags.iter().map(|t| t.allocated_bytes).sum();
    assert_eq!(tagged, stats.allocated_bytes, "tags' bytes add up");
    let live: u64 = stats.tags.iter().map(|t| t.live_allocations).sum();
    assert_eq!(live, stats.live_allocations, "tags' live blocks add up");
    assert!(stats.peak_allocated_bytes >= stats.allocated_bytes);
    assert!(stats.allocated_block_bytes >= stats.allocated_bytes);
}

struct Walker<'a> {
    e: &'a Env,
    stream: StreamHandle,
    own_tag: usize,
    rng: SmallRng,
    live: Vec<Live>,
    model: Model,
    next_seed: u64,
}

impl Walker<'_> {
    fn step(&mut self) {
        let has_large = self.live.iter().any(|l| l.size >= MIB);
        if self.live.len() < 12 && (self.live.is_empty() || self.rng.random_bool(0.55)) {
            let size = if !has_large && self.rng.random_bool(0.05) {
                self.rng.random_range(MIB..3 * MIB)
            } else {
                self.rng.random_range(1..64 << 10)
            };
            let tag = if self.rng.random_bool(0.5) {
                self.own_tag
            } else {
                0
            };
            match self.e.alloc.allocate_tagged(size, self.stream, TAGS[tag]) {
                Ok(ptr) => {
                    self.next_seed += 1;
                    fill(&self.e.backend, ptr, size, self.next_seed);
                    self.live.push(Live {
                        ptr,
                        size,
                        seed: self.next_seed,
                        tag,
                    });
                    let m = &mut self.model;
                    m.allocs[tag] += 1;
                    m.live[tag] += 1;
                    m.live_bytes[tag] += size;
                    m.peak_bytes[tag] = m.peak_bytes[tag].max(m.live_bytes[tag]);
                    m.peak_total = m.peak_total.max(m.live_bytes.iter().sum());
                }
                Err(e) => assert!(e.is_out_of_memory(), "allocate {size}: {e}"),
            }
        } else {
            let i = self.rng.random_range(0..self.live.len());
            self.free(i);
        }
    }

    /// Checks and frees live block `i`, now and then on the default stream instead of its own
    /// (a cross-stream free: pending until an event).
    fn free(&mut self, i: usize) {
        let l = self.live.swap_remove(i);
        check(&self.e.backend, l.ptr, l.size, l.seed, "free");
        let stream = if self.rng.random_bool(0.1) {
            S0
        } else {
            self.stream
        };
        self.e.alloc.deallocate(l.ptr, stream).expect("free");
        let m = &mut self.model;
        m.frees[l.tag] += 1;
        m.live[l.tag] -= 1;
        m.live_bytes[l.tag] -= l.size;
    }
}

/// What the main thread does at the barrier after round `round`, with every walker stopped
/// and holding its live blocks.
fn flush(e: &Env, round: usize, models: &[Model]) {
    match round {
        0 => {
            e.alloc.empty_cache().expect("empty_cache");
            exact(&e.alloc.stats(), models, "after empty_cache");
            // Every page held now holds a live or pending block.
            assert_eq!(e.alloc.stats().cached_large_bytes, 0);
        }
        1 => {
            e.alloc.sleep(1, true).expect("sleep");
            let stats = e.alloc.stats();
            assert!(stats.tag(1).is_some_and(|t| t.asleep));
            assert_eq!(stats.tag(1).unwrap().reserved_bytes, 0, "asleep: no pages");
            exact(&stats, models, "asleep");
            e.alloc.wake(1).expect("wake");
        }
        2 => {
            e.alloc.offload(2, &e.host, S0).expect("offload");
            exact(&e.alloc.stats(), models, "offloaded");
            e.alloc.onload(2, S0).expect("onload");
        }
        _ => {}
    }
    consistent(e, "after the flush");
    exact(&e.alloc.stats(), models, "after the flush");
}

/// The first panic of any thread, kept so that a failed check ends the test instead of leaving
/// the other threads waiting at a barrier.
type Failure = Mutex<Option<Box<dyn Any + Send>>>;

/// Runs `work` unless a thread failed already; a panic in it is recorded, not propagated.
fn guarded(failure: &Failure, work: &mut dyn FnMut()) {
    if failure.lock().unwrap().is_some() {
        return;
    }
    if let Err(panic) = catch_unwind(AssertUnwindSafe(work)) {
        failure.lock().unwrap().get_or_insert(panic);
    }
}

#[test]
fn random_walks_on_threads_keep_exact_stats_through_flushes() {
    let e = env();
    let streams: Vec<StreamHandle> = (0..THREADS)
        .map(|_| e.backend.stream_create(0).expect("stream"))
        .collect();
    let models = Mutex::new(vec![Model::default(); THREADS as usize]);
    let paused = Barrier::new(THREADS as usize + 1);
    let resumed = Barrier::new(THREADS as usize + 1);
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let failure = Mutex::new(None);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (e, models, paused, resumed, done, failure) =
                (&e, &models, &paused, &resumed, &done, &failure);
            let stream = streams[t as usize];
            scope.spawn(move || {
                let mut w = Walker {
                    e,
                    stream,
                    own_tag: 1 + (t % 2) as usize,
                    rng: SmallRng::seed_from_u64(t),
                    live: Vec::new(),
                    model: Model::default(),
                    next_seed: t << 32,
                };
                for _ in 0..ROUNDS {
                    guarded(failure, &mut || {
                        for _ in 0..STEPS {
                            w.step();
                        }
                    });
                    models.lock().unwrap()[t as usize] = w.model;
                    paused.wait();
                    resumed.wait();
                }
                guarded(failure, &mut || {
                    while !w.live.is_empty() {
                        w.free(w.live.len() - 1);
                    }
                });
                models.lock().unwrap()[t as usize] = w.model;
                done.fetch_add(1, Ordering::Release);
            });
        }
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Err(err) = e.alloc.check_invariants() {
                    panic!("invariant violated mid-walk: {err}\n{}", e.alloc.report());
                }
                coherent(&e.alloc.stats());
            }
        });
        for round in 0..ROUNDS {
            paused.wait();
            let snapshot = models.lock().unwrap().clone();
            guarded(&failure, &mut || {
                exact(&e.alloc.stats(), &snapshot, &format!("round {round}"));
                flush(&e, round, &snapshot);
            });
            resumed.wait();
        }
        // The checker runs until the walkers have freed everything.
        while done.load(Ordering::Acquire) < THREADS {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
    });
    if let Some(panic) = failure.into_inner().unwrap() {
        std::panic::resume_unwind(panic);
    }
    let models = models.into_inner().unwrap();
    let stats = e.alloc.stats();
    exact(&stats, &models, "all freed");
    assert_eq!(stats.allocated_bytes, 0);
    for s in &streams {
        e.backend.stream_synchronize(*s).expect("sync");
    }
    e.alloc.empty_cache().expect("empty_cache");
    let stats = e.alloc.stats();
    assert_eq!(stats.reserved_bytes, 0, "empty_cache returned every page");
    assert_eq!(e.device.stats().in_use, 0);
    consistent(&e, "end");
}
