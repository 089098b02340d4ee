//! `KvSpace` tests: page accounting, deferred reclamation, zero page, stale ids, out-of-memory,
//! contents across grows, drop and fault rollback. Eviction and restore of pages are in
//! `kv_space_evict.rs`, the random walks against a reference model in `kv_space_walk.rs`.
//!
//! Every test runs on a small fake backend (`kv_common/fake.rs`: strict VMM preconditions, byte
//! storage per physical handle, map fault injection), and, where the host backend is available,
//! on it too.

mod kv_common;

use std::sync::Arc;

use kv_common::{
    all_rigs, check_tokens, config, fake_rig, kinds, ok, read_bytes, rigs, write_tokens,
};
use strata_allocator::{Kind, KvConfig, KvSpace, SlotId};
use strata_vmm::{DevicePtr, Error};

#[test]
fn config_is_validated() {
    let (rig, _) = fake_rig(None);
    for bad in [
        KvConfig {
            layers: 0,
            ..config(rig.page, false)
        },
        KvConfig {
            max_slots: 0,
            ..config(rig.page, false)
        },
        KvConfig {
            max_tokens: 0,
            ..config(rig.page, false)
        },
        KvConfig {
            bytes_per_token: 0,
            ..config(rig.page, false)
        },
    ] {
        let err = KvSpace::new(Arc::clone(&rig.pool), bad).expect_err("invalid config");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    let huge = KvConfig {
        max_tokens: u32::MAX,
        bytes_per_token: u64::MAX / 2,
        ..config(rig.page, false)
    };
    let err = KvSpace::new(Arc::clone(&rig.pool), huge).expect_err("overflow");
    assert!(matches!(err, Error::Overflow(_)), "{err}");
    assert_eq!(rig.backend.live_counts().reservations, 0);
}

#[test]
fn layout_addresses() {
    for rig in all_rigs(None) {
        let space = KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let stride = space.slot_stride();
        assert_eq!(stride, 8 * rig.page, "{}", rig.name);
        assert_eq!(space.pages_per_slot(), 8);
        assert_eq!(space.tensor_count(), 4);
        let mut bases: Vec<DevicePtr> = (0..2)
            .flat_map(|l| kinds().map(|k| space.tensor_ptr(l, k)))
            .collect();
        bases.sort_unstable();
        bases.dedup();
        assert_eq!(bases.len(), 4);
        for pair in bases.windows(2) {
            assert!(pair[1] - pair[0] >= 4 * stride, "tensors overlap");
        }
        assert_eq!(space.pages_for(0), 0);
        assert_eq!(space.pages_for(1), 1);
        assert_eq!(space.pages_for(3), 2); // 9/8 of a page
        assert_eq!(space.pages_for(20), 8);
        ok(&space);
    }
}

#[test]
fn grow_shrink_free_account_pages() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().expect("admit");
        let b = space.admit().expect("admit");
        assert_ne!(a.index(), b.index());
        assert_eq!(
            space.slot_ptr(b, 1, Kind::V).unwrap(),
            space.tensor_ptr(1, Kind::V) + u64::from(b.index()) * space.slot_stride()
        );
        ok(&space);

        space.grow(a, 3).expect("grow a");
        let s = space.stats();
        assert_eq!(s.pages_mapped, 2 * 4, "{}", rig.name);
        assert_eq!(s.map_calls, 8);
        assert_eq!(s.set_access_calls, 4, "one set_access per tensor");
        assert_eq!(s.tokens, 3);
        assert_eq!(rig.pool.stats().in_use, 8);
        ok(&space);

        // Within the same page: no driver call.
        space.grow(a, 5).expect("grow within page");
        assert_eq!(space.stats().map_calls, 8);
        assert_eq!(space.stats().set_access_calls, 4);
        space.grow(a, 5).expect("same length is a no-op");

        space.grow(b, 20).expect("grow b to max");
        assert_eq!(space.stats().pages_mapped, 8 + 32);
        assert_eq!(space.mapped_pages(b).unwrap(), 8);
        ok(&space);

        space.shrink(b, 6).expect("shrink b");
        assert_eq!(space.mapped_pages(b).unwrap(), 3);
        assert_eq!(space.stats().pages_mapped, 8 + 12);
        assert_eq!(space.stats().pages_unmapped_total, 20);
        assert_eq!(rig.pool.stats().in_use, 20);
        assert_eq!(
            rig.pool.stats().free,
            20,
            "shrunk pages go back to the free list"
        );
        ok(&space);

        space.shrink(b, 0).expect("shrink to nothing");
        assert_eq!(space.mapped_pages(b).unwrap(), 0);
        ok(&space);

        space.free(b).expect("free empty b");
        assert_eq!(
            space.stats().slots_deferred,
            0,
            "an empty slot is free at once"
        );
        space.free(a).expect("free a");
        let s = space.stats();
        assert_eq!((s.slots_active, s.slots_deferred, s.tokens), (0, 1, 0));
        assert_eq!(s.pages_mapped, 8, "a freed slot keeps its pages (deferred)");
        ok(&space);

        assert_eq!(space.reclaim_deferred(), 8);
        assert_eq!(space.stats().pages_mapped, 0);
        assert_eq!(space.stats().slots_deferred, 0);
        assert_eq!(rig.pool.stats().in_use, 0);
        ok(&space);
    }
}

#[test]
fn argument_errors() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().unwrap();
        let err = space.grow(a, 21).expect_err("beyond max_tokens");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        space.grow(a, 10).unwrap();
        let err = space.grow(a, 9).expect_err("grow backwards");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = space.shrink(a, 11).expect_err("shrink forwards");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = space
            .slot_ptr(a, 2, Kind::K)
            .expect_err("layer out of range");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert_eq!(space.tokens(a).unwrap(), 10);
        for _ in 0..3 {
            space.admit().unwrap();
        }
        let err = space.admit().expect_err("all slots taken");
        assert!(matches!(err, Error::InvalidState(_)), "{err}");
        ok(&space);
    }
}

#[test]
fn stale_slot_ids_are_errors() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let old = space.admit().unwrap();
        space.grow(old, 4).unwrap();
        space.free(old).unwrap();
        let new = space.admit().unwrap();
        assert_eq!(new.index(), old.index(), "the deferred slot is reused");
        assert_ne!(new.generation(), old.generation());
        let stale = |e: Error| assert!(matches!(e, Error::StaleId { .. }), "{e}");
        stale(space.grow(old, 5).unwrap_err());
        stale(space.shrink(old, 0).unwrap_err());
        stale(space.free(old).unwrap_err());
        stale(space.slot_ptr(old, 0, Kind::K).unwrap_err());
        stale(space.tokens(old).unwrap_err());
        // The stale id did not touch the new request.
        assert_eq!(space.tokens(new).unwrap(), 0);
        space.free(new).unwrap();
        stale(space.free(new).unwrap_err());
        ok(&space);
    }
}

#[test]
fn deferred_slot_is_reused_without_map_calls() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().unwrap();
        space.grow(a, 12).unwrap(); // 36/8 pages → 5
        let before = space.stats();
        space.free(a).unwrap();
        let b = space.admit().unwrap();
        assert_eq!(b.index(), a.index());
        assert_eq!(space.tokens(b).unwrap(), 0);
        assert_eq!(space.mapped_pages(b).unwrap(), 5, "capacity stays mapped");
        ok(&space);
        space.grow(b, 13).unwrap();
        let after = space.stats();
        assert_eq!(after.map_calls, before.map_calls, "reuse needs no map call");
        assert_eq!(after.set_access_calls, before.set_access_calls);
        assert_eq!(after.pages_mapped, before.pages_mapped);
        write_tokens(&space, &rig.backend, b, 0, 13);
        check_tokens(&space, &rig.backend, b, 13);
        ok(&space);
        // Beyond the reused capacity, just the missing pages are mapped.
        space.grow(b, 16).unwrap(); // 6 pages
        assert_eq!(space.stats().map_calls, before.map_calls + 4);
        check_tokens(&space, &rig.backend, b, 13);
        // A shrink drops the surplus as well.
        space.free(b).unwrap();
        let c = space.admit().unwrap();
        space.grow(c, 1).unwrap();
        assert_eq!(space.mapped_pages(c).unwrap(), 6);
        space.shrink(c, 1).unwrap();
        assert_eq!(space.mapped_pages(c).unwrap(), 1);
        ok(&space);
    }
}

#[test]
fn out_of_memory_leaves_the_slot_unchanged_and_reclaims_deferred() {
    // 24 pages: three slots of 2 pages per tensor (8 pages each), not more.
    for rig in all_rigs(Some(24)) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().unwrap();
        let b = space.admit().unwrap();
        let c = space.admit().unwrap();
        for s in [a, b, c] {
            space.grow(s, 5).unwrap(); // 15/8 → 2 pages
            write_tokens(&space, &rig.backend, s, 0, 5);
        }
        let before = space.stats();
        let err = space.grow(a, 6).expect_err("pool exhausted");
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(space.tokens(a).unwrap(), 5);
        assert_eq!(space.mapped_pages(a).unwrap(), 2);
        assert_eq!(space.stats(), before, "nothing changed");
        ok(&space);
        // Still usable: growth within the mapped pages works.
        space.grow(a, 5).unwrap();
        // Free c (deferred) and grow a: the pool is short, so c's pages are reclaimed.
        space.free(c).unwrap();
        assert_eq!(space.stats().slots_deferred, 1);
        space.grow(a, 8).expect("grow after deferred reclaim"); // 3 pages
        write_tokens(&space, &rig.backend, a, 5, 8);
        let s = space.stats();
        assert_eq!(s.slots_deferred, 0, "the deferred slot was reclaimed");
        assert_eq!(s.pages_mapped, 3 * 4 + 2 * 4);
        check_tokens(&space, &rig.backend, a, 8);
        check_tokens(&space, &rig.backend, b, 5);
        ok(&space);
        // A request that cannot fit even after reclaiming fails cleanly.
        let err = space.grow(b, 20).expect_err("too large");
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(space.tokens(b).unwrap(), 5);
        check_tokens(&space, &rig.backend, b, 5);
        ok(&space);
    }
}

#[test]
fn contents_survive_grows_of_this_and_other_slots() {
    for rig in rigs(None) {
        for zero_page in [false, true] {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page)).expect("space");
            let slots: Vec<SlotId> = (0..4).map(|_| space.admit().unwrap()).collect();
            let mut len = [0u32; 4];
            for step in 1..=20u32 {
                for (i, &s) in slots.iter().enumerate() {
                    let to = (step * (i as u32 + 1)).min(12 + 2 * i as u32);
                    space.grow(s, to).unwrap();
                    write_tokens(&space, &rig.backend, s, len[i], to);
                    len[i] = to;
                }
                for (i, &s) in slots.iter().enumerate() {
                    check_tokens(&space, &rig.backend, s, len[i]);
                }
                ok(&space);
            }
        }
    }
}

#[test]
fn zero_page_backs_unmapped_va() {
    for rig in all_rigs(None) {
        let baseline = rig.backend.live_counts();
        {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, true)).expect("space");
            ok(&space);
            let page = rig.page;
            let stride = space.slot_stride();
            // Every tensor reads as zeros everywhere before any grow.
            for layer in 0..2 {
                for kind in kinds() {
                    let bytes = read_bytes(&rig.backend, space.tensor_ptr(layer, kind), 4 * stride);
                    assert!(
                        bytes.iter().all(|&b| b == 0),
                        "{}: zero page reads zeros",
                        rig.name
                    );
                }
            }
            assert_eq!(
                rig.pool.stats().in_use,
                0,
                "the zero page is not a pool page"
            );
            let a = space.admit().unwrap();
            let base = space.slot_ptr(a, 0, Kind::K).unwrap();
            let err = rig
                .backend
                .write(base, &[1u8; 16])
                .expect_err("zero page is read-only");
            assert!(matches!(err, Error::IllegalAccess { .. }), "{err}");

            space.grow(a, 3).unwrap(); // 2 pages
            write_tokens(&space, &rig.backend, a, 0, 3);
            check_tokens(&space, &rig.backend, a, 3);
            // Past the real pages the zero page still reads as zeros, and padding reads work.
            let tail = read_bytes(&rig.backend, base + 2 * page, stride - 2 * page);
            assert!(tail.iter().all(|&b| b == 0));
            // Writes into the real pages did not leak into the zero page (other slots).
            let other = read_bytes(&rig.backend, base + stride, stride);
            assert!(other.iter().all(|&b| b == 0));
            ok(&space);

            space.shrink(a, 1).unwrap(); // back to 1 page; page 2 is the zero page again
            let second = read_bytes(&rig.backend, base + page, page);
            assert!(second.iter().all(|&b| b == 0), "shrunk pages read zeros");
            check_tokens(&space, &rig.backend, a, 1);
            ok(&space);

            space.free(a).unwrap();
            space.reclaim_deferred();
            let first = read_bytes(&rig.backend, base, page);
            assert!(first.iter().all(|&b| b == 0), "reclaimed pages read zeros");
            ok(&space);
        }
        assert_eq!(
            rig.backend.live_counts().mappings,
            baseline.mappings,
            "drop unmaps all"
        );
        assert_eq!(
            rig.backend.live_counts().reservations,
            baseline.reservations
        );
        assert_eq!(rig.pool.stats().in_use, 0);
    }
}

#[test]
fn drop_gives_every_page_back() {
    for rig in all_rigs(None) {
        let baseline = rig.backend.live_counts();
        {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
            let a = space.admit().unwrap();
            let b = space.admit().unwrap();
            space.grow(a, 20).unwrap();
            space.grow(b, 7).unwrap();
            space.free(b).unwrap();
            assert_eq!(rig.pool.stats().in_use, 32 + 12);
        }
        let stats = rig.pool.stats();
        assert_eq!(stats.in_use, 0);
        assert_eq!(stats.free, 44);
        let now = rig.backend.live_counts();
        assert_eq!(
            (now.mappings, now.reservations),
            (baseline.mappings, baseline.reservations)
        );
    }
}

#[test]
fn map_fault_rolls_back_the_whole_grow() {
    for zero_page in [false, true] {
        let (rig, fake) = fake_rig(None);
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page)).expect("space");
        let a = space.admit().unwrap();
        space.grow(a, 3).unwrap();
        write_tokens(&space, &rig.backend, a, 0, 3);
        let in_use = rig.pool.stats().in_use;
        let mapped = space.stats().pages_mapped;
        // 3 → 10 tokens is 2 → 4 pages: two maps per tensor; the 7th map is in the last tensor.
        fake.fail_nth_map(7);
        let err = space.grow(a, 10).expect_err("injected");
        assert!(matches!(err, Error::InjectedFault(_)), "{err}");
        assert_eq!(space.tokens(a).unwrap(), 3);
        assert_eq!(space.mapped_pages(a).unwrap(), 2);
        assert_eq!(space.stats().pages_mapped, mapped);
        assert_eq!(rig.pool.stats().in_use, in_use, "taken pages went back");
        check_tokens(&space, &rig.backend, a, 3);
        ok(&space);
        space.grow(a, 10).expect("grow after the fault");
        write_tokens(&space, &rig.backend, a, 3, 10);
        check_tokens(&space, &rig.backend, a, 10);
        ok(&space);
        strata_vmm::check_deferred().expect("rollback recorded no error");
    }
}
