//! The per-thread caches of small blocks (`caching/tcache/`): exact peaks when threads take
//! turns, frees, `size_of`, `tag_of` and `record_stream` from other threads, stream-ordered
//! reuse, `empty_cache` reclaiming other threads' cached blocks, a thread's exit returning its
//! cache, and a random walk with cross-thread frees, `record_stream` and a flush at each
//! barrier, its stats exact against a model. A thread whose check fails ends the test: the
//! others fail at the next barrier ([`Meet`]) or turn instead of waiting forever. Each runs
//! with the caches on and off (`CachingConfig::thread_cache`, `STRATA_THREAD_CACHE`): the
//! figures must not differ.

mod common;

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_allocator::{CachingConfig, TagId};
use strata_vmm::{Error, StreamHandle};

/// How long a thread waits for the others at a [`Meet`] or for its turn before the test fails:
/// far beyond any step here, so only a thread that failed (or a deadlock) reaches it.
const STUCK_AFTER: Duration = Duration::from_secs(60);

/// A barrier that fails the test instead of hanging it when a thread never arrives (its check
/// failed, so it panicked before the barrier).
struct Meet {
    n: usize,
    /// Threads arrived in this round, and the round.
    state: Mutex<(usize, u64)>,
    all_here: Condvar,
}

impl Meet {
    fn new(n: usize) -> Self {
        Meet {
            n,
            state: Mutex::new((0, 0)),
            all_here: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut g = self.state.lock().unwrap();
        let round = g.1;
        g.0 += 1;
        if g.0 == self.n {
            *g = (0, round + 1);
            self.all_here.notify_all();
            return;
        }
        let deadline = Instant::now() + STUCK_AFTER;
        while g.1 == round {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "a thread never reached the barrier (it failed?)"
            );
            g = self.all_here.wait_timeout(g, left).unwrap().0;
        }
    }
}

/// A thread's first panic, kept so that a failed check ends the test instead of leaving the
/// other threads waiting at a barrier.
type Failure = Mutex<Option<Box<dyn Any + Send>>>;

/// Runs `work` unless a thread failed already; a panic in it is recorded, not propagated.
fn guarded(failure: &Failure, work: impl FnOnce()) {
    if failure.lock().unwrap().is_some() {
        return;
    }
    if let Err(panic) = catch_unwind(AssertUnwindSafe(work)) {
        failure.lock().unwrap().get_or_insert(panic);
    }
}

fn rethrow(failure: Failure) {
    if let Some(panic) = failure.into_inner().unwrap() {
        std::panic::resume_unwind(panic);
    }
}

fn env_cache(on: bool) -> Env {
    env_with(CachingConfig {
        thread_cache: on,
        ..CachingConfig::default()
    })
}

/// Warms this thread's cache: pairs of each size on `stream`, so what follows is served by
/// cached blocks (with the caches on).
fn warm(e: &Env, stream: StreamHandle, sizes: &[(u64, TagId)]) {
    for _ in 0..3 {
        let ptrs: Vec<u64> = sizes
            .iter()
            .map(|&(s, t)| e.alloc.allocate_tagged(s, stream, t).expect("warm"))
            .collect();
        for p in ptrs {
            e.alloc.deallocate(p, stream).expect("warm");
        }
    }
}

/// One step of the turns script: thread, then allocate (size, tag) into a slot or free a slot.
#[derive(Clone, Copy)]
enum Op {
    Alloc(usize, u64, TagId),
    Free(usize),
}

#[test]
fn peaks_are_exact_when_threads_take_turns() {
    // Sizes are class sizes (blocks = requested) but 3000, in the 3072 class.
    use Op::*;
    let script: [(usize, Op); 9] = [
        (0, Alloc(0, 4096, 1)),
        (1, Alloc(1, 8192, 1)),
        (0, Free(0)),
        (1, Alloc(2, 1024, 2)),
        (0, Alloc(3, 3000, 0)),
        (1, Free(1)),
        (0, Alloc(4, 16384, 1)),
        (1, Free(4)),
        (0, Free(2)),
    ];
    let sizes = [(4096, 1), (8192, 1), (1024, 2), (3000, 0), (16384, 1)];
    for on in [true, false] {
        let e = env_cache(on);
        e.alloc.reset_peak_stats();
        let slots = Mutex::new([0u64; 5]);
        let turn = AtomicUsize::new(0);
        let warmed = Meet::new(3);
        std::thread::scope(|scope| {
            for (t, stream) in [(0, S0), (1, S0)] {
                let (e, slots, turn, warmed) = (&e, &slots, &turn, &warmed);
                scope.spawn(move || {
                    warm(e, stream, &sizes);
                    warmed.wait();
                    warmed.wait();
                    for (i, &(who, op)) in script.iter().enumerate() {
                        if who != t {
                            continue;
                        }
                        let deadline = Instant::now() + STUCK_AFTER;
                        while turn.load(Ordering::Acquire) != i {
                            assert!(Instant::now() < deadline, "turn {i} never came");
                            std::thread::yield_now();
                        }
                        match op {
                            Alloc(slot, size, tag) => {
                                let p = e.alloc.allocate_tagged(size, stream, tag).unwrap();
                                slots.lock().unwrap()[slot] = p;
                            }
                            Free(slot) => {
                                let p = slots.lock().unwrap()[slot];
                                e.alloc.deallocate(p, stream).unwrap();
                            }
                        }
                        turn.store(i + 1, Ordering::Release);
                    }
                });
            }
            warmed.wait();
            // Every walker warmed: the peaks start from nothing live.
            e.alloc.reset_peak_stats();
            warmed.wait();
        });
        let s = e.alloc.stats();
        // Live after each step: 4096, 12288 (tag 1: 12288), 8192, 9216, 12216 (blocks 12288),
        // 4024 (blocks 4096), 20408 (blocks 20480; tag 1: 16384), 4024, 3000.
        assert_eq!(s.peak_allocated_bytes, 20408, "caches {on}");
        assert_eq!(s.peak_allocated_block_bytes, 20480, "caches {on}");
        assert_eq!(s.tag(1).unwrap().peak_allocated_bytes, 16384, "caches {on}");
        assert_eq!(s.tag(2).unwrap().peak_allocated_bytes, 1024, "caches {on}");
        assert_eq!(s.tag(0).unwrap().peak_allocated_bytes, 3000, "caches {on}");
        assert_eq!((s.allocated_bytes, s.allocated_block_bytes), (3000, 3072));
        assert_eq!(
            (s.live_allocations, s.counts.allocs, s.counts.frees),
            (1, 35, 34)
        );
        // Each new peak past the caches' headroom was settled with every cache locked.
        assert_eq!(s.counts.thread_cache_settles > 0, on, "caches {on}");
        consistent(&e, "after the turns");
    }
}

#[test]
fn other_threads_free_and_look_up_cached_blocks() {
    for on in [true, false] {
        let e = env_cache(on);
        let s1 = e.backend.stream_create(0).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<(u64, u64)>();
        let owner_done = Meet::new(2);
        std::thread::scope(|scope| {
            let (e, owner_done) = (&e, &owner_done);
            scope.spawn(move || {
                warm(e, s1, &[(4096, 5)]);
                let live = e.alloc.allocate_tagged(4000, s1, 5).unwrap();
                let freed = e.alloc.allocate_tagged(4096, s1, 5).unwrap();
                e.alloc.deallocate(freed, s1).unwrap();
                tx.send((live, freed)).unwrap();
                owner_done.wait(); // stays alive (its cache registered) while the other looks
                owner_done.wait();
            });
            let (live, freed) = rx.recv().unwrap();
            assert_eq!(e.alloc.size_of(live).unwrap(), 4000);
            assert_eq!(e.alloc.tag_of(live).unwrap(), 5);
            assert!(matches!(
                e.alloc.size_of(freed),
                Err(Error::UnknownPointer(_))
            ));
            assert!(matches!(
                e.alloc.deallocate(freed, s1),
                Err(Error::DoubleFree(_))
            ));
            assert!(matches!(
                e.alloc.deallocate(live + 256, s1),
                Err(Error::UnknownPointer(_))
            ));
            consistent(e, "looked up");
            e.alloc.deallocate(live, s1).unwrap();
            assert!(matches!(
                e.alloc.deallocate(live, s1),
                Err(Error::DoubleFree(_))
            ));
            owner_done.wait();
            consistent(e, "freed from another thread");
            let s = e.alloc.stats();
            assert_eq!(
                (s.live_allocations, s.allocated_bytes),
                (0, 0),
                "caches {on}"
            );
            assert_eq!((s.counts.allocs, s.counts.frees), (5, 5), "caches {on}");
            let t = s.tag(5).unwrap();
            assert_eq!((t.allocs, t.frees, t.live_allocations), (5, 5, 0));
            assert_eq!(t.peak_allocated_bytes, 4000 + 4096);
            owner_done.wait();
        });
        e.backend.stream_destroy(s1).unwrap();
    }
}

/// A free from another thread, on the block's own stream, puts the block back in the cache
/// that handed it out (reused there first, last freed first), not in the shared bins.
#[test]
fn a_free_from_another_thread_goes_back_to_the_owners_cache() {
    let e = env_cache(true);
    let s1 = e.backend.stream_create(0).unwrap();
    // Channels, not barriers: a thread that fails drops its end and the other one stops too.
    let (handed_tx, handed_rx) = std::sync::mpsc::channel::<u64>();
    let (freed_tx, freed_rx) = std::sync::mpsc::channel::<()>();
    let again = std::thread::scope(|scope| {
        let e = &e;
        let owner = scope.spawn(move || {
            warm(e, s1, &[(4096, 3)]);
            let handed = e.alloc.allocate_tagged(4096, s1, 3).unwrap();
            let kept = e.alloc.allocate_tagged(4096, s1, 3).unwrap();
            e.alloc.deallocate(kept, s1).unwrap(); // the top of this thread's magazine
            handed_tx.send(handed).unwrap();
            freed_rx.recv().unwrap();
            let again = e.alloc.allocate_tagged(4096, s1, 3).unwrap();
            e.alloc.deallocate(again, s1).unwrap();
            (handed, again)
        });
        let handed = handed_rx.recv().unwrap();
        e.alloc.deallocate(handed, s1).unwrap();
        assert!(matches!(
            e.alloc.deallocate(handed, s1),
            Err(Error::DoubleFree(_))
        ));
        consistent(e, "freed into its owner's cache");
        freed_tx.send(()).unwrap();
        owner.join().unwrap()
    });
    assert_eq!(
        again.1, again.0,
        "the block freed elsewhere is on top of its owner's cache"
    );
    consistent(&e, "after");
    let s = e.alloc.stats();
    assert_eq!((s.live_allocations, s.allocated_bytes), (0, 0));
    assert_eq!(s.counts.allocs, s.counts.frees);
    assert_eq!(s.tag(3).unwrap().peak_allocated_bytes, 2 * 4096);
    e.backend.stream_destroy(s1).unwrap();
}

#[test]
fn record_stream_from_another_thread_holds_the_free() {
    for on in [true, false] {
        let e = env_cache(on);
        let (s1, s2) = (
            e.backend.stream_create(0).unwrap(),
            e.backend.stream_create(0).unwrap(),
        );
        let before = e.alloc.stats().counts.pending_frees;
        // Nothing between the allocation and the free absorbs the caches: the other thread's
        // record_stream itself must take the block out of this thread's cache.
        warm(&e, s1, &[(4096, 0)]);
        let p = e.alloc.allocate(4096, s1).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| e.alloc.record_stream(p, s2).unwrap());
        });
        e.alloc.deallocate(p, s1).unwrap();
        let s = e.alloc.stats();
        assert_eq!(
            s.counts.pending_frees,
            before + 1,
            "caches {on}: held on s2"
        );
        consistent(&e, "pending");
        for s in [s1, s2] {
            e.backend.stream_synchronize(s).unwrap();
            e.backend.stream_destroy(s).unwrap();
        }
    }
}

#[test]
fn a_block_cached_on_one_stream_reaches_another_only_ordered() {
    for on in [true, false] {
        let e = env_cache(on);
        let (s1, s2) = (
            e.backend.stream_create(0).unwrap(),
            e.backend.stream_create(0).unwrap(),
        );
        warm(&e, s1, &[(4096, 0)]);
        let p = e.alloc.allocate(4096, s1).unwrap();
        e.alloc.deallocate(p, s1).unwrap();
        let waits = e.alloc.stats().counts.stream_waits;
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(e.alloc.allocate(4096, s2).unwrap());
        }
        let s = e.alloc.stats();
        assert!(
            !got.contains(&p) || s.counts.stream_waits > waits,
            "caches {on}: freed on s1, handed to s2 unordered"
        );
        for q in got {
            e.alloc.deallocate(q, s2).unwrap();
        }
        consistent(&e, "two streams");
    }
}

#[test]
fn empty_cache_and_sleep_reclaim_other_threads_cached_blocks() {
    let e = env_cache(true);
    let s1 = e.backend.stream_create(0).unwrap();
    let parked = Meet::new(2);
    let failure: Failure = Mutex::new(None);
    std::thread::scope(|scope| {
        let (e, parked, failure) = (&e, &parked, &failure);
        scope.spawn(move || {
            guarded(failure, || warm(e, s1, &[(4096, 0), (8192, 3)]));
            parked.wait(); // its cache holds free blocks of both tags
            parked.wait();
            guarded(failure, || warm(e, s1, &[(4096, 0), (8192, 3)]));
            parked.wait();
            parked.wait();
            // Tag 3 awake again: served again.
            guarded(failure, || warm(e, s1, &[(8192, 3)]));
        });
        parked.wait();
        guarded(failure, || {
            // (The invariant checker looks into the caches without absorbing them, as `stats`
            // would: empty_cache itself must take their blocks.)
            e.alloc.check_invariants().unwrap();
            assert!(e.alloc.empty_cache().unwrap() > 0);
            assert_eq!(e.alloc.stats().reserved_bytes, 0, "every page released");
            consistent(e, "after empty_cache");
        });
        parked.wait();
        parked.wait();
        guarded(failure, || {
            e.alloc.check_invariants().unwrap();
            e.alloc.sleep(3, false).unwrap();
            let s = e.alloc.stats();
            assert_eq!(s.tag(3).unwrap().reserved_bytes, 0, "asleep: no pages");
            consistent(e, "asleep");
            e.alloc.wake(3).unwrap();
        });
        parked.wait();
    });
    rethrow(failure);
    consistent(&e, "end");
    e.backend.stream_destroy(s1).unwrap();
}

#[test]
fn a_threads_exit_returns_its_cache() {
    let e = env_cache(true);
    let s1 = e.backend.stream_create(0).unwrap();
    let warmed = Meet::new(2);
    let mut misses = 0;
    // The 4 KiB class carves 16 blocks per run: the exiting thread's cache ends up holding
    // every free one.
    let live = std::thread::scope(|scope| {
        let t = scope.spawn(|| {
            warm(&e, s1, &[(4096, 0); 16]);
            warmed.wait();
            warmed.wait();
            warm(&e, s1, &[(4096, 0); 16]);
            e.alloc.allocate(4096, s1).unwrap()
        });
        warmed.wait();
        misses = e.alloc.stats().counts.cache_misses; // (absorbs: the thread refills after)
        warmed.wait();
        t.join().unwrap()
    });
    // Nothing absorbed the exited thread's cache but its exit: another thread finds the
    // blocks in the shared bin, with no new run.
    std::thread::scope(|scope| {
        scope.spawn(|| warm(&e, s1, &[(4096, 0); 5]));
    });
    assert_eq!(e.alloc.stats().counts.cache_misses, misses, "no new run");
    assert_eq!(e.alloc.size_of(live).unwrap(), 4096);
    e.alloc.deallocate(live, s1).unwrap();
    let s = e.alloc.stats();
    assert_eq!(s.live_allocations, 0);
    assert_eq!(s.counts.allocs, s.counts.frees);
    consistent(&e, "end");
    e.backend.stream_destroy(s1).unwrap();
}

const WALKERS: usize = 3;
const ROUNDS: usize = 5;
const STEPS: usize = 150;

struct Block {
    ptr: u64,
    size: u64,
    seed: u64,
    tag: usize,
}

/// Counts per tag (0, 1, 2): a walk's model.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct Counts {
    allocs: [u64; 3],
    frees: [u64; 3],
    bytes: [i64; 3],
}

/// Walkers allocate (filled), free their own blocks or blocks other walkers posted (checked),
/// record their blocks on the default stream; at each barrier the main thread checks the stats
/// against the model exactly and flushes (empty_cache, stats, sleep/wake, offload/onload,
/// reset of the peaks, which must then equal what is live).
#[test]
fn walks_with_cross_thread_frees_keep_exact_stats() {
    for on in [true, false] {
        let e = env_cache(on);
        let streams: Vec<StreamHandle> = (0..WALKERS)
            .map(|_| e.backend.stream_create(0).unwrap())
            .collect();
        let mailbox: Mutex<Vec<Block>> = Mutex::new(Vec::new());
        let models = Mutex::new(vec![Counts::default(); WALKERS]);
        let paused = Meet::new(WALKERS + 1);
        let failure: Failure = Mutex::new(None);
        std::thread::scope(|scope| {
            for (w, &stream) in streams.iter().enumerate() {
                let (e, mailbox, models, paused) = (&e, &mailbox, &models, &paused);
                let failure = &failure;
                scope.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(w as u64 + 7);
                    let mut own: Vec<Block> = Vec::new();
                    let mut m = Counts::default();
                    let mut seed = (w as u64) << 40;
                    let free = |b: Block, m: &mut Counts, rng: &mut SmallRng| {
                        check(&e.backend, b.ptr, b.size, b.seed, "free");
                        let on = if rng.random_bool(0.1) { S0 } else { stream };
                        e.alloc.deallocate(b.ptr, on).unwrap();
                        m.frees[b.tag] += 1;
                        m.bytes[b.tag] -= b.size as i64;
                    };
                    for _ in 0..ROUNDS {
                        let failed = failure.lock().unwrap().is_some();
                        let steps = catch_unwind(AssertUnwindSafe(|| {
                            for _ in 0..if failed { 0 } else { STEPS } {
                                match rng.random_range(0..10) {
                                    0..=4 if own.len() < 16 => {
                                        let size = rng.random_range(1..32 << 10);
                                        let tag = rng.random_range(0..3);
                                        let ptr =
                                            e.alloc.allocate_tagged(size, stream, tag as TagId);
                                        let ptr = ptr.unwrap();
                                        seed += 1;
                                        fill(&e.backend, ptr, size, seed);
                                        own.push(Block {
                                            ptr,
                                            size,
                                            seed,
                                            tag,
                                        });
                                        m.allocs[tag] += 1;
                                        m.bytes[tag] += size as i64;
                                    }
                                    5 if !own.is_empty() => {
                                        let i = rng.random_range(0..own.len());
                                        mailbox.lock().unwrap().push(own.swap_remove(i));
                                    }
                                    6 if !own.is_empty() => {
                                        let b = &own[rng.random_range(0..own.len())];
                                        e.alloc.record_stream(b.ptr, S0).unwrap();
                                    }
                                    7 => {
                                        let got = mailbox.lock().unwrap().pop();
                                        if let Some(b) = got {
                                            free(b, &mut m, &mut rng);
                                        }
                                    }
                                    _ if !own.is_empty() => {
                                        let i = rng.random_range(0..own.len());
                                        free(own.swap_remove(i), &mut m, &mut rng);
                                    }
                                    _ => {}
                                }
                            }
                        }));
                        if let Err(panic) = steps {
                            failure.lock().unwrap().get_or_insert(panic);
                        }
                        models.lock().unwrap()[w] = m;
                        paused.wait();
                        paused.wait();
                    }
                    if failure.lock().unwrap().is_some() {
                        return;
                    }
                    for b in own {
                        free(b, &mut m, &mut rng);
                    }
                    models.lock().unwrap()[w] = m;
                });
            }
            for round in 0..ROUNDS {
                paused.wait();
                guarded(&failure, || {
                    let held: Vec<(usize, u64)> = mailbox
                        .lock()
                        .unwrap()
                        .iter()
                        .map(|b| (b.tag, b.size))
                        .collect();
                    exact(&e, &models.lock().unwrap(), &held, round, on);
                    match round {
                        0 => drop(e.alloc.empty_cache().unwrap()),
                        1 => {
                            e.alloc.sleep(2, true).unwrap();
                            e.alloc.wake(2).unwrap();
                        }
                        2 => {
                            e.alloc.offload(1, &e.host, S0).unwrap();
                            e.alloc.onload(1, S0).unwrap();
                        }
                        _ => {
                            e.alloc.reset_peak_stats();
                            let s = e.alloc.stats();
                            assert_eq!(s.peak_allocated_bytes, s.allocated_bytes);
                            assert_eq!(s.peak_allocated_block_bytes, s.allocated_block_bytes);
                        }
                    }
                    consistent(&e, &format!("round {round} flushed"));
                });
                paused.wait();
            }
        });
        rethrow(failure);
        for b in mailbox.into_inner().unwrap() {
            e.alloc.deallocate(b.ptr, S0).unwrap();
        }
        let s = e.alloc.stats();
        assert_eq!(
            (s.live_allocations, s.allocated_bytes),
            (0, 0),
            "caches {on}"
        );
        let models = models.into_inner().unwrap();
        let allocs: u64 = models.iter().map(|m| m.allocs.iter().sum::<u64>()).sum();
        assert_eq!(s.counts.allocs, allocs);
        for s in &streams {
            e.backend.stream_synchronize(*s).unwrap();
        }
        e.alloc.empty_cache().unwrap();
        assert_eq!(e.alloc.stats().reserved_bytes, 0, "caches {on}");
        consistent(&e, "end");
    }
}

/// The stats at a barrier against the walkers' models and the blocks in the mailbox.
fn exact(e: &Env, models: &[Counts], mailbox: &[(usize, u64)], round: usize, on: bool) {
    let s = e.alloc.stats();
    let mut total = 0i64;
    for tag in 0..3 {
        let allocs: u64 = models.iter().map(|m| m.allocs[tag]).sum();
        let frees: u64 = models.iter().map(|m| m.frees[tag]).sum();
        let bytes: i64 = models.iter().map(|m| m.bytes[tag]).sum();
        total += bytes;
        let posted = mailbox.iter().filter(|b| b.0 == tag).count() as u64;
        let Some(t) = s.tag(tag as TagId) else {
            assert_eq!(allocs, 0);
            continue;
        };
        let when = format!("round {round}, caches {on}, tag {tag}");
        assert_eq!((t.allocs, t.frees), (allocs, frees), "{when}");
        assert_eq!(t.allocated_bytes as i64, bytes, "{when}");
        assert_eq!(t.live_allocations, allocs - frees, "{when}");
        assert!(t.peak_allocated_bytes >= t.allocated_bytes, "{when}");
        assert!(posted <= t.live_allocations, "{when}");
    }
    assert_eq!(
        s.allocated_bytes as i64, total,
        "round {round}, caches {on}"
    );
    assert!(s.peak_allocated_bytes >= s.allocated_bytes);
    let live: u64 = s.tags.iter().map(|t| t.live_allocations).sum();
    assert_eq!(s.live_allocations, live);
}
