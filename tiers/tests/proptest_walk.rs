//! Random walks of put/write/spill/prefetch/read/revoke/release over every tier, against a
//! reference model of contents; the invariant checker runs after every step.

mod common;

use std::collections::HashMap;

use common::*;
use proptest::prelude::*;
use strata_tiers::{Durability, ObjectId, Tier};

#[derive(Clone, Debug)]
enum Op {
    Put { lossy: bool },
    Write(usize),
    SpillHost(Vec<usize>),
    SpillDisk(Vec<usize>),
    Prefetch(Vec<usize>),
    Read(usize),
    Release(usize),
    Revoke(u32),
}

fn op() -> impl Strategy<Value = Op> {
    let pick = || prop::collection::vec(0usize..64, 1..12);
    prop_oneof![
        4 => any::<bool>().prop_map(|lossy| Op::Put { lossy }),
        1 => (0usize..64).prop_map(Op::Write),
        2 => pick().prop_map(Op::SpillHost),
        2 => pick().prop_map(Op::SpillDisk),
        3 => pick().prop_map(Op::Prefetch),
        3 => (0usize..64).prop_map(Op::Read),
        2 => (0usize..64).prop_map(Op::Release),
        1 => (0u32..3).prop_map(Op::Revoke),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_walks_keep_every_backed_byte(ops in prop::collection::vec(op(), 1..60)) {
        let b = backend(None);
        let dir = tempfile::tempdir().unwrap();
        // 3 HBM pages (96 blocks would be too roomy: use 1 page of 32 plus revocations).
        let s = store(&b, dir.path(), 3, 12, 40);
        let mut live: Vec<(ObjectId, u64, Durability)> = Vec::new();
        let mut lost: HashMap<ObjectId, u64> = HashMap::new();
        let mut seed = 1000u64;
        for op in ops {
            match op {
                Op::Put { lossy } => {
                    seed += 1;
                    let d = if lossy { Durability::Lossy } else { Durability::Backed };
                    match s.put(&block(seed), d, seed) {
                        Ok(id) => live.push((id, seed, d)),
                        Err(e) => prop_assert!(e.is_out_of_memory() || matches!(e, strata_vmm::Error::LimitExceeded { .. }), "{e}"),
                    }
                }
                Op::Write(i) if !live.is_empty() => {
                    let k = i % live.len();
                    seed += 1;
                    match s.write(live[k].0, &block(seed)) {
                        Ok(()) => live[k].1 = seed,
                        Err(e) => prop_assert!(e.is_out_of_memory() || matches!(e, strata_vmm::Error::LimitExceeded { .. }), "{e}"),
                    }
                }
                Op::SpillHost(v) | Op::SpillDisk(v) | Op::Prefetch(v) if live.is_empty() => { let _ = v; }
                Op::SpillHost(v) => {
                    let ids: Vec<_> = v.iter().map(|&i| live[i % live.len()].0).collect();
                    if let Err(e) = s.spill(&ids, Tier::Host) {
                        prop_assert!(e.is_out_of_memory() || matches!(e, strata_vmm::Error::LimitExceeded { .. }), "{e}");
                    }
                }
                Op::SpillDisk(v) => {
                    let ids: Vec<_> = v.iter().map(|&i| live[i % live.len()].0).collect();
                    if let Err(e) = s.spill(&ids, Tier::Disk) {
                        prop_assert!(e.is_out_of_memory() || matches!(e, strata_vmm::Error::LimitExceeded { .. }), "{e}");
                    }
                }
                Op::Prefetch(v) => {
                    let ids: Vec<_> = v.iter().map(|&i| live[i % live.len()].0).collect();
                    match s.prefetch(&ids) {
                        Ok(ev) => {
                            ev.synchronize().unwrap();
                            for id in ids {
                                prop_assert_eq!(s.residency(id).unwrap().fastest(), Some(Tier::Hbm));
                            }
                        }
                        Err(e) => prop_assert!(e.is_out_of_memory() || matches!(e, strata_vmm::Error::LimitExceeded { .. }), "{e}"),
                    }
                }
                Op::Read(i) if !live.is_empty() => {
                    let (id, sd, _) = live[i % live.len()];
                    check(&s, id, sd);
                }
                Op::Release(i) if !live.is_empty() => {
                    let (id, _, _) = live.swap_remove(i % live.len());
                    s.release(id).unwrap();
                    prop_assert!(s.release(id).is_err());
                }
                Op::Revoke(p) => {
                    if let Ok(r) = s.revoke_pages(&[p]) {
                        for id in r.lost {
                            let k = live.iter().position(|x| x.0 == id).expect("lost id is live");
                            let (id, sd, d) = live.swap_remove(k);
                            prop_assert_eq!(d, Durability::Lossy, "a backed object was lost");
                            prop_assert!(lost.insert(id, sd).is_none(), "lost twice");
                        }
                    }
                }
                _ => {}
            }
            s.check_invariants().unwrap();
        }
        for &(id, sd, _) in &live {
            check(&s, id, sd);
        }
        for &id in lost.keys() {
            s.release(id).unwrap();
        }
        for (id, _, _) in live {
            s.release(id).unwrap();
        }
        s.check_invariants().unwrap();
        prop_assert_eq!(s.stats().objects, 0);
    }
}
