//! TierKV's first hop ahead of need (`KvBlockManager::stage`): a full host tier sends the request
//! that runs last to disk, and staging moves disk blocks up only into host room nothing else
//! needs, so it never displaces a request, never writes, and never adds disk traffic to a
//! schedule; a staged copy is evicted only for a request that runs sooner (and counted).

mod common;

use common::kv::*;
use strata_tiers::{KvBlockManager, RequestId, StoreStats, Tier};

fn tiers(m: &KvBlockManager, r: &[RequestId]) -> Vec<Vec<Option<Tier>>> {
    r.iter().map(|&q| m.blocks(q).unwrap()).collect()
}

fn store(m: &KvBlockManager) -> StoreStats {
    m.store().stats()
}

#[test]
fn host_room_follows_the_queue_and_stage_never_displaces_a_request() {
    let dir = tempfile::tempdir().unwrap();
    // The host tier holds one full block (2 layers × K/V × 4 chunks).
    let m = manager(16, 16, 256, dir.path());
    let r: Vec<RequestId> = (0..3).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 60 + i as u64, TPB).unwrap();
    }
    m.queue(&[r[0], r[1], r[2]]).unwrap();
    m.pause(r[0], Tier::Host).unwrap();
    // r[2] and r[1] run after r[0]: they go to disk rather than push r[0] there.
    m.pause(r[2], Tier::Host).unwrap();
    m.pause(r[1], Tier::Host).unwrap();
    let host = Some(Tier::Host);
    let disk = Some(Tier::Disk);
    assert_eq!(tiers(&m, &r), [[host], [disk], [disk]]);
    // r[0] ran; now r[1] runs next and r[0] last. Staging r[1] would have to push r[0] to disk,
    // which would only trade r[1]'s disk read for one of r[0]'s: nothing moves.
    m.queue(&[r[1], r[2], r[0]]).unwrap();
    let before = store(&m);
    assert_eq!(m.stage(&[r[1]]).unwrap(), 0);
    assert_eq!(tiers(&m, &r), [[host], [disk], [disk]]);
    // r[0] comes back; its full block keeps a clean copy in host memory, which staging does
    // not drop either.
    m.make_resident(&[r[0]]).unwrap().synchronize().unwrap();
    assert_eq!(m.stage(&[r[1]]).unwrap(), 0);
    assert_eq!(m.clean_blocks(r[0]).unwrap(), [0]);
    let after = store(&m);
    assert_eq!(after.disk_read_bytes, before.disk_read_bytes);
    assert_eq!(after.disk_write_bytes, before.disk_write_bytes);
    assert_eq!(after.evictions_host, before.evictions_host);
    // r[0] leaves: its room is free, and r[1] comes up into it.
    m.release(r[0]).unwrap();
    assert_eq!(m.stage(&[r[1]]).unwrap(), 16);
    assert_eq!(tiers(&m, &r[1..]), [[host], [disk]]);
    let staged = store(&m);
    assert_eq!(staged.disk_read_bytes - after.disk_read_bytes, 16 * CHUNK);
    assert_eq!(staged.disk_write_bytes, after.disk_write_bytes);
    assert_eq!(staged.staged, 16);
    // r[1] comes back from host memory: one hop, nothing read from disk.
    m.make_resident(&[r[1]]).unwrap().synchronize().unwrap();
    assert_eq!(store(&m).disk_read_bytes, staged.disk_read_bytes);
    assert_eq!(store(&m).staged_evicted, 0);
    for (i, &q) in r.iter().enumerate().skip(1) {
        m.make_resident(&[q]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, q, 60 + i as u64).unwrap(), (Tier::Hbm, 1));
    }
    m.check_invariants().unwrap();
}

#[test]
fn stage_leaves_the_room_that_resident_requests_spills_need() {
    let dir = tempfile::tempdir().unwrap();
    // Host memory for two and a half blocks.
    let m = manager(16, 40, 256, dir.path());
    let r: Vec<RequestId> = (0..3).map(|_| m.admit().unwrap()).collect();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 70 + i as u64, TPB).unwrap();
    }
    m.queue(&[r[1], r[0], r[2]]).unwrap();
    m.pause(r[1], Tier::Disk).unwrap();
    m.pause(r[2], Tier::Host).unwrap();
    // 24 chunks free, but r[0] is resident with no clean copy: its spill needs 16 of them.
    let before = store(&m);
    assert_eq!(m.stage(&[r[1]]).unwrap(), 8);
    assert_eq!(
        store(&m).disk_read_bytes - before.disk_read_bytes,
        8 * CHUNK
    );
    // r[0] spills into the room staging left: nothing goes to disk, nothing staged is dropped.
    m.pause(r[0], Tier::Host).unwrap();
    assert_eq!(m.blocks(r[0]).unwrap(), [Some(Tier::Host)]);
    assert_eq!(store(&m).disk_write_bytes, before.disk_write_bytes);
    assert_eq!(store(&m).staged_evicted, 0);
    // r[1]'s restore reads only what staging did not bring up.
    let read = store(&m).disk_read_bytes;
    m.make_resident(&[r[1]]).unwrap().synchronize().unwrap();
    assert_eq!(store(&m).disk_read_bytes - read, 8 * CHUNK);
    assert_eq!(verify(&m, r[1], 71).unwrap(), (Tier::Hbm, 1));
    for (i, &q) in r.iter().enumerate() {
        m.make_resident(&[q]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, q, 70 + i as u64).unwrap(), (Tier::Hbm, 1));
    }
    m.check_invariants().unwrap();
}

#[test]
fn a_staged_copy_goes_only_for_a_request_that_runs_sooner() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 32, 256, dir.path());
    let r1 = m.admit().unwrap();
    grow(&m, r1, 81, TPB).unwrap();
    m.pause(r1, Tier::Disk).unwrap();
    assert_eq!(m.stage(&[r1]).unwrap(), 16);
    let [r0, r2, r3] = [0, 2, 3].map(|_| m.admit().unwrap());
    for (q, seed) in [(r0, 80), (r2, 82), (r3, 83)] {
        grow(&m, q, seed, TPB).unwrap();
    }
    m.queue(&[r3, r0, r1, r2]).unwrap();
    m.pause(r2, Tier::Host).unwrap();
    let written = store(&m).disk_write_bytes;
    // r[0] runs before r[1], r[2] after it: r[2] is written to disk to make room, not r[1].
    m.pause(r0, Tier::Host).unwrap();
    assert_eq!(store(&m).disk_write_bytes - written, 16 * CHUNK);
    assert_eq!(m.blocks(r2).unwrap(), [Some(Tier::Disk)]);
    assert_eq!(m.blocks(r1).unwrap(), [Some(Tier::Host)]);
    assert_eq!(store(&m).staged_evicted, 0);
    // r[3] runs before both: r[1] runs later than r[0], so its staged copy goes (its disk copy
    // stays: nothing is written), and the counter says so.
    m.pause(r3, Tier::Host).unwrap();
    assert_eq!(store(&m).disk_write_bytes - written, 16 * CHUNK);
    assert_eq!(m.blocks(r1).unwrap(), [Some(Tier::Disk)]);
    assert_eq!(store(&m).staged_evicted, 16);
    for (q, seed) in [(r0, 80), (r1, 81), (r2, 82), (r3, 83)] {
        m.make_resident(&[q]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, q, seed).unwrap(), (Tier::Hbm, 1));
        m.pause(q, Tier::Host).unwrap();
    }
    m.check_invariants().unwrap();
}

/// Disk bytes (read, written) and objects staged after `rounds` rounds of a cyclic schedule
/// over `n` requests of one full and one half block each, two resident at a time (the one
/// running and the next), as a layer swapper runs them: before request i runs, request i − 1
/// is spilled, request i + 1 made resident, and (with `lookahead`) request i + 2 staged.
fn cyclic(n: usize, host_chunks: u64, rounds: usize, lookahead: bool) -> StoreStats {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, host_chunks, 1024, dir.path());
    let r: Vec<RequestId> = (0..n).map(|_| m.admit().unwrap()).collect();
    let order = |i: usize| -> Vec<RequestId> { (0..n).map(|d| r[(i + d) % n]).collect() };
    m.queue(&order(0)).unwrap();
    for (i, &q) in r.iter().enumerate() {
        grow(&m, q, 90 + i as u64, TPB + TPB / 2).unwrap();
        m.pause(q, Tier::Host).unwrap();
    }
    m.make_resident(&[r[0]]).unwrap().synchronize().unwrap();
    let start = store(&m);
    for step in 0..rounds * n {
        let i = step % n;
        m.queue(&order(i)).unwrap();
        m.pause(r[(i + n - 1) % n], Tier::Host).unwrap();
        m.make_resident(&[r[(i + 1) % n]])
            .unwrap()
            .synchronize()
            .unwrap();
        if lookahead {
            m.stage(&[r[(i + 2) % n]]).unwrap();
        }
    }
    for (i, &q) in r.iter().enumerate() {
        m.make_resident(&[q]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, q, 90 + i as u64).unwrap(), (Tier::Hbm, 2));
        m.pause(q, Tier::Host).unwrap();
    }
    m.check_invariants().unwrap();
    let end = store(&m);
    StoreStats {
        disk_read_bytes: end.disk_read_bytes - start.disk_read_bytes,
        disk_write_bytes: end.disk_write_bytes - start.disk_write_bytes,
        ..end
    }
}

/// The old staging, which took room from requests that run later (TierKV's eviction order),
/// turned this schedule into a rotation through disk: with 48 host chunks it read 312 chunks
/// and wrote 96 where no lookahead reads 248 and writes 48.
#[test]
fn a_cyclic_schedule_reads_and_writes_no_more_with_the_lookahead() {
    for host_chunks in [48, 72, 96] {
        let off = cyclic(5, host_chunks, 3, false);
        let on = cyclic(5, host_chunks, 3, true);
        assert!(
            off.disk_read_bytes > 0,
            "host {host_chunks}: nothing on disk"
        );
        assert!(
            on.disk_read_bytes <= off.disk_read_bytes,
            "host {host_chunks}: {on:?} {off:?}"
        );
        assert!(
            on.disk_write_bytes <= off.disk_write_bytes,
            "host {host_chunks}"
        );
        assert_eq!(on.staged_evicted, 0, "host {host_chunks}");
    }
}
