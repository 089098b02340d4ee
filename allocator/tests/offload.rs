//! `CachingAllocator::offload` / `onload` on the strict host backend: a tag's live allocations
//! move to host-memory pages and back at the same addresses with their bytes intact, freed
//! pages go back to the pool they came from, and an injected failure at any step of a
//! migration loses nothing.

mod common;

use std::sync::Arc;

use common::*;
use rand::{Rng, SeedableRng};
use strata_allocator::{CachingAllocator, CachingConfig, PagePool, TagId};
use strata_vmm::host::FaultOp;
use strata_vmm::{Error, HostConfig};

#[test]
fn a_tag_moves_to_host_memory_and_back_at_the_same_addresses() {
    let e = env();
    let sizes = [4096u64, 300 << 10, 3 * MIB, 5 * MIB + 7];
    let ptrs: Vec<u64> = sizes
        .iter()
        .map(|&n| e.alloc.allocate_tagged(n, S0, 1).unwrap())
        .collect();
    let other = e.alloc.allocate_tagged(MIB, S0, 2).unwrap();
    for (i, (&p, &n)) in ptrs.iter().zip(&sizes).enumerate() {
        fill(&e.backend, p, n, i as u64);
    }
    fill(&e.backend, other, MIB, 99);
    let before = e.alloc.spill_stats(Some(1));
    assert_eq!((before.tiers.host, before.counts.to_host), (0, 0));

    let moved = e.alloc.offload(1, &e.host, S0).unwrap();
    consistent(&e, "offloaded");
    let off = e.alloc.spill_stats(Some(1));
    assert_eq!(off.tiers.local, 0, "nothing of tag 1 left on the device");
    assert_eq!(off.tiers.host, before.tiers.local);
    assert_eq!(off.counts.to_host, moved.runs);
    assert_eq!(off.counts.bytes_to_host, moved.bytes);
    assert!(moved.bytes >= sizes.iter().sum::<u64>());
    assert_eq!(e.alloc.spill_stats(Some(2)).tiers.host, 0, "tag 2 stays");
    for (i, (&p, &n)) in ptrs.iter().zip(&sizes).enumerate() {
        check(&e.backend, p, n, i as u64, "offloaded");
    }
    // Usable while offloaded: written and read at the same pointers.
    fill(&e.backend, ptrs[2], sizes[2], 42);
    check(&e.backend, ptrs[2], sizes[2], 42, "written while offloaded");

    let back = e.alloc.onload(1, S0).unwrap();
    consistent(&e, "onloaded");
    let on = e.alloc.spill_stats(Some(1));
    assert_eq!((on.tiers.host, on.counts.to_device), (0, back.runs));
    assert_eq!(e.host.stats().in_use, 0);
    for (i, (&p, &n)) in ptrs.iter().zip(&sizes).enumerate() {
        let seed = if i == 2 { 42 } else { i as u64 };
        check(&e.backend, p, n, seed, "onloaded");
    }
    check(&e.backend, other, MIB, 99, "tag 2");
    // Onloading what is already on the device moves nothing.
    assert_eq!(e.alloc.onload(1, S0).unwrap().runs, 0);
}

/// Freed while offloaded, host pages go back to the host pool (not the device's), and growth
/// of another tag never maps them: new allocations land on device pages.
#[test]
fn host_pages_freed_while_offloaded_go_back_to_the_host_pool() {
    let e = env();
    let big = e.alloc.allocate_tagged(6 * MIB, S0, 1).unwrap();
    let small = e.alloc.allocate_tagged(1000, S0, 1).unwrap();
    e.alloc.offload(1, &e.host, S0).unwrap();
    let host_pages = e.host.stats().in_use;
    assert!(host_pages >= 4);
    e.alloc.deallocate(big, S0).unwrap();
    consistent(&e, "large freed while offloaded");
    // Another tag's growth recycles the cached run: its pages go home, device pages come.
    let p = e.alloc.allocate_tagged(6 * MIB, S0, 2).unwrap();
    consistent(&e, "another tag grew");
    assert_eq!(e.alloc.spill_stats(Some(2)).tiers.host, 0);
    fill(&e.backend, p, 6 * MIB, 5);
    check(&e.backend, p, 6 * MIB, 5, "new allocation");
    e.alloc.deallocate(small, S0).unwrap();
    e.alloc.deallocate(p, S0).unwrap();
    e.alloc.empty_cache().unwrap();
    consistent(&e, "emptied");
    assert_eq!(e.host.stats().in_use, 0);
    assert_eq!(e.device.stats().in_use, 0);
}

/// With overflow on, a tag's allocation succeeds on host pages once the device is full (other
/// tags still get out-of-memory); onload moves them to the device when it has room.
#[test]
fn overflow_serves_a_full_device_from_host_pages() {
    let e = env();
    e.alloc.set_overflow(1, Some(Arc::clone(&e.host))).unwrap();
    // Fill the device (32 pages) with tag 2.
    let mut hog = Vec::new();
    while let Ok(p) = e.alloc.allocate_tagged(8 * MIB, S0, 2) {
        hog.push(p);
    }
    assert!(hog.len() >= 3);
    assert!(e
        .alloc
        .allocate_tagged(6 * MIB, S0, 3)
        .unwrap_err()
        .is_out_of_memory());
    let small = e.alloc.allocate_tagged(4000, S0, 1).unwrap();
    let big = e.alloc.allocate_tagged(6 * MIB, S0, 1).unwrap();
    fill(&e.backend, small, 4000, 1);
    fill(&e.backend, big, 6 * MIB, 2);
    consistent(&e, "overflowed");
    let t = e.alloc.spill_stats(Some(1)).tiers;
    assert_eq!(t.local, 0);
    assert!(t.host >= 6 * MIB + PAGE);
    check(&e.backend, big, 6 * MIB, 2, "on host pages");
    // Not enough room yet: onload fails and leaves what it could not move where it is.
    assert!(e.alloc.onload(1, S0).unwrap_err().is_out_of_memory());
    consistent(&e, "onload without room");
    for p in hog.drain(..) {
        e.alloc.deallocate(p, S0).unwrap();
    }
    e.alloc.empty_cache().unwrap();
    e.alloc.onload(1, S0).unwrap();
    consistent(&e, "onloaded");
    assert_eq!(e.alloc.spill_stats(Some(1)).tiers.host, 0);
    check(&e.backend, small, 4000, 1, "onloaded");
    check(&e.backend, big, 6 * MIB, 2, "onloaded");
    assert_eq!(e.host.stats().in_use, 0);
    // Off again: a full device is out of memory for the tag too.
    e.alloc.set_overflow(1, None).unwrap();
}

#[test]
fn bad_offloads_are_errors_that_change_nothing() {
    let e = env();
    let p = e.alloc.allocate_tagged(MIB, S0, 1).unwrap();
    fill(&e.backend, p, MIB, 1);
    // A pool for another device's pages.
    let b2 = strata_vmm::host::open(HostConfig {
        devices: vec![8 * PAGE, 8 * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let foreign = PagePool::new_host(b2, 1, manual()).unwrap();
    assert!(matches!(
        e.alloc.offload(1, &foreign, S0),
        Err(Error::InvalidArgument(_))
    ));
    e.alloc.sleep(1, true).unwrap();
    assert!(matches!(
        e.alloc.offload(1, &e.host, S0),
        Err(Error::InvalidState(_))
    ));
    e.alloc.wake(1).unwrap();
    assert_eq!(
        e.alloc.offload(7, &e.host, S0).unwrap().runs,
        0,
        "unused tag"
    );
    check(&e.backend, p, MIB, 1, "after refusals");
    consistent(&e, "after refusals");
}

/// Allocations, frees, writes, offloads and onloads of three tags at random, tag 1 overflowing
/// onto host memory and tag 2 onto the peer's pages when the device is full (tag 3 fills it),
/// revocations of the peer's pages, a fault armed at a random step of some migrations (create,
/// map, set_access, copy, unmap: a page whose unmap failed is quarantined and its VA never
/// handed out again), a limit set and lifted at random; after every step every live
/// allocation reads back its pattern through the same pointer, the invariants hold, every page
/// is counted by the pool it came from, and the device's own pages stay under the limit (or
/// at what they were when it was set below them).
#[test]
fn random_walk_of_allocations_and_offloads_keeps_every_byte() {
    let e = env();
    let mut rng = rand::rngs::StdRng::seed_from_u64(18);
    let ops = [
        FaultOp::Create,
        FaultOp::Map,
        FaultOp::SetAccess,
        FaultOp::Copy,
        FaultOp::Unmap,
    ];
    // (ptr, size, seed, tag)
    let mut live: Vec<(u64, u64, u64, TagId)> = Vec::new();
    let mut faults = 0;
    let mut revoked = 0;
    let mut limited = 0;
    // Most device bytes allowed while a limit is set.
    let mut ceiling: Option<u64> = None;
    e.alloc.set_overflow(1, Some(Arc::clone(&e.host))).unwrap();
    for step in 0..120u64 {
        let when = format!("step {step}");
        match rng.random_range(0..10) {
            0..=3 => {
                let tag = rng.random_range(1..=3);
                let size = if rng.random_bool(0.75) {
                    rng.random_range(1..64 << 10)
                } else {
                    rng.random_range(MIB..3 * MIB)
                };
                match e.alloc.allocate_tagged(size, S0, tag) {
                    Ok(p) => {
                        fill(&e.backend, p, size, step);
                        live.push((p, size, step, tag));
                    }
                    Err(Error::LimitExceeded { .. }) => limited += 1,
                    Err(Error::OutOfMemory { .. }) => {}
                    Err(err) => panic!("{when}: {err}"),
                }
            }
            4..=5 if !live.is_empty() => {
                let (p, _, _, _) = live.swap_remove(rng.random_range(0..live.len()));
                e.alloc.deallocate(p, S0).unwrap();
            }
            6 if rng.random_bool(0.5) => {
                // Tag 3 fills the device; tag 2 (re)gets its peer overflow and allocates there.
                e.alloc.set_overflow(2, Some(Arc::clone(&e.peer))).unwrap();
                for hog in [12 * MIB, 2 * MIB, 2 * MIB] {
                    while let Ok(p) = e.alloc.allocate_tagged(hog, S0, 3) {
                        fill(&e.backend, p, 4096, step);
                        live.push((p, 4096, step, 3));
                    }
                }
                let size = rng.random_range(1..3 * MIB);
                let p = e.alloc.allocate_tagged(size, S0, 2).unwrap();
                fill(&e.backend, p, size, step);
                live.push((p, size, step, 2));
            }
            7 if rng.random_bool(0.3) => {
                let armed = rng.random_bool(0.3);
                if armed {
                    let op = ops[rng.random_range(0..ops.len())];
                    injector(&e.backend).inject_fault(op, rng.random_range(1..6));
                }
                let got = e.alloc.revoke(&e.peer, &e.host, S0);
                injector(&e.backend).clear_faults();
                match got {
                    Ok(_) => assert_eq!(e.peer.stats().in_use, 0, "{when}: all given back"),
                    Err(Error::InjectedFault(_)) if armed => faults += 1,
                    Err(err) => panic!("{when}: {err}"),
                }
                let notices = e.alloc.take_revoked();
                assert!(notices.iter().all(|r| r.tag == 2), "{when}");
                revoked += notices.len();
            }
            8 if rng.random_bool(0.5) => {
                let limit = rng
                    .random_bool(0.7)
                    .then(|| rng.random_range(4..=32) * PAGE);
                e.alloc.set_limit(limit).unwrap();
                let held = e.alloc.spill_stats(None).tiers.local;
                ceiling = limit.map(|l| l.max(held));
            }
            8 if !live.is_empty() => {
                let k = rng.random_range(0..live.len());
                fill(&e.backend, live[k].0, live[k].1, step);
                live[k].2 = step;
            }
            _ => {
                let tag = rng.random_range(1..=3);
                let armed = rng.random_bool(0.6);
                if armed {
                    let op = ops[rng.random_range(0..ops.len())];
                    injector(&e.backend).inject_fault(op, rng.random_range(1..6));
                }
                let got = if rng.random_bool(0.5) {
                    e.alloc.offload(tag, &e.host, S0)
                } else {
                    e.alloc.onload(tag, S0)
                };
                injector(&e.backend).clear_faults();
                match got {
                    Ok(_) => {}
                    Err(Error::InjectedFault(_)) if armed => faults += 1,
                    Err(Error::LimitExceeded { .. }) => limited += 1,
                    Err(Error::OutOfMemory { .. }) => {}
                    Err(err) => panic!("{when}: {err}"),
                }
            }
        }
        strata_vmm::check_deferred().unwrap();
        for &(p, n, seed, _) in &live {
            check(&e.backend, p, n, seed, &when);
        }
        consistent(&e, &when);
        if let Some(most) = ceiling {
            let held = e.alloc.spill_stats(None).tiers.local;
            assert!(held <= most, "{when}: {held} device bytes, limit {most}");
        }
    }
    assert!(faults >= 3, "faults hit migrations: {faults}");
    assert!(limited > 0, "the limit refused something");
    e.alloc.set_limit(None).unwrap();
    assert!(revoked > 0, "revocations moved segments");
    // Room on the device for what is left, then everything back.
    for &(p, _, _, tag) in &live {
        if tag == 3 {
            e.alloc.deallocate(p, S0).unwrap();
        }
    }
    live.retain(|l| l.3 != 3);
    while live.iter().map(|l| l.1).sum::<u64>() > 8 * MIB {
        e.alloc.deallocate(live.pop().unwrap().0, S0).unwrap();
    }
    e.alloc.empty_cache().unwrap();
    e.alloc.revoke(&e.peer, &e.host, S0).unwrap();
    for tag in 1..=3 {
        e.alloc.onload(tag, S0).unwrap();
    }
    for &(p, n, seed, _) in &live {
        check(&e.backend, p, n, seed, "all onloaded");
    }
    assert_eq!(e.host.stats().in_use, 0);
    let c = e.alloc.spill_stats(None).counts;
    assert!(c.to_host > 0 && c.to_device > 0, "{c:?}");
}

/// A tag overflows onto a peer's pages; the lender takes them back: each segment moves to the
/// device while it has room, then to host memory, at the same addresses with its bytes, the
/// lender gets every page back, and each move is noticed exactly once.
#[test]
fn revoked_peer_pages_move_to_the_device_then_to_host_memory() {
    let backend = strata_vmm::host::open(HostConfig {
        devices: vec![16 * PAGE, 16 * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .expect("host backend");
    let device = PagePool::new(Arc::clone(&backend), 0, manual()).unwrap();
    let peer = PagePool::new(Arc::clone(&backend), 1, manual()).unwrap();
    let host = PagePool::new_host(Arc::clone(&backend), 0, manual()).unwrap();
    let alloc = CachingAllocator::new(Arc::clone(&device), CachingConfig::default()).unwrap();
    alloc.set_overflow(1, Some(Arc::clone(&peer))).unwrap();
    let mut hog = Vec::new();
    while let Ok(p) = alloc.allocate_tagged(2 * MIB, S0, 2) {
        hog.push(p);
    }
    let mut live = Vec::new();
    for (i, size) in [4 * MIB, 3000, 6 * MIB, 2 * MIB].into_iter().enumerate() {
        let p = alloc.allocate_tagged(size, S0, 1).unwrap();
        fill(&backend, p, size, 50 + i as u64);
        live.push((p, size, 50 + i as u64));
    }
    let lent = alloc.spill_stats(Some(1)).tiers.peer;
    assert!(lent >= 12 * MIB, "{lent}");
    assert_eq!(peer.stats().in_use as u64 * PAGE, lent);
    // Room on the device for one segment or two, not all.
    for p in hog.drain(..3) {
        alloc.deallocate(p, S0).unwrap();
    }
    alloc.empty_cache().unwrap();
    let moved = alloc.revoke(&peer, &host, S0).unwrap();
    assert!(alloc.check_invariants().is_ok(), "{}", alloc.report());
    for &(p, n, seed) in &live {
        check(&backend, p, n, seed, "revoked");
    }
    let p = peer.stats();
    assert_eq!(
        (p.in_use, p.free > 0),
        (0, true),
        "every lent page back with the lender"
    );
    let t = alloc.spill_stats(Some(1)).tiers;
    assert_eq!(t.peer, 0);
    assert!(
        t.local + t.host <= lent,
        "cached free memory given back, the rest moved"
    );
    assert!(t.local > 0 && t.host > 0, "{t:?}");
    let notices = alloc.take_revoked();
    assert_eq!(notices.len(), moved);
    assert_eq!(
        notices.iter().map(|r| r.bytes).sum::<u64>(),
        t.local + t.host
    );
    assert!(notices
        .iter()
        .all(|r| r.tag == 1 && r.from == strata_vmm::Location::Device(1)));
    assert!(alloc.take_revoked().is_empty(), "each notice once");
    // The tag no longer overflows onto the lender.
    assert!(alloc.allocate_tagged(8 * MIB, S0, 1).is_err());
    assert_eq!(peer.stats().in_use, 0);
}

/// A page whose unmap failed while the cache was emptied may still be mapped: it is
/// quarantined and its VA is never handed out again, so later allocations (which would land
/// on it first) map elsewhere and keep their bytes.
#[test]
fn a_page_whose_unmap_failed_keeps_its_va_out_of_later_allocations() {
    let e = env();
    let p = e.alloc.allocate_tagged(8 * MIB, S0, 1).unwrap();
    e.alloc.deallocate(p, S0).unwrap();
    injector(&e.backend).inject_fault(FaultOp::Unmap, 1);
    let emptied = e.alloc.empty_cache();
    injector(&e.backend).clear_faults();
    assert!(
        matches!(emptied, Err(Error::InjectedFault(_))),
        "{emptied:?}"
    );
    strata_vmm::check_deferred().ok();
    assert_eq!(e.device.stats().quarantined, 1);
    let mut held = Vec::new();
    for step in 0u64.. {
        match e.alloc.allocate_tagged(PAGE, S0, 1) {
            Ok(q) => {
                fill(&e.backend, q, PAGE, step);
                held.push((q, step));
            }
            Err(Error::OutOfMemory { .. } | Error::LimitExceeded { .. }) => break,
            Err(err) => panic!("allocation {step} after the failed unmap: {err}"),
        }
    }
    assert!(
        held.len() >= 4,
        "the device still serves allocations: {}",
        held.len()
    );
    for &(q, seed) in &held {
        check(&e.backend, q, PAGE, seed, "after the failed unmap");
    }
    e.alloc.check_invariants().unwrap();
    for (q, _) in held {
        e.alloc.deallocate(q, S0).unwrap();
    }
}

/// A retired tag id starts clean for its next name: no migrations of the previous name in its
/// spill stats, and no overflow setting (a full device is out of memory for it again).
#[test]
fn a_retired_tag_forgets_its_migrations_and_its_overflow() {
    let e = env();
    e.alloc.set_overflow(1, Some(Arc::clone(&e.host))).unwrap();
    let p = e.alloc.allocate_tagged(4 * MIB, S0, 1).unwrap();
    e.alloc.offload(1, &e.host, S0).unwrap();
    e.alloc.onload(1, S0).unwrap();
    let used = e.alloc.spill_stats(Some(1)).counts;
    assert!(used.to_host > 0 && used.to_device > 0, "{used:?}");
    e.alloc.deallocate(p, S0).unwrap();
    assert!(e.alloc.retire_tag(1));
    assert_eq!(
        e.alloc.spill_stats(Some(1)).counts,
        strata_allocator::SpillCounts::default(),
        "the next name of id 1 moved nothing yet"
    );
    assert_eq!(
        e.alloc.spill_stats(None).counts,
        used,
        "the allocator's totals keep every migration"
    );
    let mut hog = Vec::new();
    while let Ok(q) = e.alloc.allocate_tagged(8 * MIB, S0, 2) {
        hog.push(q);
    }
    let refused = e.alloc.allocate_tagged(4 * MIB, S0, 1).unwrap_err();
    assert!(refused.is_out_of_memory(), "{refused}");
    assert_eq!(e.host.stats().in_use, 0, "nothing overflowed");
    consistent(&e, "retired");
}
