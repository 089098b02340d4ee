//! KvBlockManager: lifecycle through the tiers, and several engine threads with a revoker.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_tiers::policy::Links;
use strata_tiers::{
    DiskConfig, KvBlockManager, KvBlocksConfig, PolicyKind, RequestId, StoreConfig, Tier, TierSpec,
    TierStore,
};
use strata_vmm::Error;

const BPT: u64 = 2048;
const TPB: u32 = 16;
const KB: u64 = BPT * TPB as u64;

fn manager(
    hbm_pages: u64,
    host_blocks: u64,
    disk_blocks: u64,
    dir: &std::path::Path,
) -> KvBlockManager {
    let b = backend(None);
    let mut c = StoreConfig::new(KB, hbm_pages * (2 << 20), host_blocks * KB);
    c.disk = Some(DiskConfig {
        dir: dir.to_path_buf(),
        spec: TierSpec {
            capacity: disk_blocks * KB,
            bandwidth: 7e9,
            latency: Duration::from_micros(80),
        },
        io_threads: 2,
        direct: true,
    });
    c.hbm_policy = PolicyKind::Lookahead;
    let store = Arc::new(TierStore::new(pool(&b), c).unwrap());
    KvBlockManager::new(
        store,
        KvBlocksConfig {
            tokens_per_block: TPB,
            bytes_per_token: BPT,
            t_iter: Duration::from_millis(20),
            delta_sched: Duration::ZERO,
            links: Links {
                host_to_hbm: (Duration::from_micros(5), 50e9),
                disk_to_host: (Duration::from_micros(80), 7e9),
            },
        },
    )
    .unwrap()
}

fn tokens(seed: u64, from: u32, n: u32) -> Vec<u8> {
    let mut v = vec![0u8; (n as u64 * BPT) as usize];
    strata_kernels::pattern::fill(&mut v, seed, from as u64 * BPT);
    v
}

/// Reads every block of `r` and checks it against the pattern of `seed`.
fn verify(m: &KvBlockManager, r: RequestId, seed: u64) -> usize {
    let total = m.tokens(r).unwrap();
    let blocks = m.blocks(r).unwrap();
    for (i, &b) in blocks.iter().enumerate() {
        let first = i as u32 * TPB;
        let n = (total - first).min(TPB);
        let mut buf = vec![0u8; (n as u64 * BPT) as usize];
        m.store().read(b, &mut buf).unwrap();
        assert_eq!(
            strata_kernels::pattern::first_mismatch(&buf, seed, first as u64 * BPT),
            None,
            "request {r:?} block {i}"
        );
    }
    blocks.len()
}

#[test]
fn blocks_spill_when_paused_and_come_back_ahead_of_use() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(1, 32, 256, dir.path());
    let a = m.admit();
    let b = m.admit();
    m.append(a, &tokens(1, 0, 100)).unwrap();
    m.append(a, &tokens(1, 100, 7)).unwrap();
    m.append(b, &tokens(2, 0, 40)).unwrap();
    assert_eq!(m.tokens(a).unwrap(), 107);
    assert_eq!(m.blocks(a).unwrap().len(), 7);
    m.pause(a, Tier::Disk).unwrap();
    for blk in m.blocks(a).unwrap() {
        assert_eq!(
            m.store().residency(blk).unwrap().fastest(),
            Some(Tier::Disk)
        );
    }
    verify(&m, a, 1);
    // The hint prefetches a's blocks (they fit a 20 ms window) before a runs.
    let ev = m.hint(&[vec![a]]).unwrap().expect("a prefetch");
    ev.synchronize().unwrap();
    for blk in m.blocks(a).unwrap() {
        assert_eq!(m.store().residency(blk).unwrap().fastest(), Some(Tier::Hbm));
    }
    m.make_resident(&[a, b]).unwrap().synchronize().unwrap();
    verify(&m, a, 1);
    verify(&m, b, 2);
    m.advance(10);
    m.append(b, &tokens(2, 40, 1)).unwrap();
    assert_eq!(m.spill_idle(5, Tier::Host).unwrap(), 7);
    verify(&m, a, 1);
    m.release(a).unwrap();
    assert!(matches!(m.release(a), Err(Error::StaleId { .. })));
    assert!(matches!(
        m.append(a, &tokens(1, 0, 1)),
        Err(Error::StaleId { .. })
    ));
    assert!(matches!(
        m.append(b, &[0u8; 3]),
        Err(Error::InvalidArgument(_))
    ));
    m.release(b).unwrap();
    m.store().check_invariants().unwrap();
}

#[test]
fn engine_threads_and_a_revoker() {
    let dir = tempfile::tempdir().unwrap();
    // 4 HBM pages (256 blocks); the revoker takes 3 of them back while the engines run.
    let m = Arc::new(manager(4, 96, 1024, dir.path()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for t in 0..3u64 {
        let m = Arc::clone(&m);
        workers.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(7 + t);
            let mut live: Vec<(RequestId, u64)> = Vec::new();
            let (mut verified, mut recomputed) = (0usize, 0usize);
            for i in 0..60u64 {
                if live.len() < 4 {
                    let r = m.admit();
                    let seed = t * 1000 + i;
                    let n = rng.random_range(1..64);
                    match m.append(r, &tokens(seed, 0, n)) {
                        Ok(()) => live.push((r, seed)),
                        Err(e) => {
                            assert!(
                                e.is_out_of_memory() || matches!(e, Error::InvalidState(_)),
                                "{e}"
                            );
                            m.release(r).unwrap();
                        }
                    }
                    continue;
                }
                let k = rng.random_range(0..live.len());
                let (r, seed) = live[k];
                let res = m.make_resident(&[r]).and_then(|ev| ev.synchronize());
                match res {
                    Ok(()) => {
                        let lost = m.take_lost(r);
                        if lost.is_empty() {
                            verified += verify(&m, r, seed);
                        } else {
                            recomputed += 1;
                            m.release(r).unwrap();
                            live.swap_remove(k);
                            continue;
                        }
                        let have = m.tokens(r).unwrap();
                        if have < 400 {
                            if let Err(e) = m.append(r, &tokens(seed, have, 8)) {
                                assert!(
                                    e.is_out_of_memory() || matches!(e, Error::InvalidState(_)),
                                    "{e}"
                                );
                            }
                        }
                    }
                    Err(Error::InvalidState(_)) => {
                        // Lost blocks: the engine would recompute; here it drops the request.
                        recomputed += 1;
                        m.release(r).unwrap();
                        live.swap_remove(k);
                    }
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
                if rng.random_bool(0.2) {
                    let (r, _) = live.swap_remove(rng.random_range(0..live.len()));
                    m.release(r).unwrap();
                } else if rng.random_bool(0.2) {
                    let (r, _) = live[rng.random_range(0..live.len())];
                    let to = if rng.random_bool(0.5) {
                        Tier::Host
                    } else {
                        Tier::Disk
                    };
                    if let Err(e) = m.pause(r, to) {
                        assert!(
                            e.is_out_of_memory()
                                || matches!(
                                    e,
                                    Error::LimitExceeded { .. } | Error::InvalidState(_)
                                ),
                            "{e}"
                        );
                    }
                }
            }
            for (r, _) in live {
                m.release(r).unwrap();
            }
            (verified, recomputed)
        }));
    }
    let revoker = {
        let m = Arc::clone(&m);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut revoked = 0;
            for p in 1..4u32 {
                std::thread::sleep(Duration::from_millis(30));
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let r = m.store().revoke_pages(&[p]).unwrap();
                m.store().check_invariants().unwrap();
                m.store().pool().give(r.pages);
                revoked += 1;
            }
            revoked
        })
    };
    let mut verified = 0;
    for w in workers {
        let (v, _) = w.join().unwrap();
        verified += v;
    }
    stop.store(true, Ordering::Relaxed);
    let revoked = revoker.join().unwrap();
    assert!(verified > 0);
    m.store().check_invariants().unwrap();
    let st = m.store().stats();
    assert_eq!(st.objects, 0);
    assert_eq!(st.pages_revoked, revoked as u64);
    assert_eq!(st.hbm_slots, (4 - revoked as u64) * 64);
}
