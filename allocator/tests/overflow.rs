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
