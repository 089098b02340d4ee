//! Harvest on the strict host backend with several emulated devices: best-fit placement,
//! revocation order, durability, a revocation storm under slow links, and the expert map.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use strata_tiers::harvest::{
    Endpoint, ExpertResidency, ExpertTier, HarvestConfig, HarvestController, HarvestHandle,
    HarvestHints, PeerLimits, RevokeReason,
};
use strata_tiers::Durability;
use strata_vmm::host::{FaultOp, Link, LinkModel};
use strata_vmm::{
    Access, Backend, Error, FaultyBackend, HostBuffer, HostConfig, Location, Mapping, Reservation,
};

const MIB: u64 = 1 << 20;

fn backend(devices: &[u64], link: Option<LinkModel>) -> Arc<dyn Backend> {
    strata_vmm::host_or_cuda(HostConfig {
        devices: devices.to_vec(),
        granularity: 2 * MIB,
        strict: true,
        link,
    })
    .unwrap()
}

/// [`backend`] for a test of `sizes.len()` devices, or `None` after a named skip when the
/// machine has fewer (Harvest lends between devices: one GPU cannot run these).
fn devices(test: &str, sizes: &[u64], link: Option<LinkModel>) -> Option<Arc<dyn Backend>> {
    let b = backend(sizes, link);
    let have = b.device_count() as usize;
    if have < sizes.len() {
        let reason = format!("needs {} devices; this machine has {have}", sizes.len());
        strata_test_support::skip(test, &reason);
        return None;
    }
    Some(b)
}

/// A configuration for devices of `sizes`: a device larger than its size (a GPU) gets a quota
/// of that size, so it lends as the test's small device would, and devices beyond the test's
/// lend nothing.
fn config(b: &Arc<dyn Backend>, sizes: &[u64]) -> HarvestConfig {
    let mut cfg = HarvestConfig::new(b.device_count() as usize);
    for (d, limits) in cfg.limits.iter_mut().enumerate() {
        let size = sizes.get(d).copied().unwrap_or(0);
        if b.mem_info(d as u32).unwrap().total > size {
            limits.quota = size;
        }
    }
    cfg
}

fn slow_peer_links() -> LinkModel {
    let link = |bw: f64| Link {
        bandwidth: bw,
        latency: Duration::from_micros(200),
    };
    LinkModel {
        host_to_device: link(2e9),
        device_to_host: link(2e9),
        // 2 MiB over a peer link: ~10 ms, so copies are in flight when revocations come.
        device_to_device: link(200e6),
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 / 8 * 7) % 251) as u8)
        .collect()
}

fn host_with(backend: &Arc<dyn Backend>, bytes: &[u8]) -> HostBuffer {
    let buf = HostBuffer::new(backend, bytes.len() as u64).unwrap();
    buf.write_at(0, bytes).unwrap();
    buf
}

fn read_back(c: &HarvestController, h: &HarvestHandle, len: usize) -> strata_vmm::Result<Vec<u8>> {
    let out = HostBuffer::new(c.backend(), len as u64)?;
    c.copy_out(
        h,
        0,
        Endpoint::Host {
            buffer: &out,
            offset: 0,
        },
        len as u64,
    )?
    .synchronize()?;
    let mut v = vec![0u8; len];
    out.read_at(0, &mut v)?;
    Ok(v)
}

#[test]
fn allocations_land_on_the_best_fit_peer_and_return_their_pages() {
    let sizes = [64 * MIB, 64 * MIB, 16 * MIB, 32 * MIB];
    let test = "allocations_land_on_the_best_fit_peer_and_return_their_pages";
    let Some(b) = devices(test, &sizes, None) else {
        return;
    };
    let c = HarvestController::new(Arc::clone(&b), config(&b, &sizes)).unwrap();
    let hints = HarvestHints::new(0, Durability::Backed);
    let free2 = b.mem_info(2).unwrap().free;

    let a = c.harvest_alloc(12 * MIB, &hints).unwrap();
    assert_eq!(
        (a.device, a.size),
        (2, 12 * MIB),
        "16 MiB peer leaves the least"
    );
    assert_eq!(b.mem_info(2).unwrap().free, free2 - 12 * MIB);
    let b2 = c.harvest_alloc(13 * MIB, &hints).unwrap();
    assert_eq!(
        (b2.device, b2.size),
        (3, 14 * MIB),
        "rounded to pages; device 2 is too full"
    );
    assert_eq!(c.capacity(2).unwrap().harvestable, 4 * MIB);
    assert_eq!(c.capacity(3).unwrap().lent, 14 * MIB);

    // Borrowed pages: counted in use by the lender, adopted as borrowed by the requester.
    assert_eq!(c.pool(2).unwrap().stats().in_use, 6);
    assert_eq!(c.pool(0).unwrap().stats().adopted_total, 13);

    // Links first, then hints, then fit.
    let mut cfg = config(&b, &sizes);
    cfg.links.set(0, 2, false);
    let c2 = HarvestController::new(Arc::clone(&b), cfg).unwrap();
    let small = c2.harvest_alloc(2 * MIB, &hints).unwrap();
    assert_eq!(small.device, 3, "device 2 fits best but has no direct link");
    let mut hinted = hints.clone();
    hinted.preferred = vec![1];
    assert_eq!(c2.harvest_alloc(2 * MIB, &hinted).unwrap().device, 1);
    hinted.direct_only = true;
    hinted.preferred = vec![2];
    assert_ne!(c2.harvest_alloc(2 * MIB, &hinted).unwrap().device, 2);

    // The requester's own device is never its peer (unless allowed), and too much is OOM.
    let err = c.harvest_alloc(200 * MIB, &hints).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(c.stats().failed_allocs >= 1);

    // Data written by copies reads back; free returns the memory; a second free is stale.
    let data = pattern(5, (12 * MIB) as usize);
    let src = host_with(&b, &data);
    c.copy_in(
        &a,
        0,
        Endpoint::Host {
            buffer: &src,
            offset: 0,
        },
        12 * MIB,
    )
    .unwrap()
    .synchronize()
    .unwrap();
    assert_eq!(read_back(&c, &a, data.len()).unwrap(), data);
    c.harvest_free(&a).unwrap();
    assert_eq!(b.mem_info(2).unwrap().free, free2);
    assert!(matches!(c.harvest_free(&a), Err(Error::StaleId { .. })));
    assert!(matches!(read_back(&c, &a, 16), Err(Error::StaleId { .. })));
    // A recycled slot does not revive the old handle.
    let again = c.harvest_alloc(12 * MIB, &hints).unwrap();
    assert_ne!(again.id, a.id);
    assert!(matches!(c.harvest_free(&a), Err(Error::StaleId { .. })));
    c.harvest_free(&again).unwrap();
    c.harvest_free(&b2).unwrap();
    assert_eq!(c.stats().live, 0);
}

#[test]
fn revocation_drains_then_invalidates_then_calls_back_once() {
    let sizes = [32 * MIB, 32 * MIB];
    let test = "revocation_drains_then_invalidates_then_calls_back_once";
    let Some(b) = devices(test, &sizes, Some(slow_peer_links())) else {
        return;
    };
    let c = HarvestController::new(Arc::clone(&b), config(&b, &sizes)).unwrap();
    let dst = Arc::new(Reservation::new(&b, 8 * MIB, 0).unwrap());
    let phys = Arc::new(
        strata_vmm::PhysicalMemory::create(&b, Location::Device(0), 8 * MIB, Default::default())
            .unwrap(),
    );
    let _map = Mapping::new(
        &dst,
        dst.ptr(),
        phys,
        0,
        8 * MIB,
        &[(Location::Device(0), Access::ReadWrite)],
    )
    .unwrap();

    let lossy = c
        .harvest_alloc(8 * MIB, &HarvestHints::new(0, Durability::Lossy))
        .unwrap();
    let backed = c
        .harvest_alloc(2 * MIB, &HarvestHints::new(0, Durability::Backed))
        .unwrap();
    // A slow peer copy (8 MiB at 200 MB/s: ~40 ms) is in flight when the owner reclaims.
    let ev = c
        .copy_out(
            &lossy,
            0,
            Endpoint::Device {
                reservation: &dst,
                va: dst.ptr(),
            },
            8 * MIB,
        )
        .unwrap();
    assert!(!ev.query().unwrap(), "the copy must still be in flight");
    let calls = Arc::new(Mutex::new(Vec::new()));
    for h in [lossy, backed] {
        let calls = Arc::clone(&calls);
        let ev = Arc::clone(&ev);
        let c2 = Arc::clone(&c);
        c.harvest_on_revoke(
            &h,
            Box::new(move |r| {
                // Drained, then invalidated, before the callback.
                calls.lock().push((
                    r.handle,
                    r.lost(),
                    r.reason,
                    ev.query().unwrap(),
                    c2.is_live(&r.handle),
                ));
            }),
        )
        .unwrap();
    }
    let report = c.reclaim(1, 8 * MIB).unwrap();
    assert_eq!(
        report.revoked,
        vec![lossy],
        "the one placement that covers 8 MiB"
    );
    assert!(ev.query().unwrap());
    let got = calls.lock().clone();
    assert_eq!(got, vec![(lossy, true, RevokeReason::Reclaim, true, false)]);
    assert!(matches!(
        c.copy_in(
            &lossy,
            0,
            Endpoint::Device {
                reservation: &dst,
                va: dst.ptr()
            },
            1
        ),
        Err(Error::StaleId { .. })
    ));
    assert!(matches!(
        c.harvest_on_revoke(&lossy, Box::new(|_| {})),
        Err(Error::StaleId { .. })
    ));
    assert!(matches!(c.revoke(&lossy), Err(Error::StaleId { .. })));

    // A quota cut reclaims the rest; the backed one is reported fallen back, not lost.
    let r = c
        .set_limits(
            1,
            PeerLimits {
                reserve: 0,
                quota: 0,
            },
        )
        .unwrap();
    assert_eq!(r.revoked, vec![backed]);
    let got = calls.lock().clone();
    assert_eq!(got.len(), 2);
    assert_eq!((got[1].0, got[1].1), (backed, false));
    assert!(c
        .harvest_alloc(2 * MIB, &HarvestHints::new(0, Durability::Lossy))
        .unwrap_err()
        .is_out_of_memory());

    // Pressure: the peer's owner keeps 2 MiB more free than it has with 4 MiB lent (30 MiB of
    // a 32 MiB device).
    c.set_limits(
        1,
        PeerLimits {
            reserve: 0,
            quota: u64::MAX,
        },
    )
    .unwrap();
    let h = c
        .harvest_alloc(4 * MIB, &HarvestHints::new(0, Durability::Lossy))
        .unwrap();
    assert!(c.check_pressure().unwrap().revoked.is_empty());
    c.set_limits(
        1,
        PeerLimits {
            reserve: b.mem_info(1).unwrap().free + 2 * MIB,
            quota: u64::MAX,
        },
    )
    .unwrap();
    let r = c.check_pressure().unwrap();
    assert_eq!(r.revoked, vec![h]);
    assert_eq!(c.stats().revoked_lossy, 2);
    assert_eq!(c.stats().revoked_backed, 1);
    assert_eq!(c.pool(1).unwrap().stats().in_use, 0);
}

/// Random revocations while slow copies are in flight: a read either returns exactly the
/// bytes of the object it was issued for, or fails as stale; backed objects always read
/// (falling back to host); each lossy one is reported lost exactly once.
#[test]
fn revocation_storm_never_exposes_torn_or_stale_data() {
    let sizes = [16 * MIB, 24 * MIB, 24 * MIB];
    let test = "revocation_storm_never_exposes_torn_or_stale_data";
    let Some(b) = devices(test, &sizes, Some(slow_peer_links())) else {
        return;
    };
    let c = HarvestController::new(Arc::clone(&b), config(&b, &sizes)).unwrap();
    const LEN: usize = (2 * MIB) as usize;
    struct Obj {
        handle: HarvestHandle,
        data: Vec<u8>,
        host: Option<HostBuffer>,
        revoked: Arc<AtomicBool>,
    }
    let objs: Arc<Mutex<HashMap<u64, Arc<Obj>>>> = Arc::default();
    let lost_calls: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
    let seq = AtomicU64::new(1);
    let place = |rng: &mut rand::rngs::StdRng| -> bool {
        let durability = if rng.random_bool(0.5) {
            Durability::Backed
        } else {
            Durability::Lossy
        };
        let Ok(handle) = c.harvest_alloc(LEN as u64, &HarvestHints::new(0, durability)) else {
            return false;
        };
        let data = pattern(seq.fetch_add(1, Ordering::Relaxed), LEN);
        let src = host_with(&b, &data);
        c.copy_in(
            &handle,
            0,
            Endpoint::Host {
                buffer: &src,
                offset: 0,
            },
            LEN as u64,
        )
        .unwrap()
        .synchronize()
        .unwrap();
        let revoked = Arc::new(AtomicBool::new(false));
        let (flag, lost) = (Arc::clone(&revoked), Arc::clone(&lost_calls));
        c.harvest_on_revoke(
            &handle,
            Box::new(move |r| {
                assert!(!flag.swap(true, Ordering::SeqCst), "called back twice");
                if r.lost() {
                    *lost
                        .lock()
                        .entry(r.handle.id ^ (u64::from(r.handle.device) << 62))
                        .or_default() += 1;
                }
            }),
        )
        .unwrap();
        let host = (durability == Durability::Backed).then_some(src);
        objs.lock().insert(
            handle.id ^ (u64::from(handle.device) << 62),
            Arc::new(Obj {
                handle,
                data,
                host,
                revoked,
            }),
        );
        true
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    while place(&mut rng) {}
    assert!(objs.lock().len() >= 8);

    let stop = AtomicBool::new(false);
    let (good, stale, fell_back) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (objs, c, stop) = (&objs, &c, &stop);
            let (good, stale, fell_back) = (&good, &stale, &fell_back);
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(100 + t);
                let out = HostBuffer::new(c.backend(), LEN as u64).unwrap();
                let mut v = vec![0u8; LEN];
                while !stop.load(Ordering::Relaxed) {
                    let pick: Vec<Arc<Obj>> = objs.lock().values().cloned().collect();
                    if pick.is_empty() {
                        std::thread::yield_now();
                        continue;
                    }
                    let o = &pick[rng.random_range(0..pick.len())];
                    let res = c
                        .copy_out(
                            &o.handle,
                            0,
                            Endpoint::Host {
                                buffer: &out,
                                offset: 0,
                            },
                            LEN as u64,
                        )
                        .and_then(|e| e.synchronize());
                    match res {
                        Ok(()) => {
                            out.read_at(0, &mut v).unwrap();
                            assert!(v == o.data, "torn or stale bytes from a peer placement");
                            good.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::StaleId { .. }) => {
                            stale.fetch_add(1, Ordering::Relaxed);
                            if let Some(host) = &o.host {
                                host.read_at(0, &mut v).unwrap();
                                assert!(v == o.data);
                                fell_back.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
            });
        }
        let deadline = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(rng.random_range(1..15)));
            match rng.random_range(0..3) {
                0 => {
                    c.reclaim(rng.random_range(1..3), rng.random_range(1..3) * 2 * MIB)
                        .unwrap();
                }
                1 => {
                    let one = objs.lock().values().next().map(|o| o.handle);
                    if let Some(h) = one {
                        let _ = c.revoke(&h);
                    }
                }
                _ => {
                    // New objects reuse returned pages with new bytes.
                    place(&mut rng);
                }
            }
            objs.lock()
                .retain(|_, o| !o.revoked.load(Ordering::SeqCst) || rng.random_bool(0.5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(good.load(Ordering::Relaxed) > 0);
    assert!(
        stale.load(Ordering::Relaxed) > 0,
        "reads must race revocations"
    );
    let _ = fell_back.load(Ordering::Relaxed);
    // Revoke everything left; every lossy object was reported exactly once.
    c.reclaim(1, u64::MAX).unwrap();
    c.reclaim(2, u64::MAX).unwrap();
    assert!(lost_calls.lock().values().all(|&n| n == 1));
    assert_eq!(lost_calls.lock().len() as u64, c.stats().revoked_lossy);
    assert_eq!(c.stats().live, 0);
    for d in 1..3 {
        assert_eq!(c.pool(d).unwrap().stats().in_use, 0);
    }
}

#[test]
fn expert_residency_serves_misses_from_the_fastest_tier() {
    let sizes = [16 * MIB, 16 * MIB];
    let Some(b) = devices(
        "expert_residency_serves_misses_from_the_fastest_tier",
        &sizes,
        None,
    ) else {
        return;
    };
    let c = HarvestController::new(Arc::clone(&b), config(&b, &sizes)).unwrap();
    const E: u64 = 2 * MIB;
    let all: Vec<u8> = (0..8).flat_map(|e| pattern(1000 + e, E as usize)).collect();
    let weights = host_with(&b, &all);
    let experts = ExpertResidency::new(Arc::clone(&c), 0, E, weights, 2).unwrap();
    // The peer keeps all but 10 MiB of what is free (6 MiB of a 16 MiB device).
    c.set_limits(
        1,
        PeerLimits {
            reserve: b.mem_info(1).unwrap().free - 10 * MIB,
            quota: u64::MAX,
        },
    )
    .unwrap();
    assert_eq!(
        experts.rebalance(8).unwrap(),
        5,
        "10 MiB to lend: 5 experts fit"
    );
    let tiers: Vec<_> = (0..8).map(|e| experts.tier(e).unwrap()).collect();
    assert_eq!(
        &tiers[..3],
        &[ExpertTier::Local, ExpertTier::Local, ExpertTier::Peer]
    );
    assert_eq!(tiers[7], ExpertTier::Host);

    let dst = Arc::new(Reservation::new(&b, E, 0).unwrap());
    let phys = Arc::new(
        strata_vmm::PhysicalMemory::create(&b, Location::Device(0), E, Default::default()).unwrap(),
    );
    let _m = Mapping::new(
        &dst,
        dst.ptr(),
        phys,
        0,
        E,
        &[(Location::Device(0), Access::ReadWrite)],
    )
    .unwrap();
    let check = |e: usize, want: ExpertTier| {
        assert_eq!(experts.fetch(e, &dst, dst.ptr()).unwrap(), want);
        let mut v = vec![0u8; E as usize];
        b.read(dst.ptr(), &mut v).unwrap();
        assert!(v == all[e * E as usize..(e + 1) * E as usize], "expert {e}");
    };
    for (e, &t) in tiers.iter().enumerate() {
        check(e, t);
    }
    // The peer's owner takes its memory back: the entries fall back to host memory.
    c.reclaim(1, u64::MAX).unwrap();
    for e in 0..8 {
        check(
            e,
            if e < 2 {
                ExpertTier::Local
            } else {
                ExpertTier::Host
            },
        );
    }
    assert_eq!(experts.served(), [4, 5, 7]);
}

#[test]
fn a_failed_local_expert_grant_gives_every_page_back_to_the_pool() {
    // Regression: a failed map inside ExpertResidency::new dropped the pages it had taken and
    // left the pool counting them in use.
    // Faults injected by a wrapper, so this runs on any backend (one device is enough: the
    // grant is local).
    for (op, nth) in [(FaultOp::Map, 2), (FaultOp::SetAccess, 1)] {
        let host = FaultyBackend::new(backend(&[16 * MIB, 16 * MIB], None));
        let b: Arc<dyn Backend> = host.clone();
        let c = HarvestController::new(Arc::clone(&b), HarvestConfig::new(2)).unwrap();
        const E: u64 = 2 * MIB;
        let weights = host_with(&b, &pattern(7, (4 * E) as usize));
        let baseline = b.live_counts();
        host.inject_fault(op, nth);
        let err = ExpertResidency::new(Arc::clone(&c), 0, E, weights, 3)
            .err()
            .expect("the grant fails");
        assert!(matches!(err, Error::InjectedFault(_)), "{op:?}: {err}");
        let s = c.pool(0).unwrap().stats();
        assert_eq!(s.in_use, 0, "{op:?}: pool counters after a failed grant");
        assert_eq!(s.free as u64 + s.released_total, s.created_total, "{op:?}");
        assert_eq!(b.live_counts().mappings, baseline.mappings, "{op:?}");
    }
}
