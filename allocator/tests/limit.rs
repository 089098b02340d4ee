//! The allocator's cap (`CachingConfig::limit`, `set_limit`: PyTorch's memory fraction) is on
//! the device's own memory: pages a tag overflowed or offloaded onto host memory or a peer do
//! not count against it, an overflowing tag goes on past it onto its overflow pool, and every
//! path that puts pages on the device (growth, onload, revocation) stays under it.

mod common;

use std::sync::Arc;

use common::*;
use strata_allocator::CachingConfig;
use strata_vmm::{Error, Location};

fn capped(pages: u64) -> Env {
    env_with(CachingConfig {
        limit: Some(pages * PAGE),
        ..CachingConfig::default()
    })
}

fn limit_exceeded<T: std::fmt::Debug>(got: Result<T, Error>) -> bool {
    matches!(got, Err(Error::LimitExceeded { .. }))
}

#[test]
fn an_overflowing_tag_goes_past_the_cap_onto_host_pages() {
    let e = capped(8);
    e.alloc.set_overflow(1, Some(Arc::clone(&e.host))).unwrap();
    let full = e.alloc.allocate_tagged(8 * PAGE, S0, 2).unwrap();
    assert!(limit_exceeded(e.alloc.allocate_tagged(4 * PAGE, S0, 3)));
    let big = e.alloc.allocate_tagged(4 * PAGE, S0, 1).unwrap();
    let small = e.alloc.allocate_tagged(1000, S0, 1).unwrap();
    fill(&e.backend, big, 4 * PAGE, 1);
    fill(&e.backend, small, 1000, 2);
    consistent(&e, "overflowed past the cap");
    let t = e.alloc.spill_stats(Some(1)).tiers;
    assert_eq!((t.local, t.host), (0, 5 * PAGE), "{t:?}");
    assert_eq!(e.device.stats().in_use, 8, "the device holds the cap");
    check(&e.backend, big, 4 * PAGE, 1, "on host pages");
    check(&e.backend, small, 1000, 2, "on host pages");
    for p in [full, big, small] {
        e.alloc.deallocate(p, S0).unwrap();
    }
}

#[test]
fn offloaded_pages_leave_room_under_the_cap_and_onload_stays_under_it() {
    let e = capped(8);
    let mine = e.alloc.allocate_tagged(8 * PAGE, S0, 1).unwrap();
    fill(&e.backend, mine, 8 * PAGE, 7);
    assert!(limit_exceeded(e.alloc.allocate_tagged(4 * PAGE, S0, 2)));
    e.alloc.offload(1, &e.host, S0).unwrap();
    // Tag 1's pages are host memory now: the cap has room for tag 2.
    let theirs = e.alloc.allocate_tagged(4 * PAGE, S0, 2).unwrap();
    consistent(&e, "offloaded");
    // Onloading 8 pages onto a device holding 4 of a cap of 8 would go past it.
    assert!(limit_exceeded(e.alloc.onload(1, S0)));
    consistent(&e, "onload refused");
    assert_eq!(e.alloc.spill_stats(Some(1)).tiers.host, 8 * PAGE);
    assert_eq!(e.device.stats().in_use, 4);
    check(&e.backend, mine, 8 * PAGE, 7, "left on host pages");
    e.alloc.deallocate(theirs, S0).unwrap();
    e.alloc.empty_cache().unwrap();
    e.alloc.onload(1, S0).unwrap();
    consistent(&e, "onloaded");
    assert_eq!(e.alloc.spill_stats(Some(1)).tiers.local, 8 * PAGE);
    check(&e.backend, mine, 8 * PAGE, 7, "onloaded");
    e.alloc.deallocate(mine, S0).unwrap();
}

#[test]
fn a_request_above_the_cap_fills_it_and_overflows_the_rest() {
    let e = capped(8);
    e.alloc.set_overflow(1, Some(Arc::clone(&e.host))).unwrap();
    assert!(limit_exceeded(e.alloc.allocate_tagged(12 * PAGE, S0, 2)));
    let p = e.alloc.allocate_tagged(12 * PAGE, S0, 1).unwrap();
    fill(&e.backend, p, 12 * PAGE, 3);
    consistent(&e, "split");
    let t = e.alloc.spill_stats(Some(1)).tiers;
    assert_eq!((t.local, t.host), (8 * PAGE, 4 * PAGE), "{t:?}");
    assert!(limit_exceeded(e.alloc.allocate_tagged(PAGE, S0, 2)));
    check(&e.backend, p, 12 * PAGE, 3, "split");
    e.alloc.deallocate(p, S0).unwrap();
    e.alloc.empty_cache().unwrap();
    assert_eq!((e.device.stats().in_use, e.host.stats().in_use), (0, 0));
}

/// A lender takes its pages back while the cap is full (the device itself has room): the
/// segments on them go to host memory, not onto the device past the cap.
#[test]
fn a_revocation_under_a_full_cap_moves_to_host_memory() {
    let e = capped(8);
    e.alloc.set_overflow(1, Some(Arc::clone(&e.peer))).unwrap();
    let full = e.alloc.allocate_tagged(8 * PAGE, S0, 2).unwrap();
    let lent = e.alloc.allocate_tagged(4 * PAGE, S0, 1).unwrap();
    fill(&e.backend, lent, 4 * PAGE, 9);
    assert_eq!(e.alloc.spill_stats(Some(1)).tiers.peer, 4 * PAGE);
    assert_eq!(e.alloc.revoke(&e.peer, &e.host, S0).unwrap(), 1);
    consistent(&e, "revoked");
    let notices = e.alloc.take_revoked();
    assert_eq!(notices.len(), 1);
    assert_eq!(notices[0].to, Location::Host);
    assert_eq!(e.device.stats().in_use, 8, "the cap holds");
    check(&e.backend, lent, 4 * PAGE, 9, "revoked");
    for p in [full, lent] {
        e.alloc.deallocate(p, S0).unwrap();
    }
}
