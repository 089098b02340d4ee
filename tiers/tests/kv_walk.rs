//! KvBlockManager random walks against a model: every operation (append, spill, restore,
//! hints, revocation, release, ...) with its expected outcome, the invariant checker after every
//! step, and every request's bytes checked whenever none of its blocks is lost.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use common::kv::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_tiers::{KvBlockManager, RequestId, Tier};
use strata_vmm::Error;

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
/// `ahead`: run with the space's background mapper and this budget in pages (in a space with a
/// zero page for odd seeds, as `strata_kv_create` makes them; without one for even seeds).
fn walk(seed: u64, steps: u32, ahead: Option<usize>) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let zero_page = ahead.is_none() || seed % 2 == 1;
    let m = manager_ahead(24, 32, 400, dir.path(), ahead, zero_page);
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
    if ahead.is_some() {
        // Every page the mapper held went back with the releases (or is with deferred slots).
        assert_eq!(m.space_stats().slots_active, 0);
        assert_eq!(m.space_stats().pages_ahead, 0);
    }
    FROM_AHEAD.fetch_add(m.space_stats().pages_from_ahead, Ordering::Relaxed);
    let s = m.stats();
    s.clean_spills + s.clean_revocations
}

/// Pages that appends published from the mapper's rows, over the walks of this process.
static FROM_AHEAD: AtomicU64 = AtomicU64::new(0);

#[test]
fn random_walks_against_a_model() {
    let clean_hits: u64 = (1..=2).map(|seed| walk(seed, 250, None)).sum();
    assert!(clean_hits > 0, "the walks never used a clean copy");
}

/// The same walks with the background mapper keeping pages ahead of growing requests: spills,
/// revocations, releases and out of memory (24 pages for 16 requests) race with it, with the
/// zero page (seeds 1 and 3) and without.
#[test]
fn random_walks_with_the_mapper_on() {
    let clean_hits: u64 = (1..=3).map(|seed| walk(seed, 250, Some(8))).sum();
    assert!(clean_hits > 0, "the walks never used a clean copy");
    assert!(
        FROM_AHEAD.load(Ordering::Relaxed) > 0,
        "no append used a page mapped ahead"
    );
}
