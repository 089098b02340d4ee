//! The runtime on the strict host backend: the allocator and Harvest share each device's pool,
//! a lent page is counted once, and pages idle in a pool are lent before new ones are created.

use std::sync::Arc;

use strata_allocator::{CachingConfig, PageLease, PoolConfig};
use strata_runtime::{Runtime, RuntimeConfig};
use strata_tiers::harvest::{HarvestHints, PeerLimits};
use strata_tiers::Durability;
use strata_vmm::{Backend, Error, HostConfig, StreamHandle};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

fn backend(devices: &[u64]) -> Arc<dyn Backend> {
    strata_vmm::host::open(HostConfig {
        devices: devices.to_vec(),
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap()
}

fn runtime(b: &Arc<dyn Backend>) -> Runtime {
    let config = RuntimeConfig {
        pool: PoolConfig {
            low_watermark: 0,
            high_watermark: 64,
            limit: None,
            idle_trim_after: None,
            background: false,
        },
        caching: CachingConfig::default(),
    };
    Runtime::new(Arc::clone(b), config)
}

#[test]
fn allocator_and_harvest_draw_on_one_pool_and_count_a_lent_page_once() {
    let b = backend(&[64 * MIB, 64 * MIB]);
    let rt = runtime(&b);
    let ptr = rt
        .allocator(1)
        .unwrap()
        .allocate(8 * MIB, StreamHandle::DEFAULT)
        .unwrap();
    let pool1 = Arc::clone(rt.device(1).unwrap().pool().unwrap());
    let harvest = rt.harvest().unwrap();
    assert!(Arc::ptr_eq(harvest.pool(1).unwrap(), &pool1), "one pool");
    let mapped = rt.allocator(1).unwrap().stats().mapped_pages as usize;
    assert_eq!(pool1.stats().in_use, mapped);

    let mut hints = HarvestHints::new(0, Durability::Backed);
    hints.preferred = vec![1];
    let h = harvest.harvest_alloc(6 * MIB, &hints).unwrap();
    assert_eq!(h.device, 1);
    let (lender, requester) = (pool1.stats(), rt.device(0).unwrap().pool().unwrap().stats());
    assert_eq!((lender.in_use, lender.lent), (mapped + 3, 3));
    assert_eq!((requester.in_use, requester.borrowed), (0, 3));

    harvest.harvest_free(&h).unwrap();
    let (lender, requester) = (pool1.stats(), rt.device(0).unwrap().pool().unwrap().stats());
    assert_eq!(
        (lender.in_use, lender.lent, requester.borrowed),
        (mapped, 0, 0)
    );
    rt.allocator(1)
        .unwrap()
        .deallocate(ptr, StreamHandle::DEFAULT)
        .unwrap();
    let s = rt.device(1).unwrap().stats();
    assert_eq!(
        s.pool.unwrap().in_use as u64,
        s.allocator.unwrap().mapped_pages
    );
}

#[test]
fn idle_pool_pages_are_lent_first_and_count_as_free_for_the_reserve() {
    let b = backend(&[64 * MIB, 64 * MIB]);
    let rt = runtime(&b);
    let pool1 = Arc::clone(rt.device(1).unwrap().pool().unwrap());
    // 16 pages idle in device 1's pool (as after a user gave them back): 32 MiB of the device.
    drop(PageLease::take(&pool1, 16).unwrap());
    assert_eq!(b.mem_info(1).unwrap().free, 32 * MIB);
    let harvest = rt.harvest().unwrap();
    // The owner keeps 40 MiB: 32 MiB free on the device + 32 MiB idle in its pool leave 24.
    harvest
        .set_limits(
            1,
            PeerLimits {
                reserve: 40 * MIB,
                quota: u64::MAX,
            },
        )
        .unwrap();
    assert_eq!(harvest.capacity(1).unwrap().harvestable, 24 * MIB);
    let hints = HarvestHints::new(0, Durability::Lossy);
    let h = harvest.harvest_alloc(16 * MIB, &hints).unwrap();
    assert_eq!(h.device, 1);
    let s = pool1.stats();
    assert_eq!(
        s.created_total, 16,
        "the idle pages were lent, none created"
    );
    assert_eq!((s.lent, s.free), (8, 8));
    assert_eq!(harvest.capacity(1).unwrap().harvestable, 8 * MIB);
    let err = harvest.harvest_alloc(10 * MIB, &hints).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    harvest.harvest_free(&h).unwrap();
}

#[test]
fn devices_are_validated_and_created_on_first_use() {
    let b = backend(&[64 * MIB, 64 * MIB]);
    let rt = runtime(&b);
    assert_eq!(rt.device_count(), 2);
    assert!(matches!(rt.device(2), Err(Error::NoDevice(2))));
    assert!(matches!(rt.device(-1), Err(Error::NoDevice(-1))));
    let d0 = rt.device(0).unwrap();
    assert!(d0.existing_pool().is_none() && d0.existing_allocator().is_none());
    assert!(rt.existing_harvest().is_none());
    let ptr = rt
        .allocator(0)
        .unwrap()
        .allocate(4096, StreamHandle::DEFAULT)
        .unwrap();
    assert_eq!(rt.device_of(ptr), Some(0));
    assert!(rt.device(1).unwrap().existing_pool().is_none());
    assert_eq!(rt.existing_all().count(), 1);
    rt.allocator(0)
        .unwrap()
        .deallocate(ptr, StreamHandle::DEFAULT)
        .unwrap();
}

/// An allocator configured on creation (`allocator_with`) is reachable by no one until its
/// `init` succeeded: another thread sees no allocator meanwhile, and a failed `init` leaves none
/// behind, so the next call creates and configures one again. (The C ABI applies sleeping tags
/// there: a thread that reached the allocator before could allocate under a sleeping tag.)
#[test]
fn an_allocator_is_published_only_once_its_init_succeeded() {
    let b = backend(&[64 * MIB]);
    let rt = runtime(&b);
    let d = rt.device(0).unwrap();
    let failed = d.allocator_with(|a| {
        assert!(a.stats().live_allocations == 0);
        std::thread::scope(|s| {
            let seen = s.spawn(|| rt.existing(0).is_some()).join().unwrap();
            assert!(!seen, "another thread reached the allocator during init");
        });
        assert!(d.host_pool().is_ok(), "init may create the host pool");
        Err(Error::InvalidState("init refused".into()))
    });
    assert!(matches!(failed, Err(Error::InvalidState(_))));
    assert!(d.existing_allocator().is_none() && rt.existing_all().count() == 0);
    let mut ran = false;
    let a = d
        .allocator_with(|_| {
            ran = true;
            Ok(())
        })
        .unwrap();
    assert!(ran, "created again, with its init");
    assert!(std::ptr::eq(a, rt.existing(0).unwrap()));
    let again = d
        .allocator_with(|_| panic!("init runs only on creation"))
        .unwrap();
    assert!(std::ptr::eq(a, again));
}
