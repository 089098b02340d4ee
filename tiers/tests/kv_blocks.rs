//! KvBlockManager on a KvSpace: spill and restore at fixed addresses through host memory and
//! disk, lookahead eviction and prefetch, revocation (lost blocks reported once), clean copies
//! of full blocks (free re-spills, lossless revocations, dropped first under host pressure),
//! bad input, and several engine threads with a revoker.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_allocator::{Kind, PagePool, PoolConfig};
use strata_tiers::policy::Links;
use strata_tiers::{
    DiskConfig, KvBlockManager, KvBlocksConfig, PolicyKind, RequestId, StoreConfig, Tier, TierSpec,
    TierStore,
};
use strata_vmm::Error;

const PAGE: u64 = 2 << 20;
const LAYERS: u32 = 2;
/// Bytes per token per tensor: 512 tokens per block.
const BPT: u64 = 4096;
const TPB: u32 = (PAGE / BPT) as u32;
/// The store's copy unit: 4 per tensor page.
const CHUNK: u64 = 512 << 10;

/// A manager whose pool holds at most `pool_pages` pages (4 per block), with host and disk
/// tiers of `host_chunks` and `disk_chunks` store blocks.
fn manager(
    pool_pages: u64,
    host_chunks: u64,
    disk_chunks: u64,
    dir: &std::path::Path,
) -> KvBlockManager {
    let b = backend(None);
    let pool = PagePool::new(
        Arc::clone(&b),
        0,
        PoolConfig {
            background: false,
            limit: Some(pool_pages * PAGE),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    manager_on(pool, host_chunks, disk_chunks, dir)
}

/// A manager over `pool`, with host and disk tiers of `host_chunks` and `disk_chunks` store
/// blocks.
fn manager_on(
    pool: Arc<PagePool>,
    host_chunks: u64,
    disk_chunks: u64,
    dir: &std::path::Path,
) -> KvBlockManager {
    let mut c = StoreConfig::new(CHUNK, 0, host_chunks * CHUNK);
    // As strata_kv_create: the host tier sends the blocks of the request running last to disk.
    c.host_policy = PolicyKind::Lookahead;
    c.disk = Some(DiskConfig {
        dir: dir.to_path_buf(),
        spec: TierSpec {
            capacity: disk_chunks * CHUNK,
            bandwidth: 7e9,
            latency: Duration::from_micros(80),
        },
        io_threads: 2,
        direct: true,
    });
    c.staging_blocks = 8;
    let store = Arc::new(TierStore::new(pool, c).unwrap());
    KvBlockManager::new(
        store,
        KvBlocksConfig {
            layers: LAYERS,
            max_requests: 16,
            max_tokens: 4 * TPB,
            bytes_per_token: BPT,
            t_iter: Duration::from_millis(20),
            delta_sched: Duration::ZERO,
            links: Links {
                host_to_hbm: (Duration::from_micros(5), 50e9),
                disk_to_host: (Duration::from_micros(80), 7e9),
            },
            zero_page: true,
        },
    )
    .unwrap()
}

fn tensors() -> impl Iterator<Item = (usize, u32, Kind)> {
    (0..LAYERS)
        .flat_map(|l| [(l, Kind::K), (l, Kind::V)])
        .enumerate()
        .map(|(t, (l, k))| (t, l, k))
}

fn pattern(seed: u64, t: usize, from: u32, n: u32) -> Vec<u8> {
    let mut v = vec![0u8; (u64::from(n) * BPT) as usize];
    strata_kernels::pattern::fill(&mut v, seed * 64 + t as u64, u64::from(from) * BPT);
    v
}

/// Writes the pattern of `seed` into tokens `from..from + n` of every tensor of `r`.
fn fill(m: &KvBlockManager, r: RequestId, seed: u64, from: u32, n: u32) -> Result<(), Error> {
    for (t, l, k) in tensors() {
        m.write_kv(r, l, k, from, &pattern(seed, t, from, n))?;
    }
    Ok(())
}

/// Appends `n` tokens to `r` and writes them.
fn grow(m: &KvBlockManager, r: RequestId, seed: u64, n: u32) -> Result<(), Error> {
    let have = m.tokens(r)?;
    m.append(r, n)?;
    fill(m, r, seed, have, n)
}

/// Reads every token of `r` in every tensor and checks it; returns the slowest tier read and
/// the blocks checked.
fn verify(m: &KvBlockManager, r: RequestId, seed: u64) -> Result<(Tier, usize), Error> {
    let total = m.tokens(r)?;
    let mut slowest = Tier::Hbm;
    for (t, l, k) in tensors() {
        let mut buf = vec![0u8; (u64::from(total) * BPT) as usize];
        slowest = slowest.max(m.read_kv(r, l, k, 0, &mut buf)?);
        assert_eq!(
            strata_kernels::pattern::first_mismatch(&buf, seed * 64 + t as u64, 0),
            None,
            "request {r:?} tensor {t}"
        );
    }
    Ok((slowest, total.div_ceil(TPB) as usize))
}

fn ptrs(m: &KvBlockManager, r: RequestId) -> Vec<u64> {
    tensors()
        .map(|(_, l, k)| m.kv_ptr(r, l, k).unwrap())
        .collect()
}

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
    m.queue(&[r[0], r[2], r[1]]);
    let d = m.admit().unwrap();
    grow(&m, d, 40, 50).unwrap();
    assert_eq!(m.blocks(r[1]).unwrap(), vec![Some(Tier::Host)]);
    assert_eq!(m.blocks(r[0]).unwrap(), vec![Some(Tier::Hbm)]);
    assert_eq!(m.blocks(r[2]).unwrap(), vec![Some(Tier::Hbm)]);
    // A request in neither the window nor the queue goes before any queued one.
    m.advance(2);
    m.queue(&[r[0], r[2]]);
    let e = m.admit().unwrap();
    grow(&m, e, 50, 50).unwrap();
    assert_eq!(m.blocks(d).unwrap(), vec![Some(Tier::Host)]);
    for (q, seed) in [(r[0], 30), (r[2], 32)] {
        assert_eq!(verify(&m, q, seed).unwrap(), (Tier::Hbm, 1));
    }
    m.check_invariants().unwrap();
}

/// TierKV's order for the host tier: a full host tier sends the blocks of the request that runs
/// last to disk (never one that runs sooner), and `stage` brings the disk blocks of the next
/// request up to host memory ahead of its restore, taking room only from requests that run
/// later.
#[test]
fn host_room_follows_the_queue_and_stage_brings_the_next_request_up_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    // The host tier holds one full block (2 layers × K/V × 4 chunks).
    let m = manager(16, 16, 256, dir.path());
    let r: Vec<RequestId> = (0..3).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 60 + i as u64, TPB).unwrap();
    }
    m.queue(&[r[0], r[1], r[2]]);
    m.pause(r[0], Tier::Host).unwrap();
    // r[2] and r[1] run after r[0]: they go to disk rather than push r[0] there.
    m.pause(r[2], Tier::Host).unwrap();
    m.pause(r[1], Tier::Host).unwrap();
    let tiers = |m: &KvBlockManager| -> Vec<Vec<Option<Tier>>> {
        r.iter().map(|&q| m.blocks(q).unwrap()).collect()
    };
    assert_eq!(
        tiers(&m),
        vec![
            vec![Some(Tier::Host)],
            vec![Some(Tier::Disk)],
            vec![Some(Tier::Disk)]
        ]
    );
    // r[0] ran; now r[1] runs next and r[0] last: staging r[1] moves r[0]'s blocks to disk to
    // make room.
    m.queue(&[r[1], r[2], r[0]]);
    let read_before = m.store().stats().disk_read_bytes;
    assert_eq!(m.stage(&[r[1]]).unwrap(), 16);
    assert_eq!(
        tiers(&m),
        vec![
            vec![Some(Tier::Disk)],
            vec![Some(Tier::Host)],
            vec![Some(Tier::Disk)]
        ]
    );
    assert_eq!(m.store().stats().disk_read_bytes - read_before, 16 * CHUNK);
    assert_eq!(m.store().stats().staged, 16);
    // r[2] runs after r[1]: staging it would displace r[1]'s blocks, so nothing moves.
    assert_eq!(m.stage(&[r[2]]).unwrap(), 0);
    assert_eq!(m.blocks(r[2]).unwrap(), vec![Some(Tier::Disk)]);
    // r[1] comes back from host memory: one hop, nothing read from disk.
    let read_before = m.store().stats().disk_read_bytes;
    m.make_resident(&[r[1]]).unwrap().synchronize().unwrap();
    assert_eq!(m.store().stats().disk_read_bytes, read_before);
    for (i, &q) in r.iter().enumerate() {
        m.make_resident(&[q]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, q, 60 + i as u64).unwrap(), (Tier::Hbm, 1));
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
fn bytes_down(m: &KvBlockManager) -> u64 {
    m.store().stats().transfers.bytes_d2h
}

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
    assert_eq!(stats.pages_revoked as usize, held.len());
    m.store().pool().give(held);
    m.check_invariants().unwrap();
    assert_eq!(m.store().stats().objects, 0);
    assert_eq!(stats.blocks, 0);
}

/// A request of the walk's model: its pattern seed and the blocks it must recompute.
struct Model {
    id: RequestId,
    seed: u64,
    /// Lost and not yet reported by `take_lost`.
    unreported: Vec<usize>,
    /// Reported: recomputed after the next successful `make_resident`.
    to_rebuild: Vec<usize>,
    /// Full blocks restored and resident since: the manager's clean blocks are among them (the
    /// store may drop some copies for room).
    clean: BTreeSet<usize>,
}

/// Blocks of `r` that are spilled (not resident, not lost).
fn spilled(m: &KvBlockManager, r: RequestId) -> BTreeSet<usize> {
    let blocks = m.blocks(r).unwrap();
    (0..blocks.len())
        .filter(|&p| blocks[p].is_some_and(|t| t != Tier::Hbm))
        .collect()
}

/// The model's clean blocks gain `was_spilled` blocks of `q` now resident and full.
fn restored(m: &KvBlockManager, q: &mut Model, was_spilled: &BTreeSet<usize>) {
    let tokens = m.tokens(q.id).unwrap();
    let blocks = m.blocks(q.id).unwrap();
    q.clean.extend(
        was_spilled
            .iter()
            .filter(|&&p| blocks[p] == Some(Tier::Hbm) && (p as u32 + 1) * TPB <= tokens),
    );
}

/// Rewrites the pattern of block `p` of `r` (the engine's recomputation).
fn rebuild(m: &KvBlockManager, r: RequestId, seed: u64, p: usize) -> Result<(), Error> {
    let tokens = m.tokens(r)?;
    let first = p as u32 * TPB;
    fill(m, r, seed, first, (tokens - first).min(TPB))
}

/// One random walk: every operation, its expected outcome from the model, the invariant checker
/// after every step, every request's bytes checked whenever none of its blocks is lost. Returns
/// the clean hits (spills without a copy, revocations without loss).
fn walk(seed: u64, steps: u32) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(24, 32, 400, dir.path());
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live: Vec<Model> = Vec::new();
    let mut held = Vec::new();
    let (mut step, mut lost_total, mut checked) = (0u64, 0usize, 0usize);
    for i in 0..steps {
        let op = rng.random_range(0..11);
        let pick = |rng: &mut SmallRng, n: usize| rng.random_range(0..n.max(1));
        match op {
            0 if live.len() < 16 => {
                let id = m.admit().unwrap();
                live.push(Model {
                    id,
                    seed: seed * 10_000 + u64::from(i),
                    unreported: Vec::new(),
                    to_rebuild: Vec::new(),
                    clean: BTreeSet::new(),
                });
            }
            1 | 2 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                let q = &live[k];
                let have = m.tokens(q.id).unwrap();
                let n = rng.random_range(1..200u32).min(4 * TPB - have);
                if n == 0 {
                    continue;
                }
                let first = (have / TPB) as usize;
                let blocked = !q.unreported.is_empty()
                    || m.blocks(q.id).unwrap()[first.min(m.blocks(q.id).unwrap().len())..]
                        .iter()
                        .any(|t| *t != Some(Tier::Hbm));
                match m.append(q.id, n) {
                    Ok(()) => {
                        assert!(!blocked, "append onto a block that is not resident");
                        fill(&m, q.id, q.seed, have, n).unwrap();
                    }
                    Err(Error::InvalidState(_)) => assert!(blocked),
                    Err(e) => {
                        assert!(e.is_out_of_memory(), "{e}");
                        assert_eq!(m.tokens(q.id).unwrap(), have);
                    }
                }
            }
            3 | 4 if !live.is_empty() => {
                let batch: Vec<usize> = (0..rng.random_range(1..=3))
                    .map(|_| pick(&mut rng, live.len()))
                    .collect();
                let ids: Vec<RequestId> = batch.iter().map(|&k| live[k].id).collect();
                // Resident, spilled (host or disk: victims spilled for room may push spilled
                // chunks from host to disk) or lost.
                let state = |r: RequestId| -> Vec<Option<bool>> {
                    let blocks = m.blocks(r).unwrap();
                    blocks.iter().map(|t| t.map(|t| t == Tier::Hbm)).collect()
                };
                let before: Vec<_> = ids.iter().map(|&r| state(r)).collect();
                let was_spilled: Vec<_> = ids.iter().map(|&r| spilled(&m, r)).collect();
                let lost_first = batch.iter().any(|&k| !live[k].unreported.is_empty());
                match m.make_resident(&ids) {
                    Ok(ev) => {
                        assert!(!lost_first);
                        ev.synchronize().unwrap();
                        for (j, &k) in batch.iter().enumerate() {
                            let q = &mut live[k];
                            // Every full block restored keeps a clean copy, at first.
                            let before = q.clean.clone();
                            restored(&m, q, &was_spilled[j]);
                            let fresh: BTreeSet<usize> =
                                q.clean.difference(&before).copied().collect();
                            let clean: BTreeSet<usize> =
                                m.clean_blocks(q.id).unwrap().into_iter().collect();
                            assert!(fresh.is_subset(&clean), "{fresh:?} not in {clean:?}");
                            assert!(m
                                .blocks(q.id)
                                .unwrap()
                                .iter()
                                .all(|t| *t == Some(Tier::Hbm)));
                            for p in std::mem::take(&mut q.to_rebuild) {
                                rebuild(&m, q.id, q.seed, p).unwrap();
                            }
                            // Back at the same addresses, with the same bytes.
                            if m.tokens(q.id).unwrap() > 0 {
                                let (tier, n) = verify(&m, q.id, q.seed).unwrap();
                                assert_eq!(tier, Tier::Hbm);
                                checked += n;
                            }
                        }
                    }
                    Err(Error::InvalidState(_)) => assert!(lost_first),
                    Err(e) => {
                        assert!(e.is_out_of_memory(), "{e}");
                        let after: Vec<_> = ids.iter().map(|&r| state(r)).collect();
                        assert_eq!(before, after, "a failed make_resident moved blocks");
                    }
                }
            }
            5 if !live.is_empty() => {
                let q = &live[pick(&mut rng, live.len())];
                let to = if rng.random_bool(0.5) {
                    Tier::Host
                } else {
                    Tier::Disk
                };
                // When every resident block is clean, the spill copies nothing.
                let blocks = m.blocks(q.id).unwrap();
                let resident: Vec<usize> = (0..blocks.len())
                    .filter(|&p| blocks[p] == Some(Tier::Hbm))
                    .collect();
                let all_clean = resident == m.clean_blocks(q.id).unwrap();
                let down = bytes_down(&m);
                match m.pause(q.id, to) {
                    Ok(()) => {
                        assert!(!m.blocks(q.id).unwrap().contains(&Some(Tier::Hbm)));
                        if all_clean {
                            assert_eq!(bytes_down(&m), down, "a clean spill copied");
                        }
                    }
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
            }
            6 => {
                let schedule: Vec<Vec<RequestId>> = (0..2)
                    .map(|_| {
                        live.iter()
                            .filter(|_| rng.random_bool(0.3))
                            .map(|q| q.id)
                            .collect()
                    })
                    .collect();
                let was_spilled: Vec<_> = live.iter().map(|q| spilled(&m, q.id)).collect();
                if let Some(ev) = m.hint(&schedule).unwrap() {
                    ev.synchronize().unwrap();
                }
                for (q, was) in live.iter_mut().zip(&was_spilled) {
                    restored(&m, q, was);
                }
            }
            7 => {
                step += 1;
                m.advance(step);
                if rng.random_bool(0.3) {
                    m.spill_idle(2, Tier::Host).unwrap();
                }
            }
            8 => {
                if held.len() < 12 && rng.random_bool(0.6) {
                    let clean: Vec<Vec<usize>> =
                        live.iter().map(|q| m.clean_blocks(q.id).unwrap()).collect();
                    let kept = m.stats().clean_revocations;
                    match m.revoke(4) {
                        Ok(rev) => {
                            assert_eq!(rev.pages.len(), 4);
                            held.extend(rev.pages);
                            for (r, ps) in rev.lost {
                                lost_total += ps.len();
                                let k = live.iter().position(|q| q.id == r).unwrap();
                                assert!(
                                    ps.iter().all(|p| !clean[k].contains(p)),
                                    "a clean block was lost"
                                );
                                live[k].unreported.extend(ps);
                            }
                            // Clean blocks revoked became spilled, each counted.
                            let mut went_down = 0;
                            for (q, c) in live.iter().zip(&clean) {
                                let blocks = m.blocks(q.id).unwrap();
                                for &p in c {
                                    assert_ne!(blocks[p], None, "clean block {p} lost");
                                    went_down += u64::from(blocks[p] != Some(Tier::Hbm));
                                }
                            }
                            assert_eq!(m.stats().clean_revocations - kept, went_down);
                        }
                        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                    }
                } else {
                    m.store().pool().give(std::mem::take(&mut held));
                }
            }
            9 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                let q = &mut live[k];
                let mut expected = std::mem::take(&mut q.unreported);
                expected.sort_unstable();
                assert_eq!(m.take_lost(q.id).unwrap(), expected);
                q.to_rebuild.extend(expected);
            }
            10 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                if rng.random_bool(0.3) {
                    let q = live.swap_remove(k);
                    m.release(q.id).unwrap();
                    assert!(matches!(m.tokens(q.id), Err(Error::StaleId { .. })));
                } else if m.tokens(live[k].id).unwrap() > 0 {
                    let q = &live[k];
                    let lost = !q.unreported.is_empty() || !q.to_rebuild.is_empty();
                    match verify(&m, q.id, q.seed) {
                        Ok((_, n)) => {
                            assert!(!lost);
                            checked += n;
                        }
                        Err(e) => assert!(lost && matches!(e, Error::InvalidState(_)), "{e}"),
                    }
                }
            }
            _ => {}
        }
        m.check_invariants()
            .unwrap_or_else(|e| panic!("walk {seed}, step {i} (op {op}): {e}"));
        // The manager's clean blocks are resident full blocks the model restored.
        for q in &mut live {
            let clean: BTreeSet<usize> = m.clean_blocks(q.id).unwrap().into_iter().collect();
            assert!(
                clean.is_subset(&q.clean),
                "walk {seed}, step {i}: clean {clean:?}, model {:?}",
                q.clean
            );
            let blocks = m.blocks(q.id).unwrap();
            q.clean.retain(|&p| blocks.get(p) == Some(&Some(Tier::Hbm)));
        }
    }
    for q in live {
        m.release(q.id).unwrap();
    }
    m.store().pool().give(held);
    m.check_invariants().unwrap();
    assert_eq!(m.store().stats().objects, 0);
    assert_eq!(m.stats().lost_blocks as usize, lost_total);
    assert!(checked > 0, "walk {seed} checked nothing");
    let s = m.stats();
    s.clean_spills + s.clean_revocations
}

#[test]
fn random_walks_against_a_model() {
    let clean_hits: u64 = (1..=2).map(|seed| walk(seed, 250)).sum();
    assert!(clean_hits > 0, "the walks never used a clean copy");
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
