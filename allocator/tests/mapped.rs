//! `PageLease` and `MappedRun` on the strict host backend: all or nothing under injected
//! faults, pages and pool counters back on drop, one `set_access` per run.

use std::sync::Arc;

use strata_allocator::{MappedRun, PageLease, PagePool, PoolConfig, Return};
use strata_vmm::{host::FaultOp, Access, Backend, HostBackend, HostConfig, Location, Reservation};

const PAGE: u64 = 2 << 20;

fn backend(pages: u64) -> Arc<dyn Backend> {
    strata_vmm::host::open(HostConfig {
        devices: vec![pages * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap()
}

fn host(b: &Arc<dyn Backend>) -> &HostBackend {
    b.as_any().downcast_ref::<HostBackend>().unwrap()
}

fn pool(b: &Arc<dyn Backend>) -> Arc<PagePool> {
    let config = PoolConfig {
        low_watermark: 0,
        high_watermark: 64,
        limit: None,
        idle_trim_after: None,
        background: false,
    };
    PagePool::new(Arc::clone(b), 0, config).unwrap()
}

const RW: [(Location, Access); 1] = [(Location::Device(0), Access::ReadWrite)];

#[test]
fn a_run_maps_reads_back_and_returns_its_pages_on_drop() {
    let b = backend(16);
    let pool = pool(&b);
    let res = Arc::new(Reservation::new(&b, 8 * PAGE, 0).unwrap());
    let va = res.ptr() + PAGE;
    let run = MappedRun::take(&pool, &res, va, 4, &RW).unwrap();
    assert_eq!((run.va(), run.size(), run.len()), (va, 4 * PAGE, 4));
    assert_eq!(pool.stats().in_use, 4);
    b.write(va + 3 * PAGE, b"last page").unwrap();
    let mut back = [0u8; 9];
    b.read(va + 3 * PAGE, &mut back).unwrap();
    assert_eq!(&back, b"last page");
    let live = b.live_counts();
    drop(run);
    let s = pool.stats();
    assert_eq!((s.in_use, s.free), (0, 4), "pages back on the free list");
    assert!(b.live_counts().mappings < live.mappings, "unmapped");
    // The range is unmapped: it maps again.
    let again = MappedRun::take(&pool, &res, va, 4, &RW).unwrap();
    assert_eq!(pool.stats().created_total, 4, "reused, not created");
    drop(again.returning(Return::Release));
    let s = pool.stats();
    assert_eq!((s.in_use, s.free, s.released_total), (0, 0, 4));
}

#[test]
fn a_failed_map_or_set_access_leaves_the_pool_as_it_was() {
    for (op, nth) in [
        (FaultOp::Map, 1),
        (FaultOp::Map, 3),
        (FaultOp::SetAccess, 1),
        (FaultOp::Create, 2),
    ] {
        let b = backend(16);
        let pool = pool(&b);
        let res = Arc::new(Reservation::new(&b, 4 * PAGE, 0).unwrap());
        let baseline = b.live_counts();
        host(&b).inject_fault(op, nth);
        let err = MappedRun::take(&pool, &res, res.ptr(), 4, &RW).unwrap_err();
        assert!(
            matches!(err, strata_vmm::Error::InjectedFault(_)),
            "{op:?} #{nth}: {err}"
        );
        let s = pool.stats();
        assert_eq!(s.in_use, 0, "{op:?} #{nth}: every page counted back");
        assert_eq!(
            s.free as u64 + s.released_total,
            s.created_total,
            "{op:?} #{nth}: every created page is free or released"
        );
        assert_eq!(
            b.live_counts().mappings,
            baseline.mappings,
            "{op:?} #{nth}: nothing left mapped"
        );
        // The whole range maps afterwards.
        MappedRun::take(&pool, &res, res.ptr(), 4, &RW).unwrap();
    }
}

#[test]
fn a_run_outside_its_reservation_is_refused_and_returns_the_pages() {
    let b = backend(16);
    let pool = pool(&b);
    let res = Arc::new(Reservation::new(&b, 2 * PAGE, 0).unwrap());
    let err = MappedRun::take(&pool, &res, res.ptr() + PAGE, 2, &RW).unwrap_err();
    assert!(
        matches!(err, strata_vmm::Error::NotReserved { .. }),
        "{err}"
    );
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn handed_over_pages_stay_mapped_and_counted() {
    let b = backend(16);
    let pool = pool(&b);
    let res = Arc::new(Reservation::new(&b, 2 * PAGE, 0).unwrap());
    let pages = MappedRun::take(&pool, &res, res.ptr(), 2, &RW)
        .unwrap()
        .into_mapped_pages();
    assert_eq!(pool.stats().in_use, 2);
    b.write(res.ptr() + PAGE, b"still mapped").unwrap();
    let unmapped: Vec<_> = pages
        .into_iter()
        .map(|mp| {
            mp.mapping.unmap().unwrap();
            mp.page
        })
        .collect();
    // A lease of those pages gives them back when it drops.
    drop(PageLease::from_pages(&pool, unmapped));
    assert_eq!((pool.stats().in_use, pool.stats().free), (0, 2));
}

#[test]
fn unmap_hands_the_pages_over_and_a_lease_releases_on_request() {
    let b = backend(16);
    let pool = pool(&b);
    let res = Arc::new(Reservation::new(&b, 3 * PAGE, 0).unwrap());
    let run = MappedRun::take(&pool, &res, res.ptr(), 3, &RW).unwrap();
    let pages = run.unmap().unwrap();
    assert_eq!((pages.len(), pool.stats().in_use), (3, 3));
    let free_before = b.mem_info(0).unwrap().free;
    drop(PageLease::from_pages(&pool, pages).returning(Return::Release));
    assert_eq!(pool.stats().in_use, 0);
    assert_eq!(b.mem_info(0).unwrap().free, free_before + 3 * PAGE);
}

#[test]
fn lent_pages_are_counted_once_while_lent() {
    let b = strata_vmm::host::open(HostConfig {
        devices: vec![16 * PAGE, 16 * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let lender = pool(&b);
    let config = lender.config().clone();
    let requester = PagePool::new(Arc::clone(&b), 1, config).unwrap();
    let res = Arc::new(Reservation::new(&b, 3 * PAGE, 0).unwrap());
    let lease = PageLease::lend(&lender, 3).unwrap();
    let run = MappedRun::map(lease, &res, res.ptr(), &RW).unwrap();
    let mut view = PageLease::empty(&requester);
    for p in run.pages() {
        let phys = Arc::clone(p.phys());
        let source = strata_allocator::PageSource::Borrowed { lender: 0 };
        view.push(requester.adopt(phys, source).unwrap());
    }
    let (l, r) = (lender.stats(), requester.stats());
    assert_eq!((l.in_use, l.lent, l.borrowed), (3, 3, 0));
    assert_eq!((r.in_use, r.borrowed, r.held_bytes()), (0, 3, 0));
    drop(view.returning(Return::Release));
    drop(run.returning(Return::Release));
    let (l, r) = (lender.stats(), requester.stats());
    assert_eq!((l.in_use, l.lent, r.borrowed, r.in_use), (0, 0, 0, 0));
    assert_eq!(l.released_total, 3);
}
