//! `KvSpace` random walks against a reference model (admit, grow, shrink, free, reclaim, stale
//! ids, evict, restore; with and without a zero page, a pool limit and the map-ahead mapper),
//! the invariant checker and the slots' bytes checked after every step, on the fake and the host
//! backend. Set-up shared with `kv_space.rs` in `kv_common/`.

mod kv_common;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use kv_common::{fake_rig, host_rig, kinds, ok, read_bytes, seed_of, Rig, HOST_SMALL_PAGE};
use proptest::prelude::*;
use strata_allocator::{KvConfig, KvSpace, SlotId};
use strata_kernels::pattern::{fill, first_mismatch};
use strata_vmm::{Backend, Error};

#[derive(Clone, Debug)]
enum Op {
    Admit,
    Grow(usize, u32),
    Shrink(usize, u32),
    Free(usize),
    Reclaim,
    UseStale(usize),
    Evict(usize, usize, usize),
    Restore(usize, usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Admit),
        5 => (any::<usize>(), 0u32..12).prop_map(|(i, d)| Op::Grow(i, d)),
        2 => (any::<usize>(), 0u32..100).prop_map(|(i, p)| Op::Shrink(i, p)),
        2 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::Reclaim),
        1 => any::<usize>().prop_map(Op::UseStale),
        3 => (any::<usize>(), any::<usize>(), 1usize..4).prop_map(|(i, p, n)| Op::Evict(i, p, n)),
        3 => (any::<usize>(), any::<usize>(), 1usize..4).prop_map(|(i, p, n)| Op::Restore(i, p, n)),
    ]
}

/// Byte spans `from..to` of a slot (relative to its start) that avoid the pages in `holes`.
fn resident_spans(page: u64, from: u64, to: u64, holes: &BTreeSet<usize>) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = Vec::new();
    let mut at = from;
    while at < to {
        let p = (at / page) as usize;
        let end = ((p as u64 + 1) * page).min(to);
        if !holes.contains(&p) {
            match spans.last_mut() {
                Some(last) if last.1 == at => last.1 = end,
                _ => spans.push((at, end)),
            }
        }
        at = end;
    }
    spans
}

/// [`write_tokens`] that skips the slot's holes.
fn write_resident(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    slot: SlotId,
    from: u32,
    to: u32,
    holes: &BTreeSet<usize>,
) {
    let bpt = space.config().bytes_per_token;
    let spans = resident_spans(
        space.page_size(),
        u64::from(from) * bpt,
        u64::from(to) * bpt,
        holes,
    );
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            for &(a, b) in &spans {
                let mut buf = vec![0u8; (b - a) as usize];
                fill(&mut buf, seed_of(slot, layer, kind), a);
                backend.write(base + a, &buf).expect("write tokens");
            }
        }
    }
}

/// [`check_tokens`] over the resident pages; with a zero page, holes must read zeros.
fn check_resident(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    slot: SlotId,
    tokens: u32,
    holes: &BTreeSet<usize>,
) {
    let bpt = space.config().bytes_per_token;
    let page = space.page_size();
    let spans = resident_spans(page, 0, u64::from(tokens) * bpt, holes);
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            for &(a, b) in &spans {
                let buf = read_bytes(backend, base + a, b - a);
                if let Some(at) = first_mismatch(&buf, seed_of(slot, layer, kind), a) {
                    panic!(
                        "slot {slot:?} layer {layer} {kind:?}: mismatch at byte {}",
                        a + at as u64
                    );
                }
            }
            if space.config().zero_page {
                for &p in holes {
                    let bytes = read_bytes(backend, base + p as u64 * page, page);
                    assert!(bytes.iter().all(|&x| x == 0), "hole {p} reads zeros");
                }
            }
        }
    }
}

/// `ahead`: the map-ahead budget in pages (with or without a zero page).
fn walk(rig: &Rig, cfg: KvConfig, ops: &[Op], ahead: Option<usize>) {
    let mut space = KvSpace::new(Arc::clone(&rig.pool), cfg).expect("space");
    if let Some(budget) = ahead {
        space.start_map_ahead(budget).expect("map ahead");
    }
    // Reference model: live slots and their token counts; ids freed so far.
    let mut live: Vec<(SlotId, u32)> = Vec::new();
    let mut dead: Vec<SlotId> = Vec::new();
    let mut holes: HashMap<SlotId, BTreeSet<usize>> = HashMap::new();
    for op in ops {
        match *op {
            Op::Admit => match space.admit() {
                Ok(id) => {
                    assert!(live.iter().all(|(s, _)| s.index() != id.index()));
                    assert!(!dead.contains(&id), "an id was handed out twice");
                    live.push((id, 0));
                    holes.insert(id, BTreeSet::new());
                }
                Err(e) => {
                    assert!(matches!(e, Error::InvalidState(_)), "{e}");
                    assert_eq!(live.len(), cfg.max_slots as usize);
                }
            },
            Op::Grow(i, delta) if !live.is_empty() => {
                let k = i % live.len();
                let (id, len) = live[k];
                let to = len + delta;
                match space.grow(id, to) {
                    Ok(()) => {
                        assert!(to <= cfg.max_tokens);
                        write_resident(&space, &rig.backend, id, len, to, &holes[&id]);
                        live[k].1 = to;
                    }
                    Err(e) if to > cfg.max_tokens => {
                        assert!(matches!(e, Error::InvalidArgument(_)), "{e}")
                    }
                    Err(e) => {
                        assert!(e.is_out_of_memory(), "{e}");
                        assert_eq!(space.tokens(id).unwrap(), len);
                    }
                }
                check_resident(&space, &rig.backend, id, live[k].1, &holes[&id]);
            }
            Op::Shrink(i, pct) if !live.is_empty() => {
                let k = i % live.len();
                let (id, len) = live[k];
                let to = len * pct / 100;
                space.shrink(id, to).expect("shrink");
                live[k].1 = to;
                let need = space.pages_for(to);
                holes.get_mut(&id).unwrap().retain(|&p| p < need);
                check_resident(&space, &rig.backend, id, to, &holes[&id]);
            }
            Op::Free(i) if !live.is_empty() => {
                let (id, _) = live.swap_remove(i % live.len());
                space.free(id).expect("free");
                holes.remove(&id);
                dead.push(id);
            }
            Op::Reclaim => {
                let deferred_pages = space.stats().pages_mapped
                    - live
                        .iter()
                        .map(|&(id, _)| (space.mapped_pages(id).unwrap() - holes[&id].len()) as u64)
                        .sum::<u64>()
                        * space.tensor_count() as u64;
                assert_eq!(space.reclaim_deferred() as u64, deferred_pages);
                assert_eq!(space.stats().slots_deferred, 0);
            }
            Op::UseStale(i) if !dead.is_empty() => {
                let id = dead[i % dead.len()];
                let e = space.grow(id, 1).expect_err("stale");
                assert!(matches!(e, Error::StaleId { .. }), "{e}");
            }
            Op::Evict(i, p, n) if !live.is_empty() => {
                let (id, t) = live[i % live.len()];
                let mapped = space.mapped_pages(id).unwrap();
                let start = p % (mapped + 1);
                let run = start..start + n;
                let h = holes.get_mut(&id).unwrap();
                let valid = run.end <= mapped && run.clone().all(|q| !h.contains(&q));
                match space.evict_pages(id, run.clone()) {
                    Ok(()) => {
                        assert!(valid, "evict of {run:?} (extent {mapped}, holes {h:?})");
                        h.extend(run);
                    }
                    Err(e) => {
                        assert!(!valid, "{e}");
                        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
                    }
                }
                check_resident(&space, &rig.backend, id, t, &holes[&id]);
            }
            Op::Restore(i, p, n) if !live.is_empty() => {
                let (id, t) = live[i % live.len()];
                let mapped = space.mapped_pages(id).unwrap();
                let h = holes.get_mut(&id).unwrap();
                // Aim at a hole when there is one.
                let start = if h.is_empty() {
                    p % (mapped + 1)
                } else {
                    *h.iter().nth(p % h.len()).unwrap()
                };
                let run = start..start + n;
                let valid = run.end <= mapped && run.clone().all(|q| h.contains(&q));
                match space.restore_pages(id, run.clone()) {
                    Ok(()) => {
                        assert!(valid, "restore of {run:?} (extent {mapped}, holes {h:?})");
                        for q in run.clone() {
                            h.remove(&q);
                        }
                        // The engine copies the saved bytes back; here: the pattern.
                        let bpt = space.config().bytes_per_token;
                        let page = space.page_size();
                        let first = (run.start as u64 * page / bpt) as u32;
                        let last = (run.end as u64 * page).div_ceil(bpt).min(u64::from(t)) as u32;
                        let others: BTreeSet<usize> =
                            (0..mapped).filter(|q| !run.contains(q)).collect();
                        write_resident(&space, &rig.backend, id, first.min(last), last, &others);
                    }
                    Err(e) if valid => {
                        assert!(e.is_out_of_memory(), "{e}");
                        assert!(run.clone().all(|q| !space.is_resident(id, q).unwrap()));
                    }
                    Err(e) => assert!(matches!(e, Error::InvalidArgument(_)), "{e}"),
                }
                check_resident(&space, &rig.backend, id, t, &holes[&id]);
            }
            _ => {}
        }
        ok(&space);
        for &(id, _) in &live {
            let want: Vec<usize> = holes[&id].iter().copied().collect();
            assert_eq!(space.evicted_pages(id).unwrap(), want);
        }
        assert_eq!(
            space.stats().pages_evicted,
            holes.values().map(|h| h.len() as u64).sum::<u64>()
        );
        let s = space.stats();
        assert_eq!(s.slots_active as usize, live.len());
        assert_eq!(
            s.tokens,
            live.iter().map(|&(_, t)| u64::from(t)).sum::<u64>()
        );
        for &(id, t) in &live {
            assert_eq!(space.tokens(id).unwrap(), t);
        }
    }
    for &(id, t) in &live {
        check_resident(&space, &rig.backend, id, t, &holes[&id]);
    }
    drop(space);
    assert_eq!(rig.pool.stats().in_use, 0);
}

fn walk_config(page: u64, bpt_eighths: u64, zero_page: bool) -> KvConfig {
    KvConfig {
        layers: 2,
        max_slots: 4,
        max_tokens: 24,
        bytes_per_token: bpt_eighths * page / 8,
        zero_page,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_walk_fake(
        ops in prop::collection::vec(op(), 1..80),
        bpt_eighths in 1u64..12,
        zero_page in any::<bool>(),
        limit in prop::option::of(16u64..120),
        ahead in prop::option::of(4usize..40),
    ) {
        let (rig, _) = fake_rig(limit);
        walk(&rig, walk_config(rig.page, bpt_eighths, zero_page), &ops, ahead);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn random_walk_host(
        ops in prop::collection::vec(op(), 1..60),
        bpt_eighths in 1u64..12,
        zero_page in any::<bool>(),
        limit in prop::option::of(16u64..100),
        ahead in prop::option::of(4usize..40),
    ) {
        if let Some(rig) = host_rig(limit, HOST_SMALL_PAGE) {
            walk(&rig, walk_config(rig.page, bpt_eighths, zero_page), &ops, ahead);
        }
    }
}
