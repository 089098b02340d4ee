//! The caching allocator's page sharing (blocks growing their segment in place, large sizes
//! and emptied small runs sharing pages) and random walks against a model, on any backend.

mod caching_common;

use caching_common::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use strata_allocator::{CachingConfig, Error};

#[test]
fn mid_blocks_grow_their_segment_in_place() {
    // Blocks of 1.5 MiB one after the other (a tensor growing step by step): each joins the
    // free tail of the segment and the pages mapped right after it, so reserved follows
    // allocated to the page instead of jumping by a 20 MiB segment or a page per block.
    let e = env();
    let a = &e.alloc;
    let size = 3 * MIB / 2;
    let mut live = Vec::new();
    for i in 1..=12u64 {
        let p = a.allocate(size, S0).unwrap();
        fill(&e.backend, p, size, i);
        live.push((p, size, i));
        assert_eq!(
            a.stats().reserved_bytes,
            (i * size).div_ceil(PAGE) * PAGE,
            "after {i} blocks"
        );
        ok(a);
    }
    assert!(live.windows(2).all(|w| w[1].0 == w[0].0 + size));
    for blk in live {
        check_and_free(a, &e.backend, blk);
        ok(a);
    }
    // Trimming still returns whole pages: everything.
    assert_eq!(a.empty_cache().unwrap(), 9 * PAGE);
    assert_eq!(a.stats().reserved_bytes, 0);
    ok(a);
}

#[test]
fn large_sizes_share_pages() {
    let e = env();
    let a = &e.alloc;
    // Four 1 MiB blocks (the small threshold: large) and four of a page and a bit: before
    // issue 17 each held whole pages of its own (4 + 8 pages); now they share them.
    let mut live = Vec::new();
    for i in 0..4u64 {
        let p = a.allocate(MIB, S0).unwrap();
        fill(&e.backend, p, MIB, i);
        live.push((p, MIB, i));
    }
    assert_eq!(a.stats().reserved_bytes, 2 * PAGE);
    for i in 4..8u64 {
        let size = PAGE + 100 * 1024;
        let p = a.allocate(size, S0).unwrap();
        fill(&e.backend, p, size, i);
        live.push((p, size, i));
    }
    let st = a.stats();
    assert!(
        st.reserved_bytes <= 2 * PAGE + 6 * PAGE,
        "{} reserved",
        st.reserved_bytes
    );
    ok(a);
    // Free every other block: extents merge, and whole free pages inside segments go back
    // to the driver on empty_cache while their neighbours stay live.
    let mut kept = Vec::new();
    for (i, l) in live.into_iter().enumerate() {
        if i % 2 == 0 {
            check_and_free(a, &e.backend, l);
        } else {
            kept.push(l);
        }
    }
    ok(a);
    let before = a.stats().reserved_bytes;
    a.empty_cache().unwrap();
    ok(a);
    let after = a.stats().reserved_bytes;
    assert_eq!(after % PAGE, 0);
    assert!(after < before, "{before} -> {after}");
    for l in kept {
        check_and_free(a, &e.backend, l);
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes, 0);
    ok(a);
}

#[test]
fn emptied_small_runs_serve_other_classes() {
    let e = env();
    let a = &e.alloc;
    // Fill a shared page with runs of one class (32 KiB blocks, two per 64 KiB chunk), free
    // all but one, then ask for another class (64 KiB blocks): the emptied runs must serve it
    // from the same page. Before issue 17 they stayed carved for their class and a new page
    // was mapped; with the page kept in use by one block, nothing else can give room.
    let blocks: Vec<u64> = (0..64).map(|_| a.allocate(30_000, S0).unwrap()).collect();
    assert_eq!(a.stats().reserved_bytes, PAGE, "64 blocks fill one page");
    let created = a.stats().counts.segments_created;
    let keep = blocks[0];
    for &p in &blocks[1..] {
        a.deallocate(p, S0).unwrap();
    }
    ok(a);
    let other: Vec<u64> = (0..30).map(|_| a.allocate(60_000, S0).unwrap()).collect();
    assert_eq!(a.stats().counts.segments_created, created);
    assert_eq!(a.stats().reserved_bytes, PAGE);
    ok(a);
    // And back: the 64 KiB runs, emptied, serve the first class again.
    for p in other {
        a.deallocate(p, S0).unwrap();
    }
    let again: Vec<u64> = (0..60).map(|_| a.allocate(30_000, S0).unwrap()).collect();
    assert_eq!(a.stats().counts.segments_created, created);
    assert_eq!(a.stats().reserved_bytes, PAGE);
    ok(a);
    for p in again {
        a.deallocate(p, S0).unwrap();
    }
    a.deallocate(keep, S0).unwrap();
    ok(a);
}

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, tag: u32, stream: usize },
    Free { pick: usize, stream: usize },
    Record { pick: usize, stream: usize },
    Sleep { tag: u32, keep: bool },
    Wake { tag: u32 },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 1u64..4096,
        3 => 4096u64..(1 << 20),
        3 => (1u64 << 20)..(6 << 20),
    ];
    ops_of(size.boxed())
}

/// Mostly large sizes that are not page multiples (blocks sharing pages, free extents, pages
/// cut out of segments), some small ones (runs returned to their page).
fn large_op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        2 => 1u64..(1 << 20),
        5 => (1u64 << 20)..(3 * PAGE),
        1 => (3 * PAGE)..(6 * PAGE),
    ];
    ops_of(size.boxed())
}

fn ops_of(size: BoxedStrategy<u64>) -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size, 0u32..3, 0usize..2).prop_map(|(size, tag, stream)| Op::Alloc { size, tag, stream }),
        7 => (any::<usize>(), 0usize..2).prop_map(|(pick, stream)| Op::Free { pick, stream }),
        1 => (any::<usize>(), 0usize..2).prop_map(|(pick, stream)| Op::Record { pick, stream }),
        1 => (1u32..3, any::<bool>()).prop_map(|(tag, keep)| Op::Sleep { tag, keep }),
        1 => (1u32..3).prop_map(|tag| Op::Wake { tag }),
        1 => Just(Op::EmptyCache),
    ]
}

struct Live {
    ptr: u64,
    size: u64,
    tag: u32,
    /// `None`: contents are zeros (woke without a copy).
    seed: Option<u64>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn random_walk_against_a_model(ops in proptest::collection::vec(op(), 1..50)) {
        random_walk(ops)?;
    }

    #[test]
    fn random_walk_of_large_blocks_sharing_pages(ops in proptest::collection::vec(large_op(), 1..60)) {
        random_walk(ops)?;
    }
}

/// Applies `ops` to a fresh allocator and a model of it, with the invariant checker after
/// every step.
fn random_walk(ops: Vec<Op>) -> Result<(), TestCaseError> {
    {
        let e = env_with(
            256 * MIB,
            CachingConfig {
                report_leaks: false,
                ..CachingConfig::default()
            },
            None,
        );
        // 256 MiB on the host backend; less than the whole device on CUDA (a context).
        let free_at_start = free_mem(&e.backend);
        let a = &e.alloc;
        let extra = e.backend.stream_create(0).unwrap();
        let streams = [S0, extra];
        let mut live: Vec<Live> = Vec::new();
        let mut asleep: std::collections::HashMap<u32, bool> = Default::default();
        let mut next_seed = 1u64;
        for op in ops {
            match op {
                Op::Alloc { size, tag, stream } => {
                    match a.allocate_tagged(size, streams[stream], tag) {
                        Ok(p) => {
                            prop_assert!(!asleep.contains_key(&tag));
                            prop_assert_eq!(p % 256, 0);
                            for l in &live {
                                prop_assert!(p + size <= l.ptr || l.ptr + l.size <= p, "overlap");
                            }
                            // Ordered after the stream it was allocated on.
                            e.backend.stream_synchronize(streams[stream]).unwrap();
                            fill(&e.backend, p, size, next_seed);
                            live.push(Live {
                                ptr: p,
                                size,
                                tag,
                                seed: Some(next_seed),
                            });
                            next_seed += 1;
                        }
                        Err(Error::InvalidState(_)) => prop_assert!(asleep.contains_key(&tag)),
                        Err(err) => prop_assert!(err.is_out_of_memory(), "{}", err),
                    }
                }
                Op::Free { pick, stream } if !live.is_empty() => {
                    let l = live.swap_remove(pick % live.len());
                    if !asleep.contains_key(&l.tag) {
                        match l.seed {
                            Some(seed) => check(&e.backend, l.ptr, l.size, seed),
                            None => prop_assert!(read_all(&e.backend, l.ptr, l.size)
                                .iter()
                                .all(|&b| b == 0)),
                        }
                    }
                    a.deallocate(l.ptr, streams[stream]).unwrap();
                    prop_assert!(a.deallocate(l.ptr, streams[stream]).is_err());
                }
                Op::Record { pick, stream } if !live.is_empty() => {
                    a.record_stream(live[pick % live.len()].ptr, streams[stream])
                        .unwrap();
                }
                Op::Free { .. } | Op::Record { .. } => {}
                Op::Sleep { tag, keep } => {
                    let r = a.sleep(tag, keep);
                    match asleep.entry(tag) {
                        std::collections::hash_map::Entry::Occupied(_) => prop_assert!(r.is_err()),
                        std::collections::hash_map::Entry::Vacant(v) => {
                            r.unwrap();
                            v.insert(keep);
                        }
                    }
                }
                Op::Wake { tag } => match (a.wake(tag), asleep.get(&tag).copied()) {
                    (Ok(()), Some(keep)) => {
                        asleep.remove(&tag);
                        if !keep {
                            for l in live.iter_mut().filter(|l| l.tag == tag) {
                                l.seed = None;
                            }
                        }
                    }
                    (Err(err), Some(_)) => prop_assert!(err.is_out_of_memory(), "{}", err),
                    (r, None) => prop_assert!(r.is_err()),
                },
                Op::EmptyCache => {
                    a.empty_cache().unwrap();
                }
            }
            if let Err(msg) = a.check_invariants() {
                prop_assert!(false, "{}\n{}", msg, a.report());
            }
            let st = a.stats();
            prop_assert_eq!(st.live_allocations, live.len() as u64);
            prop_assert_eq!(st.allocated_bytes, live.iter().map(|l| l.size).sum::<u64>());
        }
        for tag in asleep.keys().copied().collect::<Vec<_>>() {
            a.wake(tag).unwrap();
        }
        for l in live.drain(..) {
            a.deallocate(l.ptr, S0).unwrap();
        }
        e.backend.stream_synchronize(extra).unwrap();
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        prop_assert_eq!(a.stats().reserved_bytes, 0);
        // Surplus pages of a reclaimed segment wait in the pool's free list.
        e.pool.trim(0);
        prop_assert_eq!(e.pool.stats().in_use, 0);
        prop_assert_eq!(free_mem(&e.backend), free_at_start);
        drop(e.alloc);
        e.backend.stream_destroy(extra).unwrap();
    }
    Ok(())
}
