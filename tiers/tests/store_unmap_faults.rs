//! A page whose unmap fails may still be mapped, so the tier store quarantines it, as the
//! caching allocator does: never handed back as free, never released (not when the store is
//! dropped, not when a revocation returns pages to the lender), and the store's address range
//! under it stays reserved. Apart from `store.rs` because the failure is recorded
//! process-wide for the next fallible call.

mod common;

use std::sync::{Arc, Mutex};

use strata_allocator::PagePool;
use strata_tiers::{Durability, StoreConfig, TierStore};
use strata_vmm::host::FaultOp;
use strata_vmm::{Backend, Error, HostBackend, HostConfig};

use common::BLOCK;

const PAGE: u64 = 2 << 20;

/// The recorded error is process-wide: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn setup(hbm_pages: u64) -> (Arc<dyn Backend>, Arc<PagePool>, TierStore) {
    let b = strata_vmm::host::open(HostConfig {
        devices: vec![64 << 20],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let pool = common::pool(&b);
    let store = TierStore::new(
        Arc::clone(&pool),
        StoreConfig::new(BLOCK, hbm_pages * PAGE, 64 * BLOCK),
    )
    .unwrap();
    (b, pool, store)
}

fn host(b: &Arc<dyn Backend>) -> &HostBackend {
    b.as_any().downcast_ref::<HostBackend>().unwrap()
}

fn take_recorded_unmap_fault() {
    match strata_vmm::check_deferred() {
        Err(Error::Deferred(e)) => assert!(matches!(*e, Error::InjectedFault("unmap")), "{e}"),
        other => panic!("expected the recorded unmap fault, got {other:?}"),
    }
}

#[test]
fn a_dropped_store_quarantines_a_page_whose_unmap_failed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (b, pool, store) = setup(3);
    assert_eq!(pool.stats().in_use, 3);
    let mappings = b.live_counts().mappings;
    host(&b).inject_fault(FaultOp::Unmap, 2);
    drop(store);
    take_recorded_unmap_fault();
    let s = pool.stats();
    assert_eq!((s.in_use, s.free), (0, 2), "the failed page is not free");
    assert_eq!((s.quarantined, s.released_total), (1, 0), "nor released");
    assert_eq!(b.live_counts().mappings, mappings - 2);
}

#[test]
fn a_revocation_hands_on_only_the_pages_it_unmapped() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (b, pool, store) = setup(3);
    for i in 0..40 {
        store
            .put(&vec![i as u8; BLOCK as usize], Durability::Backed, 0)
            .unwrap();
    }
    host(&b).inject_fault(FaultOp::Unmap, 1);
    let r = store.revoke_pages(&[0, 1]).unwrap();
    take_recorded_unmap_fault();
    assert_eq!(r.pages.len(), 1, "the page still mapped is not handed on");
    let s = pool.stats();
    assert_eq!((s.quarantined, s.released_total), (1, 0), "nor released");
    store.check_invariants().unwrap();
    pool.give(r.pages);
    let mappings = b.live_counts().mappings;
    drop(store);
    // The page that failed to unmap keeps its mapping, and so the store's address range: no
    // range is freed while mapped.
    strata_vmm::check_deferred().unwrap();
    assert_eq!(
        b.live_counts().mappings,
        1,
        "of {mappings}, the stuck one stays"
    );
    assert_eq!(pool.stats().in_use, 0);
}
