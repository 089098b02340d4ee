//! Unit tests of `tierkv.rs`.

use super::*;
use proptest::prelude::*;

fn small(rho: f64, seed: u64) -> TierKvConfig {
    let mut c = TierKvConfig::paper(rho, seed);
    c.workload = Workload::Chatbot;
    c.batch = 4;
    c.hbm_kv_bytes = Some(64 * c.block_bytes());
    c
}

#[test]
fn same_seed_same_result() {
    let a = run(&small(3.0, 9), &Policy::ALL);
    let b = run(&small(3.0, 9), &Policy::ALL);
    assert_eq!(a, b);
    let c = run(&small(3.0, 10), &Policy::ALL);
    assert_ne!(a, c);
}

#[test]
fn nothing_moves_without_oversubscription() {
    for r in run(&small(1.0, 1), &Policy::ALL) {
        assert_eq!(r.demand_blocks + r.prefetched_blocks, 0, "{r:?}");
        assert!((r.mean_tpot_ms - 4.0).abs() < 1e-9, "{r:?}");
    }
}

#[test]
fn the_oracle_is_never_beaten() {
    for seed in 1..=2 {
        for rho in [2.0, 4.0] {
            let rs = run(&small(rho, seed), &Policy::ALL);
            let oracle = rs.iter().find(|r| r.policy == Policy::Oracle).unwrap();
            for r in &rs {
                assert!(
                    oracle.mean_tpot_ms <= r.mean_tpot_ms + 1e-9,
                    "ρ {rho} seed {seed}: {oracle:?} vs {r:?}"
                );
            }
            let lru = rs.iter().find(|r| r.policy == Policy::Lru).unwrap();
            if rho >= 4.0 {
                assert!(lru.demand_blocks > 0, "ρ {rho}: no spill at all: {lru:?}");
            }
        }
    }
}

#[test]
fn prefetch_stays_within_two_percent_of_the_oracle() {
    for seed in 1..=3 {
        for rho in [1.5, 3.0, 5.0] {
            let rs = run(&small(rho, seed), &[Policy::Prefetch, Policy::Oracle]);
            let (p, o) = (&rs[0], &rs[1]);
            assert!(
                p.mean_tpot_ms <= 1.02 * o.mean_tpot_ms,
                "ρ {rho} seed {seed}: {p:?} vs {o:?}"
            );
        }
    }
}

#[test]
fn queue_warming_moves_the_transfers_off_the_critical_path() {
    // Without warming, K = 1 cannot hide a joining request's blocks; with it, no more
    // stall than before and strictly less in total over the levels.
    let (mut with, mut without) = (0.0, 0.0);
    for rho in [2.0, 4.0] {
        // Joins of long prompts, a few iterations' worth of link time each.
        let mut cfg = small(rho, 1);
        cfg.workload = Workload::Code;
        cfg.batch = 8;
        cfg.hbm_kv_bytes = Some(1024 * cfg.block_bytes());
        let a = run(&cfg, &[Policy::Prefetch]).remove(0);
        cfg.queue_warming = false;
        let b = run(&cfg, &[Policy::Prefetch]).remove(0);
        assert!(a.stall_s <= b.stall_s + 1e-12, "ρ {rho}: {a:?} vs {b:?}");
        with += a.stall_s;
        without += b.stall_s;
    }
    assert!(with < without, "{with} vs {without}");
}

proptest! {
    /// Prefetch's eviction (policy::Lookahead, fed the scheduler's next K steps) never
    /// picks a block whose owner runs in the window while a block outside it is evictable.
    #[test]
    fn lookahead_spares_the_window(
        touches in proptest::collection::vec((0u64..64, 0u64..12), 1..200),
        window in proptest::collection::vec(proptest::collection::vec(0u64..12, 0..4), 1..4),
        blocked in proptest::collection::vec(0u64..64, 0..8),
    ) {
        let mut p = Lookahead::default();
        let mut owner_of = HashMap::new();
        for (i, &(k, o)) in touches.iter().enumerate() {
            let o = *owner_of.entry(k).or_insert(o);
            p.touch(k, o, i as u64);
        }
        p.schedule(&window);
        let in_window = |o: u64| window.iter().any(|w| w.contains(&o));
        let evictable = |k: u64| !blocked.contains(&k);
        let v = p.victim(&mut |k| evictable(k));
        let outside = owner_of.iter().any(|(&k, &o)| evictable(k) && !in_window(o));
        if outside {
            let v = v.expect("an evictable key exists");
            prop_assert!(!in_window(owner_of[&v]), "evicted {v} of a scheduled owner");
        }
    }
}
