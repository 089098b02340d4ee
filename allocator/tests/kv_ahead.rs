//! KvSpace map-ahead (`KvSpace::start_map_ahead`): grows publish rows the background mapper
//! mapped; pages ahead belong to their slot and go back first when the pool runs out. The
//! random walks with the mapper on are in `kv_space_walk.rs`; timings are in
//! `benches/kv_ahead.rs`. The host rig is shared with the other KV tests (`kv_common/`).
//! With a zero page, the tail of every slot reads zeros (rows ahead included) and writes there
//! fault, whatever the mapper holds.

mod kv_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_common::{host_rig, kinds, ok, read_bytes, Rig, HOST_SMALL_PAGE};
use strata_allocator::{Kind, KvConfig, KvSpace, SlotId};
use strata_vmm::{Backend, Error};

/// 2 layers (4 tensors, so a row is 4 pages), 4 slots of 8 pages, 1/4 page per token.
fn config(page: u64, zero_page: bool) -> KvConfig {
    KvConfig {
        layers: 2,
        max_slots: 4,
        max_tokens: 32,
        bytes_per_token: page / 4,
        zero_page,
    }
}

const ROW: u64 = 4;

/// Waits (at most 20 s) until the mapper holds at least `pages` pages ahead.
fn wait_ahead(space: &KvSpace, pages: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while space.stats().pages_ahead < pages {
        assert!(
            Instant::now() < deadline,
            "the mapper never mapped {pages} pages ahead"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn start_is_validated() {
    let Some(Rig { pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let page = pool.page_size();
    let mut space = KvSpace::new(Arc::clone(&pool), config(page, false)).unwrap();
    assert!(matches!(
        space.start_map_ahead(3),
        Err(Error::InvalidArgument(_))
    ));
    space.start_map_ahead(8).unwrap();
    assert!(space.maps_ahead());
    assert!(matches!(
        space.start_map_ahead(8),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn grows_publish_rows_mapped_ahead() {
    let Some(Rig { pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), false)).unwrap();
    space.start_map_ahead(16).unwrap();
    let slot = space.admit().unwrap();
    // An admitted slot gets its first row ahead of its first grow.
    wait_ahead(&space, ROW);
    ok(&space);
    space.grow(slot, 4).unwrap();
    assert_eq!(space.stats().pages_from_ahead, ROW);
    wait_ahead(&space, ROW);
    ok(&space);
    space.grow(slot, 8).unwrap();
    assert_eq!(space.stats().pages_from_ahead, 2 * ROW);
    assert_eq!(space.stats().pages_mapped, 2 * ROW);
    ok(&space);
    // Pages ahead never exceed the budget.
    std::thread::sleep(Duration::from_millis(20));
    assert!(space.stats().pages_ahead <= 16);
    drop(space);
    assert_eq!(
        pool.stats().in_use,
        0,
        "every page ahead went back with the space"
    );
}

#[test]
fn shrink_gives_rows_back_and_free_keeps_them_with_the_deferred_slot() {
    let Some(Rig { pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), false)).unwrap();
    space.start_map_ahead(8).unwrap();
    let slot = space.admit().unwrap();
    space.grow(slot, 4).unwrap();
    wait_ahead(&space, ROW);
    space.shrink(slot, 0).unwrap();
    ok(&space);
    // The rows ahead went back (`ok` counted them against the pool); the mapper may already
    // map the shrunk slot's first row again.
    assert_eq!(space.stats().pages_mapped, 0);
    assert!(space.stats().pages_ahead <= 8, "within the budget");
    space.grow(slot, 4).unwrap();
    wait_ahead(&space, ROW);
    let ahead = space.stats().pages_ahead;
    space.free(slot).unwrap();
    ok(&space);
    let s = space.stats();
    assert_eq!((s.pages_ahead, s.slots_deferred), (0, 1));
    assert!(
        s.pages_mapped >= ROW + ahead,
        "the rows ahead stay with the deferred slot"
    );
    assert_eq!(space.reclaim_deferred() as u64, s.pages_mapped);
    ok(&space);
}

#[test]
fn out_of_memory_takes_pages_ahead_back_first() {
    // 12 pages: slot a's row and the two rows ahead (a's second, b's first: the budget) fill
    // the pool; b's second row fits only once a's row ahead goes back.
    let Some(Rig { pool, .. }) = host_rig(Some(12), HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), false)).unwrap();
    space.start_map_ahead(8).unwrap();
    let a = space.admit().unwrap();
    let b = space.admit().unwrap();
    space.grow(a, 4).unwrap();
    wait_ahead(&space, 2 * ROW);
    ok(&space);
    assert_eq!(pool.stats().in_use, 12);
    space
        .grow(b, 8)
        .expect("the pages ahead went back for a synchronous grow");
    ok(&space);
    assert_eq!(space.stats().pages_mapped, 3 * ROW);
    let err = space.grow(b, 12).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(space.tokens(b).unwrap(), 8);
    ok(&space);
}

/// Writes `byte` over page `page` of `slot` in every tensor.
fn fill_page(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, page: usize, byte: u8) {
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let va = space.slot_ptr(slot, layer, kind).unwrap() + page as u64 * space.page_size();
            backend
                .write(va, &vec![byte; space.page_size() as usize])
                .expect("a page below the extent is writable");
        }
    }
}

/// Page `page` of `slot` holds `byte` throughout, in every tensor.
fn page_holds(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, page: usize, byte: u8) {
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let va = space.slot_ptr(slot, layer, kind).unwrap() + page as u64 * space.page_size();
            let bytes = read_bytes(backend, va, space.page_size());
            assert!(
                bytes.iter().all(|&b| b == byte),
                "page {page} of layer {layer} {kind:?} holds {byte}"
            );
        }
    }
}

#[test]
fn rows_a_grow_took_from_the_mapper_are_filed_in_place_before_the_tables_change() {
    // A grow that ready rows cover leaves them with the mapper, owed to the tables; evict,
    // a grow the mapper cannot cover, shrink, free and drop file them first. Filing at the
    // wrong pages, twice or not at all breaks the layout check, the bytes or the page count.
    let Some(Rig { backend, pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), false)).unwrap();
    space.start_map_ahead(ROW as usize).unwrap();
    let slot = space.admit().unwrap();
    for (page, tokens) in [(0, 4), (1, 8), (2, 12)] {
        wait_ahead(&space, ROW);
        space.grow(slot, tokens).unwrap();
        ok(&space);
        fill_page(&space, &backend, slot, page, 0x10 + page as u8);
    }
    assert_eq!(space.stats().pages_from_ahead, 3 * ROW);
    space.evict_page(slot, 1).unwrap();
    ok(&space);
    page_holds(&space, &backend, slot, 0, 0x10);
    page_holds(&space, &backend, slot, 2, 0x12);
    space.restore_page(slot, 1).unwrap();
    fill_page(&space, &backend, slot, 1, 0x11);
    // Owed rows again, then a grow of 4 pages that one row ahead cannot cover.
    wait_ahead(&space, ROW);
    space.grow(slot, 16).unwrap();
    wait_ahead(&space, ROW);
    space.grow(slot, 32).unwrap();
    ok(&space);
    for page in 0..3 {
        page_holds(&space, &backend, slot, page, 0x10 + page as u8);
    }
    fill_page(&space, &backend, slot, 7, 0x17);
    space.shrink(slot, 8).unwrap();
    ok(&space);
    assert_eq!(space.stats().pages_mapped, 2 * ROW);
    wait_ahead(&space, ROW);
    space.grow(slot, 12).unwrap();
    space.free(slot).unwrap();
    ok(&space);
    let again = space.admit().unwrap();
    page_holds(&space, &backend, again, 0, 0x10);
    page_holds(&space, &backend, again, 1, 0x11);
    wait_ahead(&space, ROW);
    space.grow(again, 16).unwrap();
    drop(space);
    assert_eq!(
        pool.stats().in_use,
        0,
        "every page went back with the space"
    );
}

#[test]
fn a_grow_of_several_rows_is_refilled_by_one_job() {
    let Some(Rig { pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), false)).unwrap();
    space.start_map_ahead(16).unwrap();
    let slot = space.admit().unwrap();
    wait_ahead(&space, ROW);
    // 3 pages: the row ahead is published, the other two are mapped here (one set_access per
    // tensor); the mapper then keeps the grow's 3 rows ahead, mapped as one run per tensor.
    space.grow(slot, 12).unwrap();
    wait_ahead(&space, 3 * ROW);
    ok(&space);
    let s = space.stats();
    assert_eq!((s.pages_from_ahead, s.pages_ahead), (ROW, 3 * ROW));
    assert_eq!(
        s.map_calls,
        ROW + 2 * ROW + 3 * ROW,
        "one map call per page"
    );
    assert_eq!(
        s.set_access_calls,
        3 * ROW,
        "one set_access per tensor for the admitted row, the grow's own run and the refill"
    );
}

#[test]
fn steady_growth_does_not_wake_the_mapper() {
    let Some(Rig { pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let page = pool.page_size();
    let mut space = KvSpace::new(
        Arc::clone(&pool),
        KvConfig {
            max_tokens: 256,
            ..config(page, false)
        },
    )
    .unwrap();
    space.start_map_ahead(32).unwrap();
    let slots = [space.admit().unwrap(), space.admit().unwrap()];
    wait_ahead(&space, 2 * ROW);
    let rounds = 60u32;
    for round in 1..=rounds {
        for &slot in &slots {
            // One new page (4 tokens) per slot per round, a decode step apart.
            space.grow(slot, 4 * round).unwrap();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    ok(&space);
    let s = space.stats();
    let grows = u64::from(rounds) * 2;
    // The first grow wakes the parked mapper; from then on it polls while the slots grow (a
    // wake-up per grow before). A preempted test thread may let it park now and then.
    assert!(
        s.mapper_wakeups * 10 < grows,
        "{} of {grows} grows woke the mapper",
        s.mapper_wakeups
    );
    assert!(s.pages_from_ahead > 0, "the mapper kept rows ahead");
}

#[test]
fn shrinking_a_growing_slot_never_lets_the_mapper_map_over_its_pages() {
    // A shrink gives the slot's pages back before the mapper may claim rows at the new extent;
    // claimed the other way round, a polling mapper mapped over pages still in the tables
    // (refused by the driver as already mapped, found by the invariant check).
    // With a zero page too: the mapper lifts it off rows past the extent while the shrinks lay
    // it back behind the pages they cut.
    let Some(Rig { pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    for zero_page in [false, true] {
        let mut space =
            KvSpace::new(Arc::clone(&pool), config(pool.page_size(), zero_page)).unwrap();
        space.start_map_ahead(16).unwrap();
        let slot = space.admit().unwrap();
        for _ in 0..150 {
            for tokens in [4, 8, 12, 16] {
                space.grow(slot, tokens).unwrap();
                std::thread::sleep(Duration::from_micros(300));
            }
            space.shrink(slot, 0).unwrap();
        }
        ok(&space);
    }
}

/// Slot `slot`'s pages from `from` on, in every tensor, read zeros (strict host backend: an
/// unmapped page fails the read). Call it with the mapper's budget full (one row), so that no
/// job swaps a row meanwhile.
fn tail_reads_zeros(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, from: usize) {
    let page = space.page_size();
    let stride = space.slot_stride();
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).unwrap();
            let tail = read_bytes(
                backend,
                base + from as u64 * page,
                stride - from as u64 * page,
            );
            assert!(
                tail.iter().all(|&b| b == 0),
                "layer {layer} {kind:?}: tail reads zeros"
            );
        }
    }
}

/// Slot `slot`'s last page (past every row the mapper may hold here) is the read-only zero page.
fn last_page_is_read_only(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId) {
    let last = space.slot_stride() - space.page_size();
    let base = space.slot_ptr(slot, 0, Kind::V).unwrap();
    let err = backend
        .write(base + last, &[1u8; 16])
        .expect_err("the zero page is read-only");
    assert!(matches!(err, Error::IllegalAccess { .. }), "{err}");
}

#[test]
fn zero_page_space_grows_from_rows_ahead_and_its_tail_reads_zeros() {
    let Some(Rig { backend, pool, .. }) = host_rig(None, HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), true)).unwrap();
    // One row of budget: once it is mapped the mapper has nothing to do while the test reads.
    space.start_map_ahead(ROW as usize).unwrap();
    let slot = space.admit().unwrap();
    wait_ahead(&space, ROW);
    ok(&space);
    // The row ahead replaced the zero page and reads zeros, like it.
    tail_reads_zeros(&space, &backend, slot, 0);
    last_page_is_read_only(&space, &backend, slot);
    space.grow(slot, 4).unwrap();
    assert_eq!(space.stats().pages_from_ahead, ROW);
    // The published row is writable (it is a pool page now) and starts as zeros.
    let base = space.slot_ptr(slot, 1, Kind::K).unwrap();
    assert!(read_bytes(&backend, base, space.page_size())
        .iter()
        .all(|&b| b == 0));
    backend
        .write(base, &[7u8; 64])
        .expect("a grown row is writable");
    wait_ahead(&space, ROW);
    space.grow(slot, 8).unwrap();
    assert_eq!(space.stats().pages_from_ahead, 2 * ROW);
    wait_ahead(&space, ROW);
    ok(&space);
    tail_reads_zeros(&space, &backend, slot, 2);
    last_page_is_read_only(&space, &backend, slot);
    drop(space);
    assert_eq!(pool.stats().in_use, 0, "every page ahead went back");
}

#[test]
fn zero_page_comes_back_on_shrink_free_and_release() {
    // 16 pages: the slot's 3 rows and the row ahead; every page the mapper maps after the
    // shrink is one of them again.
    let Some(Rig { backend, pool, .. }) = host_rig(Some(16), HOST_SMALL_PAGE) else {
        return;
    };
    let page = pool.page_size();
    let mut space = KvSpace::new(Arc::clone(&pool), config(page, true)).unwrap();
    space.start_map_ahead(ROW as usize).unwrap();
    let slot = space.admit().unwrap();
    space.grow(slot, 12).unwrap(); // 3 pages
    wait_ahead(&space, ROW);
    // Nines in every page, the row ahead's included (mapped read-write, unpublished).
    for layer in 0..2 {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).unwrap();
            backend.write(base, &vec![9u8; 4 * page as usize]).unwrap();
        }
    }
    // Shrink: the cut pages and the row ahead get the zero page back; the pages go back to the
    // pool holding nines.
    space.shrink(slot, 4).unwrap();
    ok(&space);
    tail_reads_zeros(&space, &backend, slot, 2);
    // The mapper maps row 1 ahead again, from recycled pages: zero-filled, like the zero page.
    wait_ahead(&space, ROW);
    tail_reads_zeros(&space, &backend, slot, 1);
    last_page_is_read_only(&space, &backend, slot);
    // Truncate (a free with a hole): the pages past the hole and the rows ahead go back.
    space.grow(slot, 12).unwrap();
    wait_ahead(&space, ROW);
    space.evict_page(slot, 1).unwrap();
    let index = slot.index();
    space.free(slot).unwrap();
    ok(&space);
    assert_eq!(
        space.stats().pages_ahead,
        0,
        "a freed slot keeps nothing ahead"
    );
    assert_eq!(
        space.stats().pages_mapped,
        ROW,
        "truncated to its first hole"
    );
    let again = space.admit().unwrap();
    assert_eq!(again.index(), index, "the deferred slot comes back");
    space.shrink(again, 0).unwrap();
    // Release: out of memory for another space takes the rows ahead back; here the space's
    // drop does, and the zero page is laid back before the tables go.
    wait_ahead(&space, ROW);
    ok(&space);
    drop(space);
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn zero_page_rows_ahead_go_back_when_the_pool_runs_out() {
    let Some(Rig { backend, pool, .. }) = host_rig(Some(12), HOST_SMALL_PAGE) else {
        return;
    };
    let mut space = KvSpace::new(Arc::clone(&pool), config(pool.page_size(), true)).unwrap();
    space.start_map_ahead(8).unwrap();
    let a = space.admit().unwrap();
    let b = space.admit().unwrap();
    space.grow(a, 4).unwrap();
    wait_ahead(&space, 2 * ROW);
    assert_eq!(pool.stats().in_use, 12);
    space
        .grow(b, 8)
        .expect("the rows ahead went back for a synchronous grow");
    ok(&space);
    // a's row ahead went back with the zero page behind it.
    tail_reads_zeros(&space, &backend, a, 1);
    last_page_is_read_only(&space, &backend, a);
    tail_reads_zeros(&space, &backend, b, 2);
}
