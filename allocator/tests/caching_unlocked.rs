//! The caching allocator's growth outside its lock: driver calls held at a gate or failing
//! while other threads allocate, free, sleep and grow (on any backend: the gates and faults
//! are [`strata_vmm::FaultyBackend`]'s).

mod caching_common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use caching_common::*;
use strata_allocator::{CachingConfig, Error};
use strata_vmm::host::{FaultOp, OpGate};
use strata_vmm::FaultyBackend;

/// How long a held driver call waits for the test to open its gate: a deadlock (the gate
/// never opened because the thread that would open it is stuck on the allocator's lock)
/// becomes a timed-out gate, and a failed assertion, instead of a hang.
const GATE_TIMEOUT: Duration = Duration::from_secs(10);

/// The first call of a backend operation, held at a gate: it reports that it arrived, then
/// waits until the test opens the gate (at most [`GATE_TIMEOUT`]). Later calls pass.
struct HeldCall {
    arrived: mpsc::Receiver<()>,
    open: mpsc::Sender<()>,
    timed_out: Arc<AtomicBool>,
}

impl HeldCall {
    fn new(host: &FaultyBackend, op: FaultOp) -> HeldCall {
        let (arrived_tx, arrived) = mpsc::channel();
        let (open, open_rx) = mpsc::channel::<()>();
        let timed_out = Arc::new(AtomicBool::new(false));
        let first = AtomicBool::new(true);
        let channels = Mutex::new((arrived_tx, open_rx));
        let flag = Arc::clone(&timed_out);
        let gate: OpGate = Arc::new(move |_| {
            if !first.swap(false, Ordering::SeqCst) {
                return;
            }
            let channels = channels.lock().unwrap();
            let _ = channels.0.send(());
            if channels.1.recv_timeout(GATE_TIMEOUT).is_err() {
                flag.store(true, Ordering::SeqCst);
            }
        });
        host.set_op_gate(op, Some(gate));
        HeldCall {
            arrived,
            open,
            timed_out,
        }
    }

    fn wait_arrived(&self) {
        self.arrived
            .recv_timeout(GATE_TIMEOUT)
            .expect("the driver call reached its gate");
    }
}

/// Regression test for growth holding the allocator's lock across driver calls: while one
/// thread's growth is held inside a driver call (create, map or set_access; large and small
/// growth), another thread completes cached small allocate/free pairs, and only then opens
/// the gate. Under the old locking the pairs wait for the lock the grower holds, the gate
/// times out, and the test fails.
#[test]
fn growth_in_a_driver_call_does_not_stall_the_fast_path() {
    const PAIRS: u64 = 1000;
    for (op, size, tag) in [
        (FaultOp::Create, 16 * MIB, 0),
        (FaultOp::Map, 16 * MIB, 0),
        (FaultOp::SetAccess, 16 * MIB, 0),
        (FaultOp::Create, 4096, 7), // a new tag: a new shared page
    ] {
        let e = env();
        let a = &e.alloc;
        // A live block keeps the page from being recycled into the growth.
        let keep = a.allocate(1000, S0).unwrap();
        let warm = a.allocate(1000, S0).unwrap();
        a.deallocate(warm, S0).unwrap();
        let held = HeldCall::new(&e.hooks, op);
        let before = a.stats().counts;
        std::thread::scope(|scope| {
            let grower = scope.spawn(|| a.allocate_tagged(size, S0, tag));
            held.wait_arrived();
            for _ in 0..PAIRS {
                let p = a.allocate(1000, S0).unwrap();
                assert_eq!(p, warm);
                a.deallocate(p, S0).unwrap();
            }
            held.open.send(()).unwrap();
            let p = grower.join().unwrap().expect("growth");
            assert!(
                !held.timed_out.load(Ordering::SeqCst),
                "{op:?}: the fast path waited for the grower's driver call"
            );
            fill(&e.backend, p, size, 1);
            check(&e.backend, p, size, 1);
            a.deallocate(p, S0).unwrap();
            a.deallocate(keep, S0).unwrap();
        });
        let after = a.stats().counts;
        assert_eq!(after.cache_hits - before.cache_hits, PAIRS, "{op:?}");
        assert_eq!(after.cache_misses - before.cache_misses, 1, "{op:?}");
        ok(a);
    }
}

/// `sleep` waits for a growth of its tag that is in flight, then puts its pages to sleep too.
#[test]
fn sleep_waits_for_an_in_flight_growth_of_its_tag() {
    let e = env();
    let a = &e.alloc;
    let held = HeldCall::new(&e.hooks, FaultOp::Map);
    std::thread::scope(|scope| {
        let grower = scope.spawn(|| a.allocate_tagged(8 * MIB, S0, 5));
        held.wait_arrived();
        ok(a); // the in-flight range is accounted for
        let (slept_tx, slept) = mpsc::channel();
        let sleeper = scope.spawn(move || {
            let r = a.sleep(5, true);
            slept_tx.send(()).unwrap();
            r
        });
        // Another tag's fast path and growth proceed meanwhile.
        let other = a.allocate_tagged(3 * MIB, S0, 6).unwrap();
        assert!(
            slept.recv_timeout(Duration::from_millis(200)).is_err(),
            "sleep returned while a growth of its tag was in flight"
        );
        held.open.send(()).unwrap();
        let p = grower.join().unwrap().expect("growth");
        sleeper.join().unwrap().expect("sleep");
        assert!(a.is_asleep(5));
        assert!(matches!(
            a.allocate_tagged(MIB, S0, 5),
            Err(Error::InvalidState(_))
        ));
        ok(a);
        a.wake(5).unwrap();
        fill(&e.backend, p, 8 * MIB, 3);
        check(&e.backend, p, 8 * MIB, 3);
        a.deallocate(p, S0).unwrap();
        a.deallocate(other, S0).unwrap();
    });
    assert!(!held.timed_out.load(Ordering::SeqCst));
    ok(a);
}

/// Growers on four threads near the limit, with frees and `empty_cache` between them and the
/// invariant checker running alongside: the pages the allocator holds (mapped or in flight)
/// never exceed the limit, and every allocation keeps its fill pattern.
#[test]
fn concurrent_growth_near_the_limit_never_exceeds_it() {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    const LIMIT: u64 = 16 * MIB;
    let e = env_with(
        1 << 30,
        CachingConfig {
            limit: Some(LIMIT),
            ..CachingConfig::default()
        },
        None,
    );
    let a = &e.alloc;
    let backend = &e.backend;
    let baseline = backend.live_counts();
    let host = &e.hooks;
    // Sampled inside every map call, while its growth is in flight: the pool's pages in use
    // are those the allocator holds.
    let most_held = Arc::new(AtomicU64::new(0));
    let pool = Arc::clone(&e.pool);
    let seen = Arc::clone(&most_held);
    host.set_op_gate(
        FaultOp::Map,
        Some(Arc::new(move |_| {
            seen.fetch_max(pool.stats().in_use as u64 * PAGE, Ordering::SeqCst);
            std::thread::yield_now();
        })),
    );
    let limited = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let checker = scope.spawn(|| {
            let mut checks = 0u64;
            while !done.load(Ordering::SeqCst) {
                ok(a);
                checks += 1;
                std::thread::yield_now();
            }
            checks
        });
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let limited = &limited;
                scope.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(0x5eed + t);
                    let mut live: Vec<(u64, u64, u64)> = Vec::new();
                    for i in 0..120u64 {
                        let roll = rng.random_range(0..100);
                        if roll < 5 {
                            a.empty_cache().unwrap();
                        } else if roll < 55 && live.len() < 4 {
                            let size = if rng.random_bool(0.7) {
                                rng.random_range(MIB..5 * MIB)
                            } else {
                                rng.random_range(1..300_000)
                            };
                            match a.allocate_tagged(size, S0, (t % 2) as u32) {
                                Ok(p) => {
                                    let seed = t << 32 | i;
                                    fill(backend, p, size, seed);
                                    live.push((p, size, seed));
                                }
                                Err(Error::LimitExceeded { limit, .. }) => {
                                    assert_eq!(limit, LIMIT);
                                    limited.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(other) => panic!("thread {t}: {other}"),
                            }
                        } else if !live.is_empty() {
                            let l = live.swap_remove(rng.random_range(0..live.len()));
                            check_and_free(a, backend, l);
                        }
                    }
                    for l in live {
                        check_and_free(a, backend, l);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::SeqCst);
        assert!(checker.join().unwrap() > 0);
    });
    host.set_op_gate(FaultOp::Map, None);
    let held = most_held.load(Ordering::SeqCst);
    assert!(
        held > 0 && held <= LIMIT,
        "held {held} bytes, limit {LIMIT}"
    );
    assert!(
        limited.load(Ordering::Relaxed) > 0,
        "the limit was never reached"
    );
    let stats = a.stats();
    assert!(stats.peak_reserved_bytes <= LIMIT);
    assert_eq!(stats.live_allocations, 0);
    ok(a);
    a.empty_cache().unwrap();
    ok(a);
    assert_eq!(e.pool.stats().in_use, 0);
    let now = backend.live_counts();
    assert_eq!(now.mappings, baseline.mappings);
    assert_eq!(now.handles - e.pool.stats().free as u64, baseline.handles);
}

/// A driver call failing while the lock is dropped (create, map, set_access; with cached pages
/// recycled into the growth or not) rolls back: a typed error, the in-flight range and pages
/// returned, driver objects back to the baseline, and the allocator usable.
#[test]
fn a_failed_unlocked_growth_rolls_back() {
    for (op, nth, recycle) in [
        (FaultOp::Create, 2, false),
        (FaultOp::Map, 3, false),
        (FaultOp::SetAccess, 1, false),
        (FaultOp::Create, 1, true),
        (FaultOp::Map, 4, true),
    ] {
        let e = env();
        let a = &e.alloc;
        let host = &e.hooks;
        if recycle {
            let cached = a.allocate(4 * MIB, S0).unwrap();
            a.deallocate(cached, S0).unwrap();
        }
        let baseline = e.backend.live_counts();
        let before = a.stats();
        host.inject_fault(op, nth);
        let err = a.allocate(12 * MIB, S0).unwrap_err();
        assert!(matches!(err, Error::InjectedFault(_)), "{op:?}: {err}");
        host.clear_faults();
        ok(a);
        let after = a.stats();
        assert_eq!(after.live_allocations, 0, "{op:?}");
        assert_eq!(
            after.free_va_bytes + after.cached_large_bytes,
            before.free_va_bytes + before.cached_large_bytes,
            "{op:?}: VA returned"
        );
        a.empty_cache().unwrap();
        e.pool.trim(0);
        let now = e.backend.live_counts();
        assert_eq!(now.mappings, 0, "{op:?}");
        assert!(now.handles <= baseline.handles, "{op:?}");
        // Usable: the same growth succeeds and holds its bytes.
        let p = a.allocate(12 * MIB, S0).unwrap();
        fill(&e.backend, p, 12 * MIB, 9);
        check(&e.backend, p, 12 * MIB, 9);
        a.deallocate(p, S0).unwrap();
        ok(a);
    }
}
