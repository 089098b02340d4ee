//! Offload, revocation and sleep copy with the allocator's lock dropped: while one of their
//! copies is held (a gate on the host backend's copy calls of their thread), other tags
//! allocate, grow, write and free; the tag being moved has its allocations and frees wait
//! until its pages have moved, and the tables stay consistent mid-copy.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::*;
use strata_allocator::TagId;
use strata_vmm::host::FaultOp;
use strata_vmm::{Error, Location, Result};

/// Bound on the wait for the other tag's calls while the copy is held: reached only when they
/// cannot proceed (the lock held across the copy), where the test fails.
const STUCK: Duration = Duration::from_secs(30);

/// What tag `moving` got while the copy was held: an allocation and the free of `victim`.
struct Waited {
    allocated: Result<u64>,
    freed: Result<()>,
}

/// Runs `work` on a thread whose copies stop at a gate. While its first copy is held, tag 2
/// grows (pool pages, map, set_access), takes the fast path, writes and frees, and the
/// allocator's tables and tiers are checked; tag `moving` allocates and frees `victim` on two
/// more threads, which must return only after the copy is let go.
fn while_a_copy_is_held<R: Send>(
    e: &Env,
    moving: TagId,
    victim: u64,
    work: impl FnOnce() -> R + Send,
) -> (R, Waited) {
    let warm = e.alloc.allocate_tagged(4096, S0, 2).unwrap();
    let (reached_tx, reached_rx) = channel();
    let (release_tx, release_rx) = channel::<()>();
    let (reached_tx, release_rx) = (Mutex::new(reached_tx), Mutex::new(release_rx));
    injector(&e.backend).set_op_gate(
        FaultOp::Copy,
        Some(Arc::new(move |_| {
            if thread::current().name() == Some("held") {
                let _ = reached_tx.lock().unwrap().send(());
                let _ = release_rx.lock().unwrap().recv();
            }
        })),
    );
    // Set once the held copy is let go: the moving tag's calls read it when they return.
    let released = AtomicBool::new(false);
    let released = &released;
    let got = thread::scope(|s| {
        let worker = thread::Builder::new()
            .name("held".into())
            .spawn_scoped(s, work)
            .unwrap();
        reached_rx.recv().unwrap();
        let allocated = s.spawn(move || {
            let p = e.alloc.allocate_tagged(2 * MIB, S0, moving);
            (p, released.load(Ordering::SeqCst))
        });
        let freed = s.spawn(move || {
            let freed = e.alloc.deallocate(victim, S0);
            (freed, released.load(Ordering::SeqCst))
        });
        let (done_tx, done_rx) = channel();
        s.spawn(move || {
            let big = e.alloc.allocate_tagged(4 * PAGE, S0, 2).unwrap();
            let fast = e.alloc.allocate_tagged(4096, S0, 2).unwrap();
            let untagged = e.alloc.allocate(300 << 10, S0).unwrap();
            fill(&e.backend, big, 4 * PAGE, 3);
            check(&e.backend, big, 4 * PAGE, 3, "beside the held copy");
            for p in [big, fast, untagged] {
                e.alloc.deallocate(p, S0).unwrap();
            }
            let _ = done_tx.send(());
        });
        let other = done_rx.recv_timeout(STUCK);
        let mid_copy = other.is_ok().then(|| {
            let reserved = e.alloc.stats().tag(moving).map(|t| t.reserved_bytes);
            let t = e.alloc.spill_stats(Some(moving)).tiers;
            (
                e.alloc.check_invariants(),
                t.local + t.host + t.peer,
                reserved,
            )
        });
        released.store(true, Ordering::SeqCst);
        drop(release_tx); // every later copy passes the gate
        assert!(
            other.is_ok(),
            "another tag's allocations and frees waited for the held copy"
        );
        let (invariants, counted, reserved) = mid_copy.unwrap();
        invariants.expect("invariants while the copy is held");
        assert_eq!(Some(counted), reserved, "every page counted where it is");
        let result = worker.join().unwrap();
        let (allocated, after) = allocated.join().unwrap();
        assert!(after, "tag {moving} allocated while its pages were copied");
        let (freed, after) = freed.join().unwrap();
        assert!(after, "tag {moving} freed while its pages were copied");
        (result, Waited { allocated, freed })
    });
    injector(&e.backend).set_op_gate(FaultOp::Copy, None);
    e.alloc.deallocate(warm, S0).unwrap();
    got
}

#[test]
fn other_tags_allocate_and_free_while_an_offload_copies() {
    let e = env();
    let moving = e.alloc.allocate_tagged(8 * MIB, S0, 1).unwrap();
    let victim = e.alloc.allocate_tagged(1000, S0, 1).unwrap();
    fill(&e.backend, moving, 8 * MIB, 1);
    let (moved, waited) = while_a_copy_is_held(&e, 1, victim, || e.alloc.offload(1, &e.host, S0));
    assert!(moved.unwrap().bytes >= 8 * MIB);
    waited.freed.unwrap();
    e.alloc.deallocate(waited.allocated.unwrap(), S0).unwrap();
    consistent(&e, "after the offload");
    check(&e.backend, moving, 8 * MIB, 1, "offloaded");
    assert!(e.alloc.spill_stats(Some(1)).tiers.host >= 8 * MIB);
    e.alloc.deallocate(moving, S0).unwrap();
}

#[test]
fn other_tags_allocate_and_free_while_a_revocation_copies() {
    let e = env();
    e.alloc.set_overflow(1, Some(Arc::clone(&e.peer))).unwrap();
    let mut hog = Vec::new();
    while let Ok(p) = e.alloc.allocate_tagged(2 * PAGE, S0, 3) {
        hog.push(p);
    }
    let lent = e.alloc.allocate_tagged(4 * PAGE, S0, 1).unwrap();
    let victim = e.alloc.allocate_tagged(1000, S0, 1).unwrap();
    fill(&e.backend, lent, 4 * PAGE, 6);
    assert_eq!(e.alloc.spill_stats(Some(1)).tiers.local, 0);
    // Room on the device for the revoked pages and for tag 2's.
    for p in hog.drain(..6) {
        e.alloc.deallocate(p, S0).unwrap();
    }
    e.alloc.empty_cache().unwrap();
    let (moved, waited) =
        while_a_copy_is_held(&e, 1, victim, || e.alloc.revoke(&e.peer, &e.host, S0));
    assert_eq!(moved.unwrap(), 2, "the large and the small segment");
    waited.freed.unwrap();
    e.alloc.deallocate(waited.allocated.unwrap(), S0).unwrap();
    consistent(&e, "after the revocation");
    check(&e.backend, lent, 4 * PAGE, 6, "revoked");
    assert_eq!(e.peer.stats().in_use, 0);
    let notices = e.alloc.take_revoked();
    assert!(
        notices.iter().all(|r| r.to == Location::Device(0)),
        "{notices:?}"
    );
    for p in hog.into_iter().chain([lent]) {
        e.alloc.deallocate(p, S0).unwrap();
    }
}

#[test]
fn other_tags_allocate_and_free_while_a_sleep_copies() {
    let e = env();
    let kept = e.alloc.allocate_tagged(3 * MIB, S0, 1).unwrap();
    let victim = e.alloc.allocate_tagged(1000, S0, 1).unwrap();
    fill(&e.backend, kept, 3 * MIB, 8);
    let (slept, waited) = while_a_copy_is_held(&e, 1, victim, || e.alloc.sleep(1, true));
    slept.unwrap();
    assert!(
        matches!(waited.allocated, Err(Error::InvalidState(_))),
        "tag 1 waited and found itself asleep"
    );
    waited.freed.unwrap();
    e.alloc.wake(1).unwrap();
    consistent(&e, "after the sleep");
    check(&e.backend, kept, 3 * MIB, 8, "woken");
    e.alloc.deallocate(kept, S0).unwrap();
}

/// One thread moves tag 1 to host memory and back over and over (and sleeps and wakes it, and
/// empties the cache) while two others allocate, write, check and free under tags 1, 2 and 3 at
/// random: every allocation keeps its bytes, and the tables are consistent at the end. Tag 1's
/// memory is written and read only between moves (the offload's contract), under `between`.
#[test]
fn moves_race_allocations_of_every_tag() {
    use rand::{Rng, SeedableRng};
    let e = env();
    e.alloc.set_overflow(3, Some(Arc::clone(&e.host))).unwrap();
    let stop = AtomicBool::new(false);
    let between = std::sync::RwLock::new(());
    let (e, stop, between) = (&e, &stop, &between);
    thread::scope(|s| {
        let mover = s.spawn(move || {
            for round in 0..40 {
                let _moving = between.write().unwrap();
                let got = match round % 8 {
                    7 => e.alloc.sleep(1, true).and_then(|()| e.alloc.wake(1)),
                    6 => e.alloc.empty_cache().map(drop),
                    r if r % 2 == 0 => e.alloc.offload(1, &e.host, S0).map(drop),
                    _ => e.alloc.onload(1, S0).map(drop),
                };
                match got {
                    Ok(()) | Err(Error::OutOfMemory { .. }) => {}
                    Err(err) => panic!("round {round}: {err}"),
                }
            }
            stop.store(true, Ordering::SeqCst);
        });
        let workers: Vec<_> = (0..2u64)
            .map(|w| {
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(w);
                    // (pointer, bytes, pattern, tag)
                    let mut live: Vec<(u64, u64, u64, TagId)> = Vec::new();
                    let touch = |tag: TagId| (tag == 1).then(|| between.read().unwrap());
                    let mut step = 0u64;
                    while !stop.load(Ordering::SeqCst) || step < 50 {
                        step += 1;
                        let seed = w << 32 | step;
                        if live.len() < 12 && rng.random_bool(0.6) {
                            let tag = rng.random_range(1..=3);
                            let size = if rng.random_bool(0.7) {
                                rng.random_range(1..64 << 10)
                            } else {
                                rng.random_range(MIB..3 * MIB)
                            };
                            match e.alloc.allocate_tagged(size, S0, tag) {
                                Ok(p) => {
                                    let _between = touch(tag);
                                    fill(&e.backend, p, size, seed);
                                    live.push((p, size, seed, tag));
                                }
                                Err(Error::OutOfMemory { .. } | Error::InvalidState(_)) => {}
                                Err(err) => panic!("worker {w} step {step}: {err}"),
                            }
                        } else if !live.is_empty() {
                            let k = rng.random_range(0..live.len());
                            let (p, n, seed, tag) = live.swap_remove(k);
                            {
                                let _between = touch(tag);
                                check(&e.backend, p, n, seed, "before its free");
                            }
                            e.alloc.deallocate(p, S0).unwrap();
                        }
                    }
                    for (p, n, seed, _) in live {
                        check(&e.backend, p, n, seed, "at the end");
                        e.alloc.deallocate(p, S0).unwrap();
                    }
                })
            })
            .collect();
        mover.join().unwrap();
        for w in workers {
            w.join().unwrap();
        }
    });
    consistent(e, "after the race");
    e.alloc.empty_cache().unwrap();
    e.alloc.check_invariants().unwrap();
}
