//! TierStore: data integrity across tiers, revocation, faults, bad input.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use strata_tiers::{Durability, Notice, Tier};
use strata_vmm::{Backend, Error, FaultyBackend};

#[test]
fn blocks_survive_spill_to_host_and_disk_and_come_back() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 16, 64);
    let ids: Vec<_> = (0..40)
        .map(|i| s.put(&block(i), Durability::Lossy, i).unwrap())
        .collect();
    s.check_invariants().unwrap();
    // 32 HBM slots: the first 8 were evicted to host.
    let st = s.stats();
    assert_eq!(st.hbm_used, 32);
    assert_eq!(st.host_used, 8);
    s.spill(&ids[..20], Tier::Disk).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.residency(ids[3]).unwrap().fastest(), Some(Tier::Disk));
    assert_eq!(check(&s, ids[3], 3), Tier::Disk);
    s.spill(&ids[20..30], Tier::Host).unwrap();
    assert_eq!(check(&s, ids[25], 25), Tier::Host);
    // Prefetch disk and host blocks back: two-hop for the disk ones.
    let ev = s.prefetch(&ids[..24]).unwrap();
    ev.synchronize().unwrap();
    s.check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        let t = check(&s, id, i as u64);
        if i < 24 {
            assert_eq!(t, Tier::Hbm);
        }
    }
    let st = s.stats();
    assert!(st.disk_read_bytes >= 20 * BLOCK);
    assert!(st.transfers.bytes_h2d >= 24 * BLOCK);
    for id in ids {
        s.release(id).unwrap();
    }
    s.check_invariants().unwrap();
    assert_eq!(s.stats().objects, 0);
}

#[test]
fn stale_and_unknown_ids_are_errors() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 4, 4);
    let id = s.put(&block(1), Durability::Backed, 0).unwrap();
    s.release(id).unwrap();
    assert!(matches!(s.release(id), Err(Error::StaleId { .. })));
    let again = s.put(&block(2), Durability::Backed, 0).unwrap();
    assert_eq!(again.index(), id.index());
    // The old id never reaches the new object.
    let mut buf = vec![0u8; BLOCK as usize];
    assert!(matches!(s.read(id, &mut buf), Err(Error::StaleId { .. })));
    assert!(matches!(s.prefetch(&[id]), Err(Error::StaleId { .. })));
    let bogus = strata_tiers::ObjectId::from_key(77 << 32);
    assert!(matches!(s.release(bogus), Err(Error::StaleId { .. })));
    check(&s, again, 2);
}

#[test]
fn prefetching_more_than_a_full_tier_holds_is_out_of_memory() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 64, 0);
    let ids: Vec<_> = (0..40)
        .map(|i| s.put(&block(i), Durability::Lossy, i).unwrap())
        .collect();
    let Err(err) = s.prefetch(&ids) else {
        panic!("prefetch beyond HBM capacity succeeded")
    };
    assert!(err.is_out_of_memory(), "{err}");
    s.check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        check(&s, id, i as u64);
    }
}

#[test]
fn a_full_disk_is_out_of_tier_space_and_loses_nothing() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    // 32 HBM, 4 host, 4 disk blocks.
    let s = store(&b, dir.path(), 1, 4, 4);
    let ids: Vec<_> = (0..36)
        .map(|i| s.put(&block(i), Durability::Lossy, i).unwrap())
        .collect();
    let err = s.spill(&ids, Tier::Disk).unwrap_err();
    assert!(
        matches!(err, Error::OutOfTierSpace { tier: "disk", .. }),
        "{err}"
    );
    s.check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        check(&s, id, i as u64);
    }
    // Every tier full: a new object finds no victim that can move down.
    let mut extra = Vec::new();
    let err = loop {
        match s.put(&block(100 + extra.len() as u64), Durability::Lossy, 0) {
            Ok(id) => extra.push(id),
            Err(e) => break e,
        }
        assert!(
            extra.len() <= 8,
            "puts kept succeeding with every tier full"
        );
    };
    assert!(err.is_out_of_memory(), "{err}");
    s.check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        check(&s, id, i as u64);
    }
    for (k, &id) in extra.iter().enumerate() {
        check(&s, id, 100 + k as u64);
    }
}

#[test]
fn a_non_writable_disk_directory_is_a_clear_error() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let mut c = strata_tiers::StoreConfig::new(BLOCK, 2 << 20, 0);
    c.disk = Some(disk(&file, 4));
    let err = strata_tiers::TierStore::new(pool(&b), c).unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");
    let mut c = strata_tiers::StoreConfig::new(BLOCK, 2 << 20, 0);
    c.disk = Some(disk(&dir.path().join("missing"), 4));
    let err = strata_tiers::TierStore::new(pool(&b), c).unwrap_err();
    assert!(matches!(err, Error::Os { .. }), "{err}");
}

#[test]
fn injected_copy_faults_are_typed_errors_and_lose_nothing() {
    // Faults injected by a wrapper, so this runs on any backend (a GPU included).
    let host = FaultyBackend::new(backend(None));
    let b: Arc<dyn Backend> = host.clone();
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 64, 64);
    let ids: Vec<_> = (0..32)
        .map(|i| {
            let d = if i % 2 == 0 {
                Durability::Backed
            } else {
                Durability::Lossy
            };
            s.put(&block(i), d, i).unwrap()
        })
        .collect();
    host.inject_fault(strata_vmm::host::FaultOp::Copy, 1);
    let err = s.spill(&ids, Tier::Host).unwrap_err();
    assert!(matches!(err, Error::InjectedFault("copy")), "{err}");
    s.check_invariants().unwrap();
    s.spill(&ids, Tier::Host).unwrap();
    host.inject_fault(strata_vmm::host::FaultOp::Copy, 1);
    assert!(matches!(
        s.prefetch(&ids),
        Err(Error::InjectedFault("copy"))
    ));
    s.check_invariants().unwrap();
    s.prefetch(&ids).unwrap().synchronize().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(check(&s, id, i as u64), Tier::Hbm);
    }
    // The two-hop path: a failed host→HBM hop leaves no HBM copy without data.
    s.spill(&ids, Tier::Disk).unwrap();
    host.inject_fault(strata_vmm::host::FaultOp::Copy, 1);
    assert!(matches!(
        s.prefetch(&ids),
        Err(Error::InjectedFault("copy"))
    ));
    s.check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        check(&s, id, i as u64);
    }
    s.prefetch(&ids).unwrap().synchronize().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(check(&s, id, i as u64), Tier::Hbm);
    }
}

#[test]
fn revocation_falls_back_or_reports_lost_exactly_once() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 2, 8, 64);
    let notices = Arc::new(Mutex::new(Vec::new()));
    let n2 = Arc::clone(&notices);
    s.set_callback(move |n| n2.lock().unwrap().push(n));
    let ids: Vec<_> = (0..64)
        .map(|i| {
            let d = if i % 2 == 0 {
                Durability::Backed
            } else {
                Durability::Lossy
            };
            s.put(&block(i), d, i).unwrap()
        })
        .collect();
    s.check_invariants().unwrap();
    let r = s.revoke_pages(&[0]).unwrap();
    assert_eq!(r.pages.len(), 1);
    assert_eq!(r.fell_back.len() + r.lost.len(), 32);
    s.check_invariants().unwrap();
    // Every backed object survives; lossy ones on page 0 are lost, once.
    for (i, &id) in ids.iter().enumerate() {
        if r.lost.contains(&id) {
            assert_eq!(i % 2, 1, "a backed object was lost");
            let mut buf = vec![0u8; BLOCK as usize];
            assert!(matches!(s.read(id, &mut buf), Err(Error::InvalidState(_))));
        } else {
            check(&s, id, i as u64);
        }
    }
    let lost_notices: Vec<_> = notices
        .lock()
        .unwrap()
        .iter()
        .filter_map(|n| match n {
            Notice::Lost { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(lost_notices, r.lost);
    assert!(matches!(
        s.revoke_pages(&[0]),
        Err(Error::InvalidArgument(_))
    ));
    let st = s.stats();
    assert_eq!(st.hbm_slots, 32);
    assert_eq!(st.lost, r.lost.len() as u64);
    // New objects only land on the remaining page.
    let more: Vec<_> = (100..140)
        .map(|i| s.put(&block(i), Durability::Lossy, i).unwrap())
        .collect();
    s.check_invariants().unwrap();
    for (k, &id) in more.iter().enumerate() {
        check(&s, id, 100 + k as u64);
    }
    for id in r.lost {
        s.release(id).unwrap();
    }
    s.check_invariants().unwrap();
}

#[test]
fn revocation_during_a_slow_copy_never_exposes_torn_data() {
    use std::time::Duration;
    use strata_vmm::host::{Link, LinkModel};
    let slow = Link {
        bandwidth: 2e9,
        latency: Duration::from_micros(200),
    };
    let b = backend(Some(LinkModel {
        host_to_device: slow,
        device_to_host: slow,
        device_to_device: slow,
    }));
    let dir = tempfile::tempdir().unwrap();
    let mut c = strata_tiers::StoreConfig::new(BLOCK, 2 * (2 << 20), 64 * BLOCK);
    c.disk = Some(disk(dir.path(), 64));
    c.submission = strata_tiers::Submission::Naive;
    let s = Arc::new(strata_tiers::TierStore::new(pool(&b), c).unwrap());
    let ids: Vec<_> = (0..48)
        .map(|i| s.put(&block(i), Durability::Backed, i).unwrap())
        .collect();
    s.spill(&ids, Tier::Host).unwrap();
    // ~48 × 232 µs of copies in flight while the revoker takes page 1 back.
    let ev = s.prefetch(&ids).unwrap();
    assert!(!ev.query().unwrap(), "the copies should still be in flight");
    let r = s.revoke_pages(&[1]).unwrap();
    ev.synchronize().unwrap();
    assert!(r.lost.is_empty());
    s.check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        check(&s, id, i as u64);
    }
}

/// One device page outside the store (its own reservation and pool page), like a KvSpace tensor.
struct Outside {
    reservation: Arc<strata_vmm::Reservation>,
    _mapping: strata_vmm::Mapping,
    _page: strata_allocator::Page,
}

fn outside(s: &strata_tiers::TierStore) -> Outside {
    let b = s.backend();
    let page = s.pool().take(1).unwrap().pop().unwrap();
    let reservation = Arc::new(strata_vmm::Reservation::new(b, 2 << 20, 0).unwrap());
    let mapping = strata_vmm::Mapping::new(
        &reservation,
        reservation.ptr(),
        Arc::clone(page.phys()),
        0,
        2 << 20,
        &[(
            strata_vmm::Location::Device(0),
            strata_vmm::Access::ReadWrite,
        )],
    )
    .unwrap();
    Outside {
        reservation,
        _mapping: mapping,
        _page: page,
    }
}

/// A store with 4 host blocks (of 8 blocks put from the device, 4 land in host memory, 4 on
/// disk) and a device page outside it.
fn eight_outside() -> (
    Arc<dyn strata_vmm::Backend>,
    tempfile::TempDir,
    strata_tiers::TierStore,
    Outside,
) {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 4, 64);
    let out = outside(&s);
    (b, dir, s, out)
}

/// Puts 8 patterned blocks (`seed + k`) from the start of `out` into `s`, as one Lossy batch.
fn put_eight(s: &strata_tiers::TierStore, out: &Outside, seed: u64) -> Vec<strata_tiers::ObjectId> {
    let b = s.backend();
    let at = |k: u64| out.reservation.ptr() + k * BLOCK;
    for k in 0..8 {
        b.write(at(k), &block(seed + k)).unwrap();
    }
    let srcs: Vec<u64> = (0..8).map(at).collect();
    let (ids, done) = s
        .put_from_device(&srcs, Durability::Lossy, 7, &[&*out.reservation])
        .unwrap();
    done.synchronize().unwrap();
    ids
}

#[test]
fn objects_come_from_and_go_to_device_addresses_outside_the_store() {
    let (b, _dir, s, out) = eight_outside();
    let scope = [&*out.reservation];
    let at = |k: u64| out.reservation.ptr() + k * BLOCK;
    let ids = put_eight(&s, &out, 100);
    s.check_invariants().unwrap();
    let tiers: Vec<_> = ids
        .iter()
        .map(|&id| s.residency(id).unwrap().fastest().unwrap())
        .collect();
    assert_eq!(tiers.iter().filter(|&&t| t == Tier::Host).count(), 4);
    assert_eq!(tiers.iter().filter(|&&t| t == Tier::Disk).count(), 4);
    for (k, &id) in ids.iter().enumerate() {
        check(&s, id, 100 + k as u64);
    }
    // Overwrite the device range, then take every object back in reverse order.
    for k in 0..8 {
        b.write(at(k), &block(0)).unwrap();
    }
    let pairs: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| (id, at(7 - k as u64)))
        .collect();
    s.take_to_device(&pairs, &scope)
        .unwrap()
        .synchronize()
        .unwrap();
    s.check_invariants().unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    for k in 0..8u64 {
        b.read(at(7 - k), &mut buf).unwrap();
        let expected = 100 + k;
        assert_eq!(
            strata_kernels::pattern::first_mismatch(&buf, expected, 0),
            None
        );
        assert!(matches!(
            s.residency(ids[k as usize]),
            Err(Error::StaleId { .. })
        ));
    }
    assert_eq!(s.stats().objects, 0);
    assert_eq!(s.stats().host_used + s.stats().disk_used, 0);
}

#[test]
fn a_kept_restore_from_disk_keeps_the_copy_in_free_host_memory() {
    let (b, _dir, s, out) = eight_outside();
    let scope = [&*out.reservation];
    let at = |k: u64| out.reservation.ptr() + k * BLOCK;
    let ids = put_eight(&s, &out, 200);
    let on_disk: Vec<usize> = (0..8)
        .filter(|&k| s.residency(ids[k]).unwrap().fastest() == Some(Tier::Disk))
        .collect();
    assert_eq!(on_disk.len(), 4);
    // Free two host slots: two of the four disk objects can move up on a kept restore.
    let in_host: Vec<usize> = (0..8).filter(|k| !on_disk.contains(k)).collect();
    for &k in &in_host[..2] {
        s.release(ids[k]).unwrap();
    }
    for k in 0..8 {
        b.write(at(k), &block(0)).unwrap();
    }
    let pairs: Vec<_> = on_disk.iter().map(|&k| (ids[k], at(k as u64))).collect();
    s.copy_to_device(&pairs, &scope)
        .unwrap()
        .synchronize()
        .unwrap();
    s.check_invariants().unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    for &k in &on_disk {
        b.read(at(k as u64), &mut buf).unwrap();
        assert_eq!(
            strata_kernels::pattern::first_mismatch(&buf, 200 + k as u64, 0),
            None
        );
        // The kept copy still holds the bytes, wherever it lives now.
        check(&s, ids[k], 200 + k as u64);
    }
    let tiers: Vec<_> = on_disk
        .iter()
        .map(|&k| s.residency(ids[k]).unwrap().fastest().unwrap())
        .collect();
    assert_eq!(tiers.iter().filter(|&&t| t == Tier::Host).count(), 2);
    assert_eq!(tiers.iter().filter(|&&t| t == Tier::Disk).count(), 2);
    assert_eq!(s.stats().host_used, 4);
    // The two moved up keep their disk copies too (the bytes never changed): sending them
    // back down writes nothing.
    assert_eq!(s.stats().disk_used, 4);
    let moved: Vec<_> = on_disk
        .iter()
        .map(|&k| ids[k])
        .filter(|&id| s.residency(id).unwrap().host.is_some())
        .collect();
    for &id in &moved {
        assert!(s.residency(id).unwrap().disk.is_some());
    }
    let written = s.stats().disk_write_bytes;
    s.spill(&moved, Tier::Disk).unwrap();
    assert_eq!(s.stats().disk_write_bytes, written);
    assert_eq!(s.stats().host_used, 2);
    for &k in &on_disk {
        check(&s, ids[k], 200 + k as u64);
    }
    // A restore that releases (take) never moves anything up.
    let rest: Vec<_> = on_disk.iter().map(|&k| (ids[k], at(k as u64))).collect();
    s.release(ids[in_host[2]]).unwrap();
    s.take_to_device(&rest, &scope)
        .unwrap()
        .synchronize()
        .unwrap();
    assert_eq!(s.stats().disk_used, 0);
    assert_eq!(s.stats().host_used, 1);
    s.check_invariants().unwrap();
}

/// A full disk tier takes the slot of a disk copy whose bytes host memory also holds (a kept
/// restore leaves both) before it refuses a write.
#[test]
fn a_full_disk_takes_the_slot_of_a_copy_that_host_memory_also_holds() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 4, 4);
    let out = outside(&s);
    let scope = [&*out.reservation];
    let ids: Vec<_> = (0..5)
        .map(|k| s.put(&block(300 + k), Durability::Backed, k).unwrap())
        .collect();
    s.spill(&ids[..4], Tier::Disk).unwrap();
    assert_eq!((s.stats().disk_used, s.stats().disk_slots), (4, 4));
    // A kept restore reads ids[0] into host memory; its disk copy stays. Its owner then relies
    // on the store again: it is no redundant copy that could simply be dropped.
    s.copy_to_device(&[(ids[0], out.reservation.ptr())], &scope)
        .unwrap()
        .synchronize()
        .unwrap();
    assert!(s.set_redundant(&[ids[0]], false).unwrap());
    let r = s.residency(ids[0]).unwrap();
    assert!(r.host.is_some() && r.disk.is_some());
    s.spill(&ids[4..], Tier::Disk).unwrap();
    assert_eq!(s.residency(ids[4]).unwrap().fastest(), Some(Tier::Disk));
    assert_eq!(s.residency(ids[0]).unwrap().disk, None);
    for (k, &id) in ids.iter().enumerate() {
        check(&s, id, 300 + k as u64);
    }
    s.check_invariants().unwrap();
}

#[test]
fn a_prefetch_whose_redundant_objects_are_dropped_for_room_is_an_error_not_wrong_bytes() {
    let (_backend, _dir, s, out) = eight_outside();
    let scope = [&*out.reservation];
    let at = |k: u64| out.reservation.ptr() + k * BLOCK;
    let ids = put_eight(&s, &out, 300);
    // The four host objects become redundant (their owner keeps the bytes): host is full.
    let in_host: Vec<_> = (0..8)
        .filter(|&k| s.residency(ids[k]).unwrap().fastest() == Some(Tier::Host))
        .map(|k| (ids[k], at(k as u64)))
        .collect();
    assert_eq!(in_host.len(), 4);
    s.copy_to_device(&in_host, &scope)
        .unwrap()
        .synchronize()
        .unwrap();
    // Fill HBM (32 blocks) with objects that have no lower copy.
    let fill: Vec<_> = (0..32)
        .map(|k| s.put(&block(400 + k), Durability::Lossy, 9).unwrap())
        .collect();
    // Prefetching the redundant objects demotes four HBM objects to host memory, which drops
    // redundant objects for room: the prefetch's own. That must be an error, never another
    // object's bytes loaded in their place.
    let want: Vec<_> = in_host.iter().map(|&(id, _)| id).collect();
    let err = s.prefetch(&want).unwrap_err();
    assert!(matches!(err, Error::InvalidState(_)), "{err}");
    s.synchronize().unwrap();
    s.check_invariants().unwrap();
    for (k, &id) in fill.iter().enumerate() {
        check(&s, id, 400 + k as u64);
    }
}

#[test]
fn a_mixed_restore_keeps_some_objects_and_releases_the_others() {
    let (_backend, _dir, s, out) = eight_outside();
    let scope = [&*out.reservation];
    let at = |k: u64| out.reservation.ptr() + k * BLOCK;
    let ids = put_eight(&s, &out, 500);
    let pairs: Vec<_> = (0..8).map(|k| (ids[k], at(k as u64))).collect();
    let keep: Vec<bool> = (0..8).map(|k| k % 2 == 0).collect();
    let err = s.restore_to_device(&pairs, &keep[..7], &scope).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(s.stats().objects, 8);
    s.restore_to_device(&pairs, &keep, &scope)
        .unwrap()
        .synchronize()
        .unwrap();
    s.check_invariants().unwrap();
    for (k, &id) in ids.iter().enumerate() {
        if keep[k] {
            check(&s, id, 500 + k as u64);
        } else {
            assert!(matches!(s.residency(id), Err(Error::StaleId { .. })));
        }
    }
    assert_eq!(s.stats().objects, 4);
}

#[test]
fn device_puts_and_takes_reject_bad_input_and_change_nothing() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = store(&b, dir.path(), 1, 4, 16);
    let out = outside(&s);
    let scope = [&*out.reservation];
    let at = out.reservation.ptr();
    b.write(at, &block(5)).unwrap();
    // A source outside the scope: nothing is queued and no object remains.
    let wild = s.put_from_device(&[at, 1 << 40], Durability::Lossy, 1, &scope);
    assert!(wild.is_err());
    assert_eq!(s.stats().objects, 0);
    s.check_invariants().unwrap();
    let (ids, done) = s
        .put_from_device(&[at], Durability::Lossy, 1, &scope)
        .unwrap();
    done.synchronize().unwrap();
    let id = ids[0];
    let hbm_only = s.put(&block(6), Durability::Lossy, 2).unwrap();
    type Case<'a> = (&'a [(strata_tiers::ObjectId, u64)], fn(&Error) -> bool);
    let bad: [Case; 3] = [
        (&[(id, at), (id, at)], |e| {
            matches!(e, Error::InvalidArgument(_))
        }),
        (&[(id, at), (hbm_only, at)], |e| {
            matches!(e, Error::InvalidState(_))
        }),
        // A destination outside the scope fails the copy: every object stays.
        (&[(id, 1 << 40)], |e| {
            matches!(e, Error::IllegalAccess { .. })
        }),
    ];
    for (pairs, expected) in bad {
        let e = s.take_to_device(pairs, &scope).unwrap_err();
        assert!(expected(&e), "{e}");
        assert_eq!(check(&s, id, 5), Tier::Host);
        s.check_invariants().unwrap();
    }
    s.release(id).unwrap();
    assert!(matches!(
        s.take_to_device(&[(id, at)], &scope),
        Err(Error::StaleId { .. })
    ));
    s.release(hbm_only).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn a_held_disk_read_does_not_stop_another_objects_device_read() {
    use std::sync::mpsc;
    use std::time::Duration;
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(store(&b, dir.path(), 1, 4, 16));
    let on_disk = s.put(&block(1), Durability::Backed, 1).unwrap();
    s.spill(&[on_disk], Tier::Disk).unwrap();
    let in_hbm = s.put(&block(2), Durability::Lossy, 2).unwrap();
    assert_eq!(s.residency(in_hbm).unwrap().fastest(), Some(Tier::Hbm));
    let hold = s.disk_file().unwrap().hold_reads();
    let slow = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || check(&s, on_disk, 1))
    };
    assert!(
        hold.wait_for_readers(1, Duration::from_secs(10)),
        "the disk read never started"
    );
    let (done, finished) = mpsc::channel();
    let fast = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || done.send(check(&s, in_hbm, 2)).unwrap())
    };
    let got = finished.recv_timeout(Duration::from_secs(10));
    drop(hold);
    fast.join().unwrap();
    assert_eq!(slow.join().unwrap(), Tier::Disk);
    assert_eq!(
        got,
        Ok(Tier::Hbm),
        "the HBM read waited for another object's disk read"
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_held_two_hop_read_does_not_stop_other_objects_moving() {
    use std::sync::mpsc;
    use std::time::Duration;
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(store(&b, dir.path(), 1, 8, 16));
    let on_disk = s.put(&block(1), Durability::Backed, 1).unwrap();
    s.spill(&[on_disk], Tier::Disk).unwrap();
    let on_host = s.put(&block(2), Durability::Backed, 2).unwrap();
    s.spill(&[on_host], Tier::Host).unwrap();
    let in_hbm = s.put(&block(3), Durability::Lossy, 3).unwrap();
    let hold = s.disk_file().unwrap().hold_reads();
    let slow = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || s.prefetch(&[on_disk]).and_then(|ev| ev.synchronize()))
    };
    assert!(
        hold.wait_for_readers(1, Duration::from_secs(10)),
        "the two-hop read never started"
    );
    let (done, finished) = mpsc::channel();
    let fast = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            let read = check(&s, in_hbm, 3);
            s.prefetch(&[on_host]).unwrap().synchronize().unwrap();
            let fresh = s.put(&block(4), Durability::Lossy, 4).unwrap();
            done.send((read, check(&s, on_host, 2), check(&s, fresh, 4)))
                .unwrap();
        })
    };
    let got = finished.recv_timeout(Duration::from_secs(10));
    drop(hold);
    fast.join().unwrap();
    slow.join().unwrap().unwrap();
    assert_eq!(
        got,
        Ok((Tier::Hbm, Tier::Hbm, Tier::Hbm)),
        "other objects waited for a held two-hop read"
    );
    assert_eq!(check(&s, on_disk, 1), Tier::Hbm);
    s.check_invariants().unwrap();
}

/// Demand first: while a restore's two-hop reads are under way, no staging read starts, even on
/// an idle I/O thread; the staging reads run once the restore's are done.
#[test]
fn staging_reads_wait_while_a_restore_reads_disk() {
    use std::time::{Duration, Instant};
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(store(&b, dir.path(), 1, 8, 16));
    let ids: Vec<_> = (0..5)
        .map(|k| s.put(&block(10 + k), Durability::Backed, k).unwrap())
        .collect();
    s.spill(&ids, Tier::Disk).unwrap();
    let io = s.io_pool().unwrap();
    let hold = s.disk_file().unwrap().hold_reads();
    let demand = {
        let s = Arc::clone(&s);
        let id = ids[0];
        std::thread::spawn(move || s.prefetch(&[id]).and_then(|ev| ev.synchronize()))
    };
    assert!(
        hold.wait_for_readers(1, Duration::from_secs(10)),
        "the restore's read never started"
    );
    let stage = {
        let s = Arc::clone(&s);
        let staged = ids[1..].to_vec();
        std::thread::spawn(move || s.stage_to_host(&staged, 0))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while io.queued() != (0, 4) {
        assert!(Instant::now() < deadline, "queued: {:?}", io.queued());
        std::thread::yield_now();
    }
    // The second I/O thread is idle, yet no staging read reaches the disk.
    assert!(!hold.wait_for_readers(2, Duration::from_millis(200)));
    assert_eq!(io.queued(), (0, 4));
    drop(hold);
    demand.join().unwrap().unwrap();
    assert_eq!(stage.join().unwrap().unwrap(), 4);
    assert_eq!(s.stats().staged, 4);
    for (k, &id) in ids.iter().enumerate() {
        check(&s, id, 10 + k as u64);
    }
    s.check_invariants().unwrap();
}

/// Threads each working on their own objects (every operation, every tier) beside a revoker:
/// every byte survives and the tables agree at the end.
#[test]
fn threads_on_their_own_objects_beside_a_revoker_lose_nothing() {
    let b = backend(None);
    let dir = tempfile::tempdir().unwrap();
    // 64 HBM slots (two pages, one revoked midway), 24 host, 96 disk blocks.
    let s = Arc::new(store(&b, dir.path(), 2, 24, 96));
    let worker = |t: u64| {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let transient =
                |e: &Error| e.is_out_of_memory() || matches!(e, Error::LimitExceeded { .. });
            let mut mine: Vec<(strata_tiers::ObjectId, u64)> = Vec::new();
            for step in 0..100u64 {
                let seed = t * 10_000 + step;
                match next(7) {
                    0 | 1 if mine.len() < 12 => match s.put(&block(seed), Durability::Backed, t) {
                        Ok(id) => mine.push((id, seed)),
                        Err(e) => assert!(transient(&e), "put: {e}"),
                    },
                    2 if !mine.is_empty() => {
                        let k = next(mine.len() as u64) as usize;
                        match s.write(mine[k].0, &block(seed)) {
                            Ok(()) => mine[k].1 = seed,
                            Err(e) => assert!(transient(&e), "write: {e}"),
                        }
                    }
                    3 if !mine.is_empty() => {
                        let ids: Vec<_> = mine.iter().map(|m| m.0).take(4).collect();
                        let to = if next(2) == 0 { Tier::Host } else { Tier::Disk };
                        if let Err(e) = s.spill(&ids, to) {
                            assert!(transient(&e), "spill: {e}");
                        }
                    }
                    4 if !mine.is_empty() => {
                        let ids: Vec<_> = mine.iter().map(|m| m.0).rev().take(3).collect();
                        match s.prefetch(&ids) {
                            Ok(ev) => ev.synchronize().unwrap(),
                            Err(e) => assert!(transient(&e), "prefetch: {e}"),
                        }
                    }
                    5 if !mine.is_empty() => {
                        let k = next(mine.len() as u64) as usize;
                        let (id, _) = mine.swap_remove(k);
                        s.release(id).unwrap();
                    }
                    _ => {}
                }
                for &(id, seed) in &mine {
                    check(&s, id, seed);
                }
            }
            mine
        })
    };
    let workers: Vec<_> = (0..4).map(worker).collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let revoked = s.revoke_pages(&[1]).unwrap();
    assert!(revoked.lost.is_empty(), "backed objects were lost");
    for w in workers {
        for (id, seed) in w.join().unwrap() {
            check(&s, id, seed);
        }
    }
    s.synchronize().unwrap();
    s.check_invariants().unwrap();
}
