//! Requests larger than the device: with overflow on, what the device can still hold takes
//! part of it and the overflow pool the rest; without it, out of memory saying what was asked
//! and what the device could still give.

mod common;

use std::sync::Arc;

use common::*;
use strata_vmm::{Error, Location};

#[test]
fn a_request_larger_than_the_device_spills_its_excess_onto_host_pages() {
    let e = env();
    e.alloc.set_overflow(1, Some(Arc::clone(&e.host))).unwrap();
    let p = e.alloc.allocate_tagged(40 * PAGE, S0, 1).unwrap();
    fill(&e.backend, p, 40 * PAGE, 4);
    consistent(&e, "40 pages on a 32-page device");
    let t = e.alloc.spill_stats(Some(1)).tiers;
    assert_eq!(t.local + t.host, 40 * PAGE, "{t:?}");
    assert!(t.local > 0 && t.host >= 8 * PAGE, "{t:?}");
    check(&e.backend, p, 40 * PAGE, 4, "split");
    e.alloc.deallocate(p, S0).unwrap();
    e.alloc.empty_cache().unwrap();
    assert_eq!((e.device.stats().in_use, e.host.stats().in_use), (0, 0));
}

#[test]
fn a_request_larger_than_the_device_fits_the_device_and_a_peer_together() {
    let e = env();
    e.alloc.set_overflow(1, Some(Arc::clone(&e.peer))).unwrap();
    let p = e.alloc.allocate_tagged(40 * PAGE, S0, 1).unwrap();
    fill(&e.backend, p, 40 * PAGE, 5);
    consistent(&e, "40 pages on two 32-page devices");
    let t = e.alloc.spill_stats(Some(1)).tiers;
    assert_eq!((t.local, t.peer), (32 * PAGE, 8 * PAGE), "{t:?}");
    check(&e.backend, p, 40 * PAGE, 5, "split");
    e.alloc.deallocate(p, S0).unwrap();
}

#[test]
fn a_request_larger_than_both_is_out_of_memory_on_the_overflow_pool() {
    let e = env();
    e.alloc.set_overflow(1, Some(Arc::clone(&e.peer))).unwrap();
    let err = e.alloc.allocate_tagged(80 * PAGE, S0, 1).unwrap_err();
    match err {
        Error::OutOfMemory {
            location,
            requested,
            ..
        } => assert_eq!((location, requested), (Location::Device(1), 80 * PAGE)),
        other => panic!("{other}"),
    }
    consistent(&e, "refused");
    assert_eq!((e.device.stats().in_use, e.peer.stats().in_use), (0, 0));
}

/// Out of memory says what was asked and what the device could still give (its free memory,
/// the pool's free pages and the allocator's cached pages), not the largest free address range.
#[test]
fn out_of_memory_reports_what_the_device_could_still_give() {
    let e = env();
    let live = e.alloc.allocate_tagged(10 * PAGE, S0, 2).unwrap();
    let cached = e.alloc.allocate_tagged(2 * PAGE, S0, 2).unwrap();
    e.alloc.deallocate(cached, S0).unwrap();
    let err = e.alloc.allocate_tagged(40 * PAGE, S0, 1).unwrap_err();
    match err {
        Error::OutOfMemory {
            location,
            requested,
            available,
        } => {
            assert_eq!((location, requested), (Location::Device(0), 40 * PAGE));
            assert_eq!(
                available,
                22 * PAGE,
                "20 pages free on the device, 2 cached"
            );
        }
        other => panic!("{other}"),
    }
    e.alloc.deallocate(live, S0).unwrap();
}
