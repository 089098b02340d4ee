//! KvBlockManager on a KvSpace: spill and restore at fixed addresses through host memory and
//! disk, lookahead eviction and prefetch, revocation (lost blocks reported once), clean copies
//! of full blocks (free re-spills, lossless revocations, dropped first under host pressure),
//! bad input, and several engine threads with a revoker. Staging ahead of need: `kv_stage`;
//! random walks: `kv_walk`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::kv::*;
use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_allocator::Kind;
use strata_tiers::{RequestId, Tier};
use strata_vmm::Error;

#[test]
fn blocks_spill_when_paused_and_come_back_ahead_of_use_at_the_same_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 32, 256, dir.path());
    let a = m.admit().unwrap();
    let b = m.admit().unwrap();
    grow(&m, a, 1, 700).unwrap();
    grow(&m, a, 1, 7).unwrap();
    grow(&m, b, 2, 300).unwrap();
    assert_eq!(m.tokens(a).unwrap(), 707);
    assert_eq!(m.blocks(a).unwrap(), vec![Some(Tier::Hbm); 2]);
    let addresses = ptrs(&m, a);
    m.pause(a, Tier::Disk).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.blocks(a).unwrap(), vec![Some(Tier::Disk); 2]);
    // Only the chunks the tokens fill went down: 4 + 2 per tensor.
    assert_eq!(m.store().stats().objects, 4 * 6);
    assert_eq!(m.stats().blocks_spilled, 2);
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Disk, 2));
    // Writing into a spilled block is refused; so is appending to a spilled tail.
    assert!(matches!(
        m.write_kv(a, 0, Kind::K, 0, &[0u8; BPT as usize]),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(m.append(a, 1), Err(Error::InvalidState(_))));
    // The hint prefetches a's blocks (they fit a 20 ms window) before a runs.
    m.advance(1);
    let ev = m.hint(&[vec![a]]).unwrap().expect("a prefetch");
    ev.synchronize().unwrap();
    assert_eq!(m.blocks(a).unwrap(), vec![Some(Tier::Hbm); 2]);
    assert_eq!(m.stats().hinted_prefetches, 2);
    // Block 0 is full: its objects stay as its clean copy, kept in host memory on the way up
    // from disk, and on disk too (the same bytes: the host copy can go without a write);
    // block 1's are released.
    assert_eq!(m.store().stats().objects, 4 * 4);
    assert_eq!(m.clean_blocks(a).unwrap(), vec![0]);
    assert_eq!(m.store().stats().disk_used, 4 * 4);
    assert_eq!(m.store().stats().host_used, 4 * 4);
    assert_eq!(
        ptrs(&m, a),
        addresses,
        "addresses moved across spill and restore"
    );
    m.make_resident(&[a, b]).unwrap().synchronize().unwrap();
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 2));
    assert_eq!(verify(&m, b, 2).unwrap(), (Tier::Hbm, 1));
    m.advance(10);
    grow(&m, b, 2, 1).unwrap();
    let copied = m.store().stats().transfers.bytes_d2h;
    assert_eq!(m.spill_idle(5, Tier::Host).unwrap(), 2);
    // Block 0 went down without a copy, to its clean copy in host memory; block 1 was copied.
    assert_eq!(m.blocks(a).unwrap(), vec![Some(Tier::Host); 2]);
    assert_eq!(
        m.store().stats().transfers.bytes_d2h - copied,
        4 * 2 * CHUNK,
        "only block 1's two used chunks per tensor"
    );
    assert_eq!(m.stats().clean_spills, 1);
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Host, 2));
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    grow(&m, a, 1, 400).unwrap();
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 3));
    assert_eq!(ptrs(&m, a), addresses);
    m.check_invariants().unwrap();
    m.release(a).unwrap();
    m.release(b).unwrap();
    assert_eq!(m.store().stats().objects, 0);
    m.check_invariants().unwrap();
}

#[test]
fn unknown_stale_and_malformed_input_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(8, 16, 64, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 3, 10).unwrap();
    m.release(a).unwrap();
    let stale = |r: Result<(), Error>| assert!(matches!(r, Err(Error::StaleId { .. })), "{r:?}");
    stale(m.release(a));
    stale(m.append(a, 1));
    stale(m.take_lost(a).map(drop));
    stale(m.make_resident(&[a]).map(drop));
    stale(m.pause(a, Tier::Host));
    stale(m.kv_ptr(a, 0, Kind::K).map(drop));
    stale(m.tokens(a).map(drop));
    stale(m.blocks(a).map(drop));
    stale(m.release(RequestId(999)));
    stale(m.write_kv(RequestId(999), 0, Kind::V, 0, &[0u8; BPT as usize]));
    let b = m.admit().unwrap();
    grow(&m, b, 4, 10).unwrap();
    let invalid =
        |r: Result<(), Error>| assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    invalid(m.append(b, 0));
    invalid(m.append(b, 4 * TPB));
    invalid(m.write_kv(b, 0, Kind::K, 0, &[0u8; 3]));
    invalid(m.write_kv(b, 0, Kind::K, 9, &[0u8; 2 * BPT as usize]));
    invalid(m.read_kv(b, 0, Kind::K, 0, &mut []).map(drop));
    invalid(m.write_kv(b, LAYERS, Kind::K, 0, &[0u8; BPT as usize]));
    invalid(m.pause(b, Tier::Hbm));
    invalid(m.spill_idle(0, Tier::Hbm).map(drop));
    // Hints about unknown requests are advice: ignored.
    assert!(m.hint(&[vec![a, RequestId(999)]]).unwrap().is_none());
    assert_eq!(verify(&m, b, 4).unwrap(), (Tier::Hbm, 1));
    m.release(b).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn pressure_spills_the_request_running_furthest_away_and_a_batch_that_cannot_fit_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // 12 pages: 3 blocks of 2 layers × K/V.
    let m = manager(12, 64, 256, dir.path());
    let r: Vec<RequestId> = (0..3).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 10 + i as u64, 100 + i as u32).unwrap();
    }
    m.advance(1);
    // r[1] is not in the window: it runs furthest away.
    assert!(m.hint(&[vec![r[2]], vec![r[0]]]).unwrap().is_none());
    let d = m.admit().unwrap();
    grow(&m, d, 20, 50).unwrap();
    assert_eq!(m.blocks(r[1]).unwrap(), vec![Some(Tier::Host)]);
    for q in [r[0], r[2], d] {
        assert_eq!(m.blocks(q).unwrap(), vec![Some(Tier::Hbm)]);
    }
    assert_eq!(m.stats().evictions, 1);
    // Requests used in the current step are never spilled for room.
    m.make_resident(&[r[0], r[2]])
        .unwrap()
        .synchronize()
        .unwrap();
    let e = m.admit().unwrap();
    let full = m.append(e, 10);
    assert!(
        full.as_ref().is_err_and(|e| e.is_out_of_memory()),
        "{full:?}"
    );
    assert_eq!(m.tokens(e).unwrap(), 0);
    m.release(e).unwrap();
    // A batch of four one-block requests never fits three blocks: nothing moves.
    m.advance(2);
    let before: Vec<_> = [r[0], r[1], r[2], d]
        .iter()
        .map(|&q| m.blocks(q).unwrap())
        .collect();
    let err = m.make_resident(&[r[0], r[1], r[2], d]).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let after: Vec<_> = [r[0], r[1], r[2], d]
        .iter()
        .map(|&q| m.blocks(q).unwrap())
        .collect();
    assert_eq!(before, after);
    m.check_invariants().unwrap();
    // Every request comes back whole, whichever ones have to go down for it.
    for (i, &q) in r.iter().enumerate() {
        m.advance(3 + i as u64);
        m.make_resident(&[q]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, q, 10 + i as u64).unwrap(), (Tier::Hbm, 1));
    }
    assert_eq!(verify(&m, d, 20).unwrap().1, 1);
    m.check_invariants().unwrap();
}

/// A scheduler whose batch did not fit runs a shorter one: the failed `make_resident` must not
/// have marked the request it drops as used in this step, or nothing could spill for room.
#[test]
fn a_batch_that_did_not_fit_leaves_its_requests_spillable_for_a_shorter_one() {
    let dir = tempfile::tempdir().unwrap();
    // 12 pages: 3 blocks of 2 layers × K/V; four one-block requests.
    let m = manager(12, 64, 256, dir.path());
    let r: Vec<RequestId> = (0..4).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        m.advance(1 + i as u64);
        grow(&m, q, 60 + i as u64, 100).unwrap();
    }
    let down: Vec<RequestId> = r
        .iter()
        .copied()
        .filter(|&q| m.blocks(q).unwrap() != vec![Some(Tier::Hbm)])
        .collect();
    assert_eq!(down.len(), 1, "one of four spilled for room");
    m.advance(10);
    let err = m.make_resident(&r).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    // The shorter batch: the spilled request and two others; the fourth has to go down.
    let mut shorter = down.clone();
    shorter.extend(r.iter().copied().filter(|q| !down.contains(q)).take(2));
    m.make_resident(&shorter).unwrap().synchronize().unwrap();
    for (i, &q) in r.iter().enumerate() {
        let want = if shorter.contains(&q) {
            Tier::Hbm
        } else {
            Tier::Host
        };
        assert_eq!(m.blocks(q).unwrap(), vec![Some(want)], "request {i}");
        assert_eq!(verify(&m, q, 60 + i as u64).unwrap().1, 1);
    }
    m.check_invariants().unwrap();
}

#[test]
fn the_queue_makes_pressure_spill_its_tail_not_its_head() {
    let dir = tempfile::tempdir().unwrap();
    // 12 pages: 3 blocks of 2 layers × K/V.
    let m = manager(12, 64, 256, dir.path());
    let r: Vec<RequestId> = (0..3).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 30 + i as u64, 100 + i as u32).unwrap();
    }
    m.advance(1);
    // Nothing in the window; r[0] is least recently used, so without the queue it would go.
    // The queue says r[0] runs next and r[1] last: r[1] spills.
    assert!(m.hint(&[vec![]]).unwrap().is_none());
    m.queue(&[r[0], r[2], r[1]]).unwrap();
    let d = m.admit().unwrap();
    grow(&m, d, 40, 50).unwrap();
    assert_eq!(m.blocks(r[1]).unwrap(), vec![Some(Tier::Host)]);
    assert_eq!(m.blocks(r[0]).unwrap(), vec![Some(Tier::Hbm)]);
    assert_eq!(m.blocks(r[2]).unwrap(), vec![Some(Tier::Hbm)]);
    // A request in neither the window nor the queue goes before any queued one.
    m.advance(2);
    m.queue(&[r[0], r[2]]).unwrap();
    let e = m.admit().unwrap();
    grow(&m, e, 50, 50).unwrap();
    assert_eq!(m.blocks(d).unwrap(), vec![Some(Tier::Host)]);
    for (q, seed) in [(r[0], 30), (r[2], 32)] {
        assert_eq!(verify(&m, q, seed).unwrap(), (Tier::Hbm, 1));
    }
    m.check_invariants().unwrap();
}

#[test]
fn revoked_blocks_are_lost_reported_once_and_rebuilt_at_the_same_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(12, 64, 256, dir.path());
    let a = m.admit().unwrap();
    let b = m.admit().unwrap();
    grow(&m, a, 5, 2 * TPB + 10).unwrap(); // 3 blocks: the whole pool
    m.release(b).unwrap();
    let addresses = ptrs(&m, a);
    m.advance(1);
    // 4 pages = one block of a: its last one, lost without a copy.
    let rev = m.revoke(4).unwrap();
    assert_eq!(rev.pages.len(), 4);
    assert_eq!(rev.lost, vec![(a, vec![2])]);
    m.check_invariants().unwrap();
    assert_eq!(
        m.blocks(a).unwrap(),
        vec![Some(Tier::Hbm), Some(Tier::Hbm), None]
    );
    assert!(matches!(m.make_resident(&[a]), Err(Error::InvalidState(_))));
    assert!(matches!(m.append(a, 1), Err(Error::InvalidState(_))));
    let mut buf = vec![0u8; BPT as usize];
    assert!(matches!(
        m.read_kv(a, 1, Kind::V, 2 * TPB, &mut buf),
        Err(Error::InvalidState(_))
    ));
    assert_eq!(m.take_lost(a).unwrap(), vec![2]);
    assert_eq!(
        m.take_lost(a).unwrap(),
        Vec::<usize>::new(),
        "reported twice"
    );
    assert_eq!(m.stats().lost_blocks, 1);
    // Fewer pages now: block 2 comes back only once another block is down.
    assert!(m.make_resident(&[a]).unwrap_err().is_out_of_memory());
    m.pause(a, Tier::Host).unwrap();
    // The lender gives the pages back; the engine recomputes the lost block.
    m.store().pool().give(rev.pages);
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    fill(&m, a, 5, 2 * TPB, 10).unwrap();
    assert_eq!(verify(&m, a, 5).unwrap(), (Tier::Hbm, 3));
    assert_eq!(ptrs(&m, a), addresses);
    assert_eq!(m.stats().pages_revoked, 4);
    m.release(a).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn revoke_spilling_copies_victims_down_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(12, 64, 256, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 6, 2 * TPB + 10).unwrap(); // 3 blocks: the whole pool
    assert_eq!(m.requests_with_lost(), vec![]);
    m.advance(1);
    let pages = m.revoke_spilling(4).unwrap();
    assert_eq!(pages.len(), 4);
    // The victim went down whole, with copies: spilled, nothing lost.
    assert_eq!(m.blocks(a).unwrap(), vec![Some(Tier::Host); 3]);
    assert_eq!(m.stats().lost_blocks, 0);
    assert_eq!(m.requests_with_lost(), vec![]);
    assert_eq!(verify(&m, a, 6).unwrap(), (Tier::Host, 3));
    m.check_invariants().unwrap();
    // More than the device holds: an error, still nothing lost.
    assert!(m.revoke_spilling(1 << 20).unwrap_err().is_out_of_memory());
    m.store().pool().give(pages);
    let before = m.stats();
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    let after = m.stats();
    // Restored on demand: three prefetch misses, one stall.
    assert_eq!(after.demand_restores - before.demand_restores, 3);
    assert_eq!(after.stalls - before.stalls, 1);
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(m.stats().stalls, after.stalls, "nothing to copy: no stall");
    assert_eq!(verify(&m, a, 6).unwrap(), (Tier::Hbm, 3));
    m.release(a).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn a_lossy_revocation_that_runs_dry_leaves_its_losses_findable() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(12, 64, 256, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 7, 2 * TPB).unwrap();
    m.advance(1);
    assert!(m.revoke(1 << 20).unwrap_err().is_out_of_memory());
    assert_eq!(m.requests_with_lost(), vec![a]);
    assert_eq!(m.take_lost(a).unwrap(), vec![0, 1]);
    assert_eq!(m.requests_with_lost(), vec![]);
    assert!(matches!(
        m.append(a, 4 * TPB),
        Err(Error::InvalidArgument(msg)) if msg.contains("max_tokens")
    ));
}

/// A lossy revocation far larger than the pool's free pages: the device's spare pages are
/// created once, then every lost block's pages are taken as they come back, without asking
/// the driver again per block (it used to retry creating every missing page per lost block).
#[test]
fn a_lossy_revocation_asks_the_driver_once_not_once_per_lost_block() {
    use std::sync::atomic::AtomicU64;
    use strata_vmm::host::FaultOp;
    let dir = tempfile::tempdir().unwrap();
    // The zero page, four requests of four blocks (64 pages) and 3 spare pages.
    let b = strata_vmm::host::open(strata_vmm::HostConfig {
        devices: vec![(1 + 64 + 3) * PAGE],
        granularity: PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let m = manager_on(pool(&b), 64, 256, dir.path());
    let r: Vec<RequestId> = (0..4).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 80 + i as u64, 4 * TPB).unwrap();
    }
    assert_eq!(b.mem_info(0).unwrap().free, 3 * PAGE);
    m.advance(1);
    let creates = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&creates);
    let host = b
        .as_any()
        .downcast_ref::<strata_vmm::HostBackend>()
        .unwrap();
    host.set_op_gate(
        FaultOp::Create,
        Some(Arc::new(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
        })),
    );
    // 40 pages: the 3 spare ones and 37 of ten lost blocks.
    let rev = m.revoke(40).unwrap();
    host.set_op_gate(FaultOp::Create, None);
    assert_eq!(rev.pages.len(), 40);
    let lost: usize = rev.lost.iter().map(|(_, ps)| ps.len()).sum();
    assert_eq!(lost, 10);
    // One try for all 40 (3 created, the 4th refused), then one page at a time (3 created,
    // the 4th refused): 8 calls whatever the number of lost blocks.
    assert_eq!(creates.load(Ordering::SeqCst), 8);
    m.check_invariants().unwrap();
    m.store().pool().give(rev.pages);
}

/// Bytes copied device → host so far (spills).
#[test]
fn a_full_restored_block_spills_again_without_a_copy_and_keeps_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 256, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 3, 2 * TPB + 10).unwrap(); // blocks 0 and 1 full, block 2 holds 10 tokens
    m.pause(a, Tier::Host).unwrap();
    for round in 0..3 {
        m.make_resident(&[a]).unwrap().synchronize().unwrap();
        assert_eq!(m.clean_blocks(a).unwrap(), vec![0, 1]);
        assert_eq!(verify(&m, a, 3).unwrap(), (Tier::Hbm, 3));
        let before = bytes_down(&m);
        m.pause(a, Tier::Host).unwrap();
        m.check_invariants().unwrap();
        // Only block 2 moved: one used chunk in each of the 4 tensors.
        assert_eq!(bytes_down(&m) - before, 4 * CHUNK, "round {round}");
        assert_eq!(m.stats().clean_spills, 2 * (round + 1));
        assert_eq!(m.blocks(a).unwrap(), vec![Some(Tier::Host); 3]);
        assert_eq!(verify(&m, a, 3).unwrap(), (Tier::Host, 3));
    }
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(verify(&m, a, 3).unwrap(), (Tier::Hbm, 3));
    assert_eq!(m.stats().blocks_clean, 2);
    m.release(a).unwrap();
    assert_eq!(m.store().stats().objects, 0, "release drops clean copies");
    m.check_invariants().unwrap();
}

#[test]
fn revoking_a_clean_block_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(12, 64, 256, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 5, 2 * TPB + 10).unwrap(); // 3 blocks: the whole pool
    m.pause(a, Tier::Host).unwrap();
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(m.clean_blocks(a).unwrap(), vec![0, 1]);
    m.advance(1);
    // 4 pages = one block: the last clean one (1) goes down instead of the dirty block 2.
    let rev = m.revoke(4).unwrap();
    assert_eq!(rev.pages.len(), 4);
    assert!(rev.lost.is_empty(), "{:?}", rev.lost);
    assert_eq!(m.take_lost(a).unwrap(), Vec::<usize>::new());
    assert_eq!(
        m.blocks(a).unwrap(),
        vec![Some(Tier::Hbm), Some(Tier::Host), Some(Tier::Hbm)]
    );
    let s = m.stats();
    assert_eq!((s.lost_blocks, s.clean_revocations), (0, 1));
    m.check_invariants().unwrap();
    assert_eq!(verify(&m, a, 5).unwrap(), (Tier::Host, 3));
    m.store().pool().give(rev.pages);
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(verify(&m, a, 5).unwrap(), (Tier::Hbm, 3));
    m.release(a).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn a_block_that_is_written_again_never_keeps_a_stale_copy() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 256, dir.path());
    // Partly filled when restored: no clean copy; the append after it reaches the store.
    let a = m.admit().unwrap();
    grow(&m, a, 7, 100).unwrap();
    m.pause(a, Tier::Host).unwrap();
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(m.clean_blocks(a).unwrap(), Vec::<usize>::new());
    grow(&m, a, 7, TPB - 100).unwrap(); // block 0 full now
    m.pause(a, Tier::Host).unwrap();
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(verify(&m, a, 7).unwrap(), (Tier::Hbm, 1));
    // Full and clean; a write into it (a host-side rewrite) drops the copy.
    assert_eq!(m.clean_blocks(a).unwrap(), vec![0]);
    let b = m.admit().unwrap();
    grow(&m, b, 8, TPB).unwrap();
    for (t, l, k) in tensors() {
        m.write_kv(a, l, k, 0, &pattern(8, t, 0, TPB)).unwrap();
    }
    assert_eq!(m.clean_blocks(a).unwrap(), Vec::<usize>::new());
    m.check_invariants().unwrap();
    let before = bytes_down(&m);
    m.pause(a, Tier::Host).unwrap();
    assert_eq!(
        bytes_down(&m) - before,
        16 * CHUNK,
        "the rewritten block is copied"
    );
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(
        verify(&m, a, 8).unwrap(),
        (Tier::Hbm, 1),
        "new bytes, not old"
    );
    m.release(a).unwrap();
    m.release(b).unwrap();
    assert_eq!(m.store().stats().objects, 0);
}

#[test]
fn host_pressure_drops_clean_copies_before_moving_anything_to_disk() {
    let dir = tempfile::tempdir().unwrap();
    // The host tier holds 2 blocks (16 chunks each).
    let m = manager(16, 32, 256, dir.path());
    let a = m.admit().unwrap();
    let b = m.admit().unwrap();
    grow(&m, a, 1, 2 * TPB).unwrap();
    grow(&m, b, 2, TPB).unwrap();
    m.pause(a, Tier::Host).unwrap();
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(m.clean_blocks(a).unwrap(), vec![0, 1]); // the host tier is full of them
    let written = m.store().stats().disk_write_bytes;
    m.pause(b, Tier::Host).unwrap();
    let st = m.store().stats();
    assert_eq!(
        st.disk_write_bytes, written,
        "a sole copy or a clean one went to disk"
    );
    assert_eq!(st.redundant_dropped, 16);
    assert_eq!(m.blocks(b).unwrap(), vec![Some(Tier::Host)]);
    assert!(m.clean_blocks(a).unwrap().len() < 2);
    m.check_invariants().unwrap();
    // a's blocks are intact; its next spill copies what lost its clean copy, reports no loss.
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 2));
    m.pause(a, Tier::Host).unwrap();
    assert_eq!(m.take_lost(a).unwrap(), Vec::<usize>::new());
    assert_eq!(m.stats().lost_blocks, 0);
    m.check_invariants().unwrap();
    for (r, seed) in [(a, 1), (b, 2)] {
        m.make_resident(&[r]).unwrap().synchronize().unwrap();
        verify(&m, r, seed).unwrap();
    }
    m.release(a).unwrap();
    m.release(b).unwrap();
    assert_eq!(m.store().stats().objects, 0);
}

#[test]
fn engine_threads_and_a_revoker() {
    let dir = tempfile::tempdir().unwrap();
    // 32 pages (8 blocks) on a 64 MiB device; the revoker takes 3 × 4 of them while the
    // engines run and gives them back at the end.
    let m = Arc::new(manager(32, 96, 1024, dir.path()));
    let clock = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for t in 0..3u64 {
        let m = Arc::clone(&m);
        let clock = Arc::clone(&clock);
        workers.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(7 + t);
            let mut live: Vec<(RequestId, u64)> = Vec::new();
            let (mut verified, mut lost_seen) = (0usize, 0usize);
            let ok_failure =
                |e: &Error| e.is_out_of_memory() || matches!(e, Error::InvalidState(_));
            for i in 0..60u64 {
                m.advance(clock.fetch_add(1, Ordering::Relaxed) + 1);
                if live.len() < 3 {
                    let Ok(r) = m.admit() else { continue };
                    let seed = t * 1000 + i;
                    match grow(&m, r, seed, rng.random_range(1..600)) {
                        Ok(()) => live.push((r, seed)),
                        Err(e) => {
                            assert!(ok_failure(&e), "{e}");
                            lost_seen += m.take_lost(r).unwrap().len();
                            m.release(r).unwrap();
                        }
                    }
                    continue;
                }
                let k = rng.random_range(0..live.len());
                let (r, seed) = live[k];
                let lost = m.take_lost(r).unwrap();
                lost_seen += lost.len();
                let res = m.make_resident(&[r]).and_then(|ev| ev.synchronize());
                let mut keep = true;
                match res {
                    Ok(()) => {
                        // Recompute what a revocation took, then check everything.
                        let have = m.tokens(r).unwrap();
                        for &p in &lost {
                            let first = p as u32 * TPB;
                            let n = (have - first).min(TPB);
                            if let Err(e) = fill(&m, r, seed, first, n) {
                                assert!(ok_failure(&e), "{e}");
                                keep = false;
                            }
                        }
                        if keep {
                            match verify(&m, r, seed) {
                                Ok((_, n)) => verified += n,
                                Err(e) => assert!(ok_failure(&e), "{e}"),
                            }
                        }
                        if keep && have < 1500 {
                            if let Err(e) = grow(&m, r, seed, 8) {
                                assert!(ok_failure(&e), "{e}");
                                // Appended but not (all) written: the engine drops it.
                                keep = m.tokens(r).unwrap() == have;
                            }
                        }
                    }
                    Err(e) => assert!(ok_failure(&e), "{e}"),
                }
                if !keep || rng.random_bool(0.2) {
                    let (r, _) = live.swap_remove(k);
                    lost_seen += m.take_lost(r).unwrap().len();
                    m.release(r).unwrap();
                } else if rng.random_bool(0.2) {
                    let to = if rng.random_bool(0.5) {
                        Tier::Host
                    } else {
                        Tier::Disk
                    };
                    if let Err(e) = m.pause(r, to) {
                        assert!(ok_failure(&e), "{e}");
                    }
                }
            }
            for (r, _) in live {
                lost_seen += m.take_lost(r).unwrap().len();
                m.release(r).unwrap();
            }
            (verified, lost_seen)
        }));
    }
    let revoker = {
        let m = Arc::clone(&m);
        std::thread::spawn(move || {
            let mut held = Vec::new();
            let mut reported = 0;
            for _ in 0..3 {
                std::thread::sleep(Duration::from_millis(30));
                match m.revoke(4) {
                    Ok(rev) => {
                        reported += rev.lost.iter().map(|(_, ps)| ps.len()).sum::<usize>();
                        held.extend(rev.pages);
                    }
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
                m.check_invariants().unwrap();
            }
            (held, reported)
        })
    };
    let (mut verified, mut lost_seen) = (0, 0);
    for w in workers {
        let (v, l) = w.join().unwrap();
        verified += v;
        lost_seen += l;
    }
    let (held, reported) = revoker.join().unwrap();
    assert!(verified > 0);
    let stats = m.stats();
    // Every lost block was reported by the revocation and once by take_lost.
    assert_eq!(stats.lost_blocks as usize, reported);
    assert_eq!(lost_seen, reported);
    // Counted are the pages taken from the space; free pool pages and new ones are not.
    assert!(stats.pages_revoked as usize <= held.len());
    m.store().pool().give(held);
    m.check_invariants().unwrap();
    assert_eq!(m.store().stats().objects, 0);
    assert_eq!(stats.blocks, 0);
}

#[test]
fn truncate_returns_the_pages_and_copies_past_the_kept_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 64, dir.path());
    let in_use = || m.store().pool().stats().in_use;
    let a = m.admit().unwrap();
    grow(&m, a, 1, 1300).unwrap();
    let addresses = ptrs(&m, a);
    let before = in_use();
    // Resident: the third block's page in each of the 4 tensors goes back to the pool.
    m.truncate(a, 600).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.tokens(a).unwrap(), 600);
    assert_eq!(before - in_use(), 4);
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 2));
    // Spilled: the copies of the blocks cut off are released.
    grow(&m, a, 1, 700).unwrap();
    m.pause(a, Tier::Host).unwrap();
    assert_eq!(m.store().stats().objects, 4 * (4 + 4 + 3));
    m.truncate(a, 1000).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.store().stats().objects, 4 * (4 + 4));
    m.make_resident(&[a]).unwrap().synchronize().unwrap();
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 2));
    // Block 0 is full and clean; cutting into block 1 keeps block 0's clean copy.
    assert_eq!(m.clean_blocks(a).unwrap(), vec![0]);
    m.truncate(a, 512).unwrap();
    assert_eq!(m.clean_blocks(a).unwrap(), vec![0]);
    // Cutting into block 0 drops its clean copy: its bytes are about to change.
    m.truncate(a, 500).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.clean_blocks(a).unwrap(), Vec::<usize>::new());
    assert_eq!(m.store().stats().objects, 0);
    // The request grows again at the same addresses.
    grow(&m, a, 1, 800).unwrap();
    assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 3));
    assert_eq!(ptrs(&m, a), addresses);
    // Above the length: refused, nothing changed; to zero: every page back.
    assert!(matches!(
        m.truncate(a, 1301),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.tokens(a).unwrap(), 1300);
    let mapped = in_use();
    m.truncate(a, 0).unwrap();
    assert_eq!(mapped - in_use(), 4 * 3);
    m.check_invariants().unwrap();
    m.release(a).unwrap();
    assert!(matches!(m.truncate(a, 0), Err(Error::StaleId { .. })));
}
