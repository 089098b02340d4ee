//! A KV page whose unmap fails may still be mapped, so the KV space quarantines it, as the
//! caching allocator and the tier store do: never given back to the free list, never released
//! (not on a shrink, not when the space is dropped). Apart from `kv_space.rs` because the
//! failure of a drop is recorded process-wide for the next fallible call.

mod kv_common;

use std::sync::{Arc, Mutex};

use kv_common::pool_config;
use strata_allocator::{KvConfig, KvSpace, PagePool};
use strata_vmm::host::FaultOp;
use strata_vmm::{Backend, Error, HostBackend, HostConfig};

const PAGE: u64 = 64 << 10;

/// The recorded error is process-wide: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// One layer (two tensors), two slots of four one-page tokens, no zero page.
fn setup() -> (Arc<dyn Backend>, Arc<PagePool>, KvSpace) {
    let b = strata_vmm::host::open(HostConfig {
        devices: vec![64 << 20],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let pool = PagePool::new(Arc::clone(&b), 0, pool_config(None, PAGE)).unwrap();
    let kv = KvConfig {
        layers: 1,
        max_slots: 2,
        max_tokens: 4,
        bytes_per_token: PAGE,
        zero_page: false,
    };
    let space = KvSpace::new(Arc::clone(&pool), kv).unwrap();
    (b, pool, space)
}

fn host(b: &Arc<dyn Backend>) -> &HostBackend {
    b.as_any().downcast_ref::<HostBackend>().unwrap()
}

#[test]
fn a_shrink_quarantines_a_kv_page_whose_unmap_failed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (b, pool, mut space) = setup();
    let a = space.admit().unwrap();
    space.grow(a, 4).unwrap();
    assert_eq!(pool.stats().in_use, 8);
    // Shrinking to one token unmaps pages 1..4 of both tensors: six unmaps, the second fails.
    host(&b).inject_fault(FaultOp::Unmap, 2);
    let err = space.shrink(a, 1).expect_err("injected");
    assert!(matches!(err, Error::InjectedFault("unmap")), "{err}");
    let s = pool.stats();
    assert_eq!((s.in_use, s.free), (2, 5), "the failed page is not free");
    assert_eq!((s.quarantined, s.released_total), (1, 0), "nor released");
    assert_eq!(space.stats().pages_mapped, 2);
    space.check_invariants().unwrap();
    // The other slot grows from the free pages, never the quarantined one.
    let other = space.admit().unwrap();
    space.grow(other, 4).unwrap();
    let s = pool.stats();
    assert_eq!((s.in_use, s.free, s.quarantined), (10, 0, 1), "{s:?}");
    assert_eq!(s.created_total, 11, "five pages reused, three created");
    space.check_invariants().unwrap();
    drop(space);
    strata_vmm::check_deferred().expect("the drop unmapped everything else");
    let s = pool.stats();
    assert_eq!((s.in_use, s.free, s.quarantined), (0, 10, 1));
}

#[test]
fn a_dropped_kv_space_quarantines_a_page_whose_unmap_failed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (b, pool, mut space) = setup();
    let a = space.admit().unwrap();
    space.grow(a, 3).unwrap();
    let mappings = b.live_counts().mappings;
    host(&b).inject_fault(FaultOp::Unmap, 4);
    drop(space);
    match strata_vmm::check_deferred() {
        Err(Error::Deferred(e)) => assert!(matches!(*e, Error::InjectedFault("unmap")), "{e}"),
        other => panic!("expected the recorded unmap fault, got {other:?}"),
    }
    let s = pool.stats();
    assert_eq!((s.in_use, s.free), (0, 5), "the failed page is not free");
    assert_eq!((s.quarantined, s.released_total), (1, 0), "nor released");
    assert_eq!(
        b.live_counts().mappings,
        mappings - 5,
        "its mapping is kept"
    );
}
