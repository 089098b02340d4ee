//! Host-memory pages and `MappedRun::migrate`: a run moves between device and host pages at
//! the same VA with its bytes intact, and an injected failure at any step leaves it exactly as
//! it was (old pages mapped with their grants, data intact, pool counters consistent).

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use strata_allocator::{MappedRun, PageLease, PagePool, PageSource, PoolConfig, Return};
use strata_vmm::host::FaultOp;
use strata_vmm::{
    Access, Backend, CreateFlags, Error, Event, HostBackend, HostConfig, Location, PhysicalMemory,
    Reservation, Stream, StreamHandle,
};

const PAGE: u64 = 2 << 20;
const D0: Location = Location::Device(0);
const RW: [(Location, Access); 1] = [(D0, Access::ReadWrite)];

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

fn manual() -> PoolConfig {
    PoolConfig {
        low_watermark: 0,
        high_watermark: 64,
        limit: None,
        idle_trim_after: None,
        background: false,
    }
}

/// A device pool and a host pool for device 0.
fn pools(b: &Arc<dyn Backend>) -> (Arc<PagePool>, Arc<PagePool>) {
    (
        PagePool::new(Arc::clone(b), 0, manual()).unwrap(),
        PagePool::new_host(Arc::clone(b), 0, manual()).unwrap(),
    )
}

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8)
        .collect()
}

fn read(b: &Arc<dyn Backend>, va: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    b.read(va, &mut out).unwrap();
    out
}

#[test]
fn host_pages_are_accounted_to_the_host_not_the_device() {
    let b = backend(8);
    let (device, hostp) = pools(&b);
    assert_eq!(hostp.location(), Location::Host);
    assert_eq!(device.location(), D0);
    let free = b.mem_info(0).unwrap().free;
    let pages = hostp.take(3).unwrap();
    assert_eq!(
        b.mem_info(0).unwrap().free,
        free,
        "device capacity untouched"
    );
    assert!(pages.iter().all(|p| p.phys().location() == Location::Host));
    hostp.release(pages);
    // More host pages than the device has: host memory is not bounded by device capacity.
    let many = hostp.take(12).unwrap();
    assert_eq!(b.mem_info(0).unwrap().free, free);
    hostp.release(many);
}

#[test]
fn a_run_moves_to_host_memory_and_back_at_the_same_address() {
    let b = backend(8);
    let (device, hostp) = pools(&b);
    let res = Arc::new(Reservation::new(&b, 8 * PAGE, 0).unwrap());
    let va = res.ptr() + PAGE;
    let mut run = MappedRun::take(&device, &res, va, 3, &RW).unwrap();
    let data = pattern(3 * PAGE, 1);
    b.write(va, &data).unwrap();
    let free = b.mem_info(0).unwrap().free;

    let moved = run
        .migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
        .unwrap();
    assert_eq!((moved.va, moved.bytes), (va, 3 * PAGE));
    assert_eq!((moved.from, moved.to), (D0, Location::Host));
    assert_eq!(run.va(), va);
    assert_eq!(run.pool().location(), Location::Host);
    assert!(run
        .pages()
        .iter()
        .all(|p| p.phys().location() == Location::Host));
    assert_eq!(
        read(&b, va, 3 * PAGE),
        data,
        "bytes identical on host pages"
    );
    assert_eq!((device.stats().in_use, device.stats().free), (0, 3));
    assert_eq!(hostp.stats().in_use, 3);
    device.trim(0);
    assert_eq!(b.mem_info(0).unwrap().free, free + 3 * PAGE, "HBM freed");

    // Still device-accessible: the device writes through the same pointer.
    b.write(va + PAGE + 5, b"on host").unwrap();
    let mut data = data;
    data[(PAGE + 5) as usize..(PAGE + 12) as usize].copy_from_slice(b"on host");

    let back = run
        .migrate(&device, StreamHandle::DEFAULT, &[], &RW)
        .unwrap();
    assert_eq!((back.from, back.to), (Location::Host, D0));
    assert_eq!(run.pool().location(), D0);
    assert_eq!(read(&b, va, 3 * PAGE), data);
    assert_eq!((hostp.stats().in_use, hostp.stats().free), (0, 3));
    let live = b.live_counts();
    drop(run);
    assert!(b.live_counts().mappings < live.mappings);
    assert_eq!(device.stats().in_use, 0);
}

#[test]
fn the_copy_waits_for_the_fences_it_is_given() {
    let b = backend(8);
    let (device, hostp) = pools(&b);
    let res = Arc::new(Reservation::new(&b, 2 * PAGE, 0).unwrap());
    let mut run = MappedRun::take(&device, &res, res.ptr(), 2, &RW).unwrap();
    let writer = Stream::new(&b, 0).unwrap();
    let mover = Stream::new(&b, 0).unwrap();
    b.memset_async(writer.handle(), res.ptr(), 0xAB, 2 * PAGE)
        .unwrap();
    let done = Event::new(&b).unwrap();
    done.record(writer.handle()).unwrap();
    run.migrate(&hostp, mover.handle(), &[&done], &RW).unwrap();
    assert!(read(&b, res.ptr(), 2 * PAGE).iter().all(|&x| x == 0xAB));
}

#[test]
fn a_run_moves_to_a_peer_devices_pages() {
    let b = strata_vmm::host::open(HostConfig {
        devices: vec![8 * PAGE, 8 * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let device = PagePool::new(Arc::clone(&b), 0, manual()).unwrap();
    let peer = PagePool::new(Arc::clone(&b), 1, manual()).unwrap();
    let res = Arc::new(Reservation::new(&b, 2 * PAGE, 0).unwrap());
    let mut run = MappedRun::take(&device, &res, res.ptr(), 2, &RW).unwrap();
    let data = pattern(2 * PAGE, 9);
    b.write(res.ptr(), &data).unwrap();
    run.migrate(&peer, StreamHandle::DEFAULT, &[], &RW).unwrap();
    assert!(run
        .pages()
        .iter()
        .all(|p| p.phys().location() == Location::Device(1)));
    assert_eq!(read(&b, res.ptr(), 2 * PAGE), data);
    assert_eq!(
        b.mem_info(1).unwrap().free,
        6 * PAGE,
        "the peer holds the pages"
    );
}

/// Every call of `op` a migration of `pages` pages makes (`calls` of them) fails in turn; the
/// call after the last one does not, and the migration then succeeds.
#[test]
fn a_failure_at_any_step_leaves_the_run_as_it_was() {
    const N: u64 = 3;
    for (op, calls) in [
        (FaultOp::Create, N),
        (FaultOp::Map, 2 * N),
        (FaultOp::SetAccess, 2),
        (FaultOp::Copy, 1),
    ] {
        for nth in 1..=calls + 1 {
            let b = backend(8);
            let (device, hostp) = pools(&b);
            let res = Arc::new(Reservation::new(&b, N * PAGE, 0).unwrap());
            let va = res.ptr();
            let mut run = MappedRun::take(&device, &res, va, N as usize, &RW).unwrap();
            let data = pattern(N * PAGE, nth);
            b.write(va, &data).unwrap();
            let live = b.live_counts();

            host(&b).inject_fault(op, nth);
            let got = run.migrate(&hostp, StreamHandle::DEFAULT, &[], &RW);
            host(&b).clear_faults();
            if nth > calls {
                got.unwrap_or_else(|e| panic!("{op:?} #{nth}: {e}"));
                assert_eq!(read(&b, va, N * PAGE), data);
                assert_eq!(run.pool().location(), Location::Host);
                continue;
            }
            let err = got.unwrap_err();
            assert!(
                matches!(err, Error::InjectedFault(_)),
                "{op:?} #{nth}: {err}"
            );
            strata_vmm::check_deferred().unwrap();
            assert_eq!(run.va(), va);
            assert_eq!(run.pool().location(), D0, "{op:?} #{nth}: old pages kept");
            assert_eq!(run.len(), N as usize);
            assert_eq!(read(&b, va, N * PAGE), data, "{op:?} #{nth}: data intact");
            assert_eq!(b.live_counts().mappings, live.mappings, "{op:?} #{nth}");
            assert_eq!(b.live_counts().reservations, live.reservations);
            let (d, h) = (device.stats(), hostp.stats());
            assert_eq!(d.in_use, N as usize, "{op:?} #{nth}");
            assert_eq!(h.in_use, 0, "{op:?} #{nth}: destination pages back");
            assert_eq!(h.free as u64 + h.released_total, h.created_total);
            // Writable with its grants, and the migration goes through afterwards.
            b.write(va + 7, b"after").unwrap();
            run.migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
                .unwrap();
            assert_eq!(&read(&b, va + 7, 5), b"after");
        }
    }
}

/// The staging mapping's unmaps (the first `N` unmap calls of a migration): when one refuses,
/// the run keeps its old pages and data, the staging pages that did unmap go back to the
/// destination pool, and the one still mapped is quarantined there: never reused, never
/// released, counted.
#[test]
fn a_failed_unmap_of_the_staging_pages_quarantines_that_page() {
    const N: u64 = 3;
    for nth in 1..=N {
        let b = backend(8);
        let (device, hostp) = pools(&b);
        let res = Arc::new(Reservation::new(&b, N * PAGE, 0).unwrap());
        let va = res.ptr();
        let mut run = MappedRun::take(&device, &res, va, N as usize, &RW).unwrap();
        let data = pattern(N * PAGE, nth);
        b.write(va, &data).unwrap();
        let live = b.live_counts();
        host(&b).inject_fault(FaultOp::Unmap, nth);
        let err = run
            .migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
            .unwrap_err();
        host(&b).clear_faults();
        assert!(
            matches!(err, Error::InjectedFault("unmap")),
            "#{nth}: {err}"
        );
        assert_eq!(run.pool().location(), D0);
        assert_eq!(read(&b, va, N * PAGE), data, "#{nth}: data intact");
        let h = hostp.stats();
        assert_eq!((h.in_use, h.free, h.quarantined), (0, N as usize - 1, 1));
        assert_eq!(device.stats().in_use, N as usize);
        // The quarantined page's staging mapping stays: one mapping more than before.
        assert_eq!(b.live_counts().mappings, live.mappings + 1, "#{nth}");
        run.migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
            .unwrap();
        assert_eq!(read(&b, va, N * PAGE), data, "#{nth}: moved after all");
        assert_eq!(hostp.stats().quarantined, 1);
    }
}

/// A run unmapped while an unmap fails: the page still mapped is quarantined (not released,
/// not reused), the others go back, and the error is returned.
#[test]
fn a_run_whose_unmap_fails_quarantines_that_page() {
    let b = backend(4);
    let (device, _) = pools(&b);
    let res = Arc::new(Reservation::new(&b, 2 * PAGE, 0).unwrap());
    let run = MappedRun::take(&device, &res, res.ptr(), 2, &RW).unwrap();
    let created = device.stats().created_total;
    host(&b).inject_fault(FaultOp::Unmap, 2);
    let err = run.unmap().unwrap_err();
    host(&b).clear_faults();
    assert!(matches!(err, Error::InjectedFault("unmap")), "{err}");
    let s = device.stats();
    assert_eq!((s.in_use, s.free, s.quarantined), (0, 1, 1));
    assert_eq!((s.created_total, s.released_total), (created, 0));
    assert_eq!(device.take(2).unwrap().len(), 2);
    assert_eq!(
        device.stats().created_total,
        created + 1,
        "a new page, not the mapped one"
    );
}

/// The run's own pages unmap last first; when one refuses, those already unmapped map back.
#[test]
fn a_failed_unmap_of_the_old_pages_maps_the_others_back() {
    const N: u64 = 3;
    for nth in N + 1..=2 * N {
        let b = backend(8);
        let (device, hostp) = pools(&b);
        let res = Arc::new(Reservation::new(&b, N * PAGE, 0).unwrap());
        let va = res.ptr();
        let mut run = MappedRun::take(&device, &res, va, N as usize, &RW).unwrap();
        let data = pattern(N * PAGE, nth);
        b.write(va, &data).unwrap();
        let live = b.live_counts();
        host(&b).inject_fault(FaultOp::Unmap, nth);
        let err = run
            .migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
            .unwrap_err();
        host(&b).clear_faults();
        assert!(
            matches!(err, Error::InjectedFault("unmap")),
            "#{nth}: {err}"
        );
        assert_eq!(run.pool().location(), D0);
        assert_eq!(read(&b, va, N * PAGE), data, "#{nth}: data intact");
        assert_eq!(b.live_counts().mappings, live.mappings, "#{nth}");
        assert_eq!(
            (device.stats().in_use, hostp.stats().in_use),
            (N as usize, 0)
        );
        b.write(va + N * PAGE - 5, b"write").unwrap();
        run.migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
            .unwrap();
        assert_eq!(&read(&b, va + N * PAGE - 5, 5), b"write");
    }
}

/// Several runs move between device and host pages at random, written at random between moves,
/// sometimes with a fault armed; after every step each run reads back its shadow copy.
#[test]
fn random_walk_of_writes_and_migrations_keeps_every_byte() {
    let b = backend(16);
    let (device, hostp) = pools(&b);
    let res = Arc::new(Reservation::new(&b, 16 * PAGE, 0).unwrap());
    let mut rng = rand::rngs::StdRng::seed_from_u64(18);
    let mut runs = Vec::new();
    let mut shadows = Vec::new();
    for (i, n) in [(0u64, 2usize), (2, 1), (3, 4), (7, 3)] {
        let va = res.ptr() + i * PAGE;
        let run = MappedRun::take(&device, &res, va, n, &RW).unwrap();
        let data = pattern(n as u64 * PAGE, i);
        b.write(va, &data).unwrap();
        runs.push(run);
        shadows.push(data);
    }
    let ops = [
        FaultOp::Create,
        FaultOp::Map,
        FaultOp::SetAccess,
        FaultOp::Copy,
    ];
    for step in 0..200 {
        let k = rng.random_range(0..runs.len());
        let run = &mut runs[k];
        if rng.random_bool(0.5) {
            let len = rng.random_range(1..4096u64);
            let at = rng.random_range(0..run.size() - len);
            let bytes = pattern(len, step);
            b.write(run.va() + at, &bytes).unwrap();
            shadows[k][at as usize..(at + len) as usize].copy_from_slice(&bytes);
        } else {
            let to = if run.pool().location() == D0 {
                &hostp
            } else {
                &device
            };
            let faulted = rng.random_bool(0.3);
            if faulted {
                let op = ops[rng.random_range(0..ops.len())];
                host(&b).inject_fault(op, rng.random_range(1..4));
            }
            let before = run.pool().location();
            let got = run.migrate(to, StreamHandle::DEFAULT, &[], &RW);
            host(&b).clear_faults();
            match got {
                Ok(m) => assert_eq!((m.from, m.to), (before, to.location())),
                Err(e) => {
                    assert!(faulted, "step {step}: {e}");
                    assert_eq!(run.pool().location(), before, "step {step}");
                }
            }
        }
        strata_vmm::check_deferred().unwrap();
        for (run, shadow) in runs.iter().zip(&shadows) {
            assert_eq!(&read(&b, run.va(), run.size()), shadow, "step {step}");
        }
        let on_device: usize = runs
            .iter()
            .filter(|r| r.pool().location() == D0)
            .map(|r| r.len())
            .sum();
        assert_eq!(device.stats().in_use, on_device, "step {step}");
        assert_eq!(hostp.stats().in_use, 10 - on_device, "step {step}");
    }
}

/// Revocation's building block: a run on pages borrowed from a peer moves to host pages, and
/// the borrowed pages go back to the lender's driver (per the run's `Return::Release`).
#[test]
fn a_run_on_borrowed_pages_moves_off_them_and_the_lender_gets_them_back() {
    let b = strata_vmm::host::open(HostConfig {
        devices: vec![8 * PAGE, 8 * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let (device, hostp) = pools(&b);
    let lender_free = b.mem_info(1).unwrap().free;
    let mut lease = PageLease::empty(&device);
    for _ in 0..2 {
        let phys =
            PhysicalMemory::create(&b, Location::Device(1), PAGE, CreateFlags::empty()).unwrap();
        let page = device
            .adopt(Arc::new(phys), PageSource::Borrowed { lender: 1 })
            .unwrap();
        lease.push(page);
    }
    let res = Arc::new(Reservation::new(&b, 2 * PAGE, 0).unwrap());
    let mut run = MappedRun::map(lease, &res, res.ptr(), &RW)
        .unwrap()
        .returning(Return::Release);
    let data = pattern(2 * PAGE, 5);
    b.write(res.ptr(), &data).unwrap();
    assert_eq!(b.mem_info(1).unwrap().free, lender_free - 2 * PAGE);
    assert_eq!(device.stats().borrowed, 2);

    let moved = run
        .migrate(&hostp, StreamHandle::DEFAULT, &[], &RW)
        .unwrap();
    assert_eq!(
        (moved.from, moved.to),
        (Location::Device(1), Location::Host)
    );
    assert_eq!(
        b.mem_info(1).unwrap().free,
        lender_free,
        "the lender has its memory"
    );
    assert_eq!(device.stats().borrowed, 0);
    assert_eq!(
        device.stats().free,
        0,
        "borrowed pages never reach the free list"
    );
    assert_eq!(read(&b, res.ptr(), 2 * PAGE), data);
}
