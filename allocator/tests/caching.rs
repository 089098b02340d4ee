//! `CachingAllocator` on the host backend (strict mode: device memory is never CPU-accessible,
//! so every byte is checked through backend copies), or on the CUDA backend with
//! `STRATA_BACKEND=cuda` (a device larger than a test asks for is capped by the pool's limit).

mod caching_common;

use std::time::Duration;

use caching_common::*;
use strata_allocator::{CachingConfig, Error, MemoryResource};
use strata_vmm::CopyDesc;

#[test]
fn fast_path_reuses_the_same_block_without_map_calls() {
    let e = env();
    let a = &e.alloc;
    let p = a.allocate(1000, S0).unwrap();
    assert_eq!(p % 256, 0);
    a.deallocate(p, S0).unwrap();
    let before = a.stats().counts;
    let mappings = e.backend.live_counts().mappings;
    for _ in 0..1000 {
        let q = a.allocate(1000, S0).unwrap();
        assert_eq!(q, p);
        a.deallocate(q, S0).unwrap();
    }
    let after = a.stats().counts;
    assert_eq!(after.map_calls, before.map_calls);
    assert_eq!(after.set_access_calls, before.set_access_calls);
    assert_eq!(after.cache_hits, before.cache_hits + 1000);
    assert_eq!(e.backend.live_counts().mappings, mappings);
    ok(a);
}

#[test]
fn sizes_are_aligned_distinct_and_hold_their_bytes() {
    let e = env();
    let a = &e.alloc;
    let sizes = [
        1u64,
        255,
        256,
        257,
        1000,
        4096,
        65_537,
        MIB - 1,
        MIB,
        PAGE - 1,
        PAGE,
        PAGE + 1,
        9 * MIB + 7,
    ];
    let mut live = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        let p = a.allocate(s, S0).unwrap();
        assert_ne!(p, 0);
        assert_eq!(p % 256, 0, "size {s}");
        if s >= MIB {
            assert_eq!(p % 512, 0, "large size {s} 512-byte aligned");
        }
        assert_eq!(a.size_of(p).unwrap(), s);
        assert_eq!(a.tag_of(p).unwrap(), 0);
        fill(&e.backend, p, s, i as u64);
        live.push((p, s, i as u64));
    }
    for (i, &(p, s, _)) in live.iter().enumerate() {
        for &(q, t, _) in &live[i + 1..] {
            assert!(p + s <= q || q + t <= p, "overlap {p:#x}+{s} / {q:#x}+{t}");
        }
    }
    ok(a);
    for (p, s, seed) in live {
        check(&e.backend, p, s, seed);
        a.deallocate(p, S0).unwrap();
    }
    let st = a.stats();
    assert_eq!((st.allocated_bytes, st.live_allocations), (0, 0));
    ok(a);
}

#[test]
fn zero_and_absurd_sizes() {
    let e = env();
    let a = &e.alloc;
    let before = a.stats();
    assert_eq!(a.allocate(0, S0).unwrap(), 0);
    a.deallocate(0, S0).unwrap();
    assert_eq!(a.stats(), before);
    // Absurd on any device: beyond the device's own memory, whatever its size.
    let total = e.backend.mem_info(0).unwrap().total;
    for size in [u64::MAX, u64::MAX - PAGE, 1 << 50, total + PAGE] {
        let err = a.allocate(size, S0).unwrap_err();
        assert!(err.is_out_of_memory(), "{size}: {err}");
    }
    assert_eq!(a.stats().counts.ooms, 4);
    assert_eq!(e.pool.stats().in_use, 0);
    let p = a.allocate(3 * MIB, S0).unwrap();
    a.deallocate(p, S0).unwrap();
    ok(a);
}

#[test]
fn bad_frees_are_errors_not_corruption() {
    let e = env();
    let a = &e.alloc;
    let small = a.allocate(512, S0).unwrap();
    let large = a.allocate(4 * MIB, S0).unwrap();
    assert!(matches!(
        a.deallocate(0xdead_0000, S0),
        Err(Error::UnknownPointer(_))
    ));
    assert!(matches!(
        a.deallocate(small + 256, S0),
        Err(Error::UnknownPointer(_))
    ));
    assert!(matches!(
        a.deallocate(large + PAGE, S0),
        Err(Error::UnknownPointer(_))
    ));
    assert!(matches!(
        a.deallocate(large + 256, S0),
        Err(Error::UnknownPointer(_))
    ));
    a.deallocate(small, S0).unwrap();
    assert!(matches!(a.deallocate(small, S0), Err(Error::DoubleFree(_))));
    a.deallocate(large, S0).unwrap();
    assert!(matches!(a.deallocate(large, S0), Err(Error::DoubleFree(_))));
    assert!(matches!(
        a.record_stream(large, S0),
        Err(Error::UnknownPointer(_))
    ));
    assert!(a.size_of(small).is_err());
    // After the cache is emptied the segment is gone, yet the free is still recognized.
    a.empty_cache().unwrap();
    assert!(matches!(a.deallocate(small, S0), Err(Error::DoubleFree(_))));
    assert!(matches!(a.deallocate(large, S0), Err(Error::DoubleFree(_))));
    ok(a);
    // Nothing was corrupted: the same memory is handed out once again.
    let again = a.allocate(4 * MIB, S0).unwrap();
    fill(&e.backend, again, 4 * MIB, 1);
    check(&e.backend, again, 4 * MIB, 1);
    a.deallocate(again, S0).unwrap();
    ok(a);
}

#[test]
fn large_allocation_over_fragmented_free_pages_needs_no_new_pages() {
    // A device of 16 pages: A B C D take 4 each (one segment grown in place); the 8-page
    // request can only be served by remapping free pages: B's behind D's, which are free at
    // the segment's end (or B's and D's behind a new range).
    let e = env_with(32 * MIB, CachingConfig::default(), None);
    let a = &e.alloc;
    let blocks: Vec<u64> = (0..4).map(|_| a.allocate(8 * MIB, S0).unwrap()).collect();
    for (i, &p) in blocks.iter().enumerate() {
        fill(&e.backend, p, 8 * MIB, i as u64);
    }
    a.deallocate(blocks[1], S0).unwrap();
    a.deallocate(blocks[3], S0).unwrap();
    ok(a);
    let created = e.pool.stats().created_total;
    let handles = e.backend.live_counts().handles;
    let big = a.allocate(16 * MIB, S0).unwrap();
    assert_eq!(e.pool.stats().created_total, created);
    assert_eq!(e.backend.live_counts().handles, handles);
    fill(&e.backend, big, 16 * MIB, 99);
    check(&e.backend, big, 16 * MIB, 99);
    check(&e.backend, blocks[0], 8 * MIB, 0);
    check(&e.backend, blocks[2], 8 * MIB, 2);
    let st = a.stats();
    assert_eq!(st.reserved_bytes, 32 * MIB);
    assert!(st.counts.pages_recycled >= 4, "{:?}", st.counts);
    ok(a);
    // The device is full now: one more page is out of memory, and nothing leaks.
    let err = a.allocate(PAGE, S0).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    ok(a);
    for p in [blocks[0], blocks[2], big] {
        a.deallocate(p, S0).unwrap();
    }
    ok(a);
}

#[test]
fn out_of_memory_then_recovery() {
    let e = env_with(64 * MIB, CachingConfig::default(), None);
    let a = &e.alloc;
    let baseline = e.backend.live_counts();
    let mut live = Vec::new();
    let err = loop {
        match a.allocate(6 * MIB, S0) {
            Ok(p) => live.push(p),
            Err(e) => break e,
        }
    };
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(live.len(), 10); // 10 × 3 pages of 32
                                // Small allocations still fit in the remaining pages, then fail cleanly too.
    let mut small = Vec::new();
    let err = loop {
        match a.allocate(100_000, S0) {
            Ok(p) => small.push(p),
            Err(e) => break e,
        }
        assert!(small.len() < 100_000);
    };
    assert!(err.is_out_of_memory(), "{err}");
    ok(a);
    for p in small.drain(..) {
        a.deallocate(p, S0).unwrap();
    }
    a.deallocate(live.pop().unwrap(), S0).unwrap();
    a.deallocate(live.pop().unwrap(), S0).unwrap();
    // 12 MiB of cached pages now serve a request of a size never seen before.
    let p = a.allocate(10 * MIB, S0).unwrap();
    fill(&e.backend, p, 10 * MIB, 5);
    check(&e.backend, p, 10 * MIB, 5);
    a.deallocate(p, S0).unwrap();
    for p in live {
        a.deallocate(p, S0).unwrap();
    }
    ok(a);
    // Every page went back to the driver (a count of handles, not the device's free memory,
    // which a GPU shares with other contexts and the emulated driver with other tests).
    a.empty_cache().unwrap();
    assert_eq!(e.backend.live_counts().handles, baseline.handles);
    assert_eq!(e.pool.stats().free, 0);
    assert_eq!(a.stats().reserved_bytes, 0);
    ok(a);
}

#[test]
fn limit_caps_reserved_bytes() {
    let config = CachingConfig {
        limit: Some(16 * MIB),
        ..CachingConfig::default()
    };
    let e = env_with(1 << 30, config, None);
    let a = &e.alloc;
    let p = a.allocate(10 * MIB, S0).unwrap();
    let err = a.allocate(8 * MIB, S0).unwrap_err();
    assert!(
        matches!(err, Error::LimitExceeded { limit, .. } if limit == 16 * MIB),
        "{err}"
    );
    assert!(matches!(
        a.allocate(u64::MAX, S0),
        Err(Error::LimitExceeded { .. })
    ));
    let q = a.allocate(6 * MIB, S0).unwrap();
    assert_eq!(a.stats().reserved_bytes, 16 * MIB);
    ok(a);
    a.deallocate(q, S0).unwrap();
    a.set_limit(None).unwrap();
    let r = a.allocate(8 * MIB, S0).unwrap();
    assert!(a.stats().reserved_bytes > 16 * MIB);
    // Lowering the limit below what is reserved empties the cache.
    a.deallocate(r, S0).unwrap();
    a.set_limit(Some(12 * MIB)).unwrap();
    assert_eq!(a.stats().reserved_bytes, 10 * MIB);
    assert_eq!(a.limit(), Some(12 * MIB));
    a.deallocate(p, S0).unwrap();
    ok(a);
}

#[test]
fn empty_cache_returns_pages_to_the_driver() {
    let e = env();
    let a = &e.alloc;
    let total = free_mem(&e.backend);
    let big = a.allocate(64 * MIB, S0).unwrap();
    let small: Vec<u64> = (0..100)
        .map(|i| a.allocate(1000 + i * 300, S0).unwrap())
        .collect();
    assert!(free_mem(&e.backend) <= total - 64 * MIB);
    a.deallocate(big, S0).unwrap();
    for p in small {
        a.deallocate(p, S0).unwrap();
    }
    // Freed memory stays cached until asked for.
    assert!(free_mem(&e.backend) <= total - 64 * MIB);
    assert!(a.stats().reserved_bytes >= 64 * MIB);
    let released = a.empty_cache().unwrap();
    assert!(released >= 64 * MIB);
    assert_eq!(a.stats().reserved_bytes, 0);
    assert_eq!(free_mem(&e.backend), total);
    assert_eq!(e.pool.stats().in_use, 0);
    ok(a);
}

#[test]
fn sleep_and_wake_with_host_copy_preserve_contents() {
    let e = env();
    let a = &e.alloc;
    let sizes = [300u64, 4096, 70_000, 3 * MIB + 5, 16 * MIB];
    let mut tagged = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        let p = a.allocate_tagged(s, S0, 7).unwrap();
        fill(&e.backend, p, s, 100 + i as u64);
        tagged.push((p, s, 100 + i as u64));
    }
    let other = a.allocate(5000, S0).unwrap();
    fill(&e.backend, other, 5000, 1);
    let freed_later = a.allocate_tagged(2 * MIB, S0, 7).unwrap();
    let before = free_mem(&e.backend);
    a.sleep(7, true).unwrap();
    ok(a);
    assert!(a.is_asleep(7));
    let after = free_mem(&e.backend);
    assert!(
        after >= before + 16 * MIB + 6 * MIB,
        "sleep released {} bytes",
        after - before
    );
    let st = a.stats();
    assert!(st.tag(7).unwrap().asleep);
    assert_eq!(st.tag(7).unwrap().reserved_bytes, 0);
    assert!(matches!(
        a.allocate_tagged(100, S0, 7),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(
        a.allocate_tagged(8 * MIB, S0, 7),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(a.sleep(7, true), Err(Error::InvalidState(_))));
    // Pointers stay known; freeing one while asleep works.
    assert_eq!(a.tag_of(tagged[0].0).unwrap(), 7);
    a.deallocate(freed_later, S0).unwrap();
    ok(a);
    // Other tags are untouched.
    check(&e.backend, other, 5000, 1);
    let x = a.allocate(MIB * 3, S0).unwrap();
    a.wake(7).unwrap();
    ok(a);
    assert!(!a.is_asleep(7));
    assert!(matches!(a.wake(7), Err(Error::InvalidState(_))));
    for &(p, s, seed) in &tagged {
        check(&e.backend, p, s, seed);
    }
    assert_eq!(a.stats().tag(7).unwrap().host_copy_bytes, 0);
    for (p, _, _) in tagged {
        a.deallocate(p, S0).unwrap();
    }
    a.deallocate(x, S0).unwrap();
    a.deallocate(other, S0).unwrap();
    ok(a);
}

#[test]
fn wake_without_copy_gives_zeros() {
    let e = env();
    let a = &e.alloc;
    let small = a.allocate_tagged(10_000, S0, 3).unwrap();
    let large = a.allocate_tagged(5 * MIB, S0, 3).unwrap();
    fill(&e.backend, small, 10_000, 1);
    fill(&e.backend, large, 5 * MIB, 2);
    a.sleep(3, false).unwrap();
    ok(a);
    // Dirty the freed physical pages through another tag, so that zeros are really written.
    let junk = a.allocate(8 * MIB, S0).unwrap();
    fill(&e.backend, junk, 8 * MIB, 3);
    a.deallocate(junk, S0).unwrap();
    a.wake(3).unwrap();
    ok(a);
    assert!(read_all(&e.backend, small, 10_000).iter().all(|&b| b == 0));
    assert!(read_all(&e.backend, large, 5 * MIB).iter().all(|&b| b == 0));
    a.deallocate(small, S0).unwrap();
    a.deallocate(large, S0).unwrap();
    ok(a);
}

#[test]
fn wake_out_of_memory_leaves_the_tag_asleep() {
    let e = env_with(32 * MIB, CachingConfig::default(), None);
    let a = &e.alloc;
    let p = a.allocate_tagged(12 * MIB, S0, 1).unwrap();
    fill(&e.backend, p, 12 * MIB, 8);
    a.sleep(1, true).unwrap();
    let hog = a.allocate(24 * MIB, S0).unwrap();
    assert!(a.wake(1).unwrap_err().is_out_of_memory());
    assert!(a.is_asleep(1));
    ok(a);
    a.deallocate(hog, S0).unwrap();
    // The hog's cached pages are recycled for the wake.
    a.wake(1).unwrap();
    check(&e.backend, p, 12 * MIB, 8);
    a.deallocate(p, S0).unwrap();
    ok(a);
}

#[test]
fn sleep_to_disk_keeps_contents_in_a_file_and_wake_restores_them() {
    let e = env();
    let a = &e.alloc;
    let dir = std::env::temp_dir().join(format!("strata-sleep-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Several chunks of the disk pipeline, a small block, one freed while asleep.
    let sizes = [300u64, 70_000, 3 * MIB + 5, 20 * MIB + 3];
    let tagged: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let p = a.allocate_tagged(s, S0, 9).unwrap();
            fill(&e.backend, p, s, 500 + i as u64);
            (p, s, 500 + i as u64)
        })
        .collect();
    let freed_later = a.allocate_tagged(MIB, S0, 9).unwrap();
    let before = free_mem(&e.backend);
    a.sleep_to_disk(9, &dir).unwrap();
    ok(a);
    assert!(a.is_asleep(9));
    assert!(free_mem(&e.backend) >= before + 24 * MIB);
    // The copies are not in host memory and the file is already unlinked.
    assert_eq!(a.stats().tag(9).unwrap().host_copy_bytes, 0);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    a.deallocate(freed_later, S0).unwrap();
    a.wake(9).unwrap();
    ok(a);
    for &(p, s, seed) in &tagged {
        check(&e.backend, p, s, seed);
    }
    // A directory that does not exist: an OS error, the tag stays awake and intact.
    let err = a.sleep_to_disk(9, &dir.join("missing")).unwrap_err();
    assert!(matches!(err, Error::Os { .. }), "{err}");
    assert!(!a.is_asleep(9));
    for &(p, s, seed) in &tagged {
        check(&e.backend, p, s, seed);
        a.deallocate(p, S0).unwrap();
    }
    ok(a);
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn tags_never_share_pages() {
    let e = env();
    let a = &e.alloc;
    let mut pages = std::collections::HashMap::new();
    for i in 0..300u64 {
        let tag = (i % 3) as u32;
        let p = a.allocate_tagged(256 + (i % 5) * 1000, S0, tag).unwrap();
        let page = p / PAGE;
        assert_eq!(
            *pages.entry(page).or_insert(tag),
            tag,
            "page {page:#x} shared"
        );
    }
    let st = a.stats();
    for tag in 0..3 {
        assert_eq!(st.tag(tag).unwrap().live_allocations, 100);
        assert!(st.tag(tag).unwrap().reserved_bytes >= PAGE);
    }
    ok(a);
}

#[test]
fn every_small_class_of_a_tag_shares_a_few_pages() {
    // One block of every size class (256 B .. 1 MiB) under each of two tags: runs of chunks in
    // shared pages, not a page per class (44 classes would take 44 pages per tag).
    let e = env();
    let a = &e.alloc;
    let mut sizes = vec![1u64];
    while let Some(&last) = sizes.last() {
        let next =
            strata_allocator::caching::class_size(strata_allocator::caching::class_index(last)) + 1;
        if next >= a.small_threshold() {
            break;
        }
        sizes.push(next);
    }
    assert_eq!(sizes.len(), 44);
    let mut live = Vec::new();
    for tag in [1u32, 2] {
        for (i, &size) in sizes.iter().enumerate() {
            let p = a.allocate_tagged(size, S0, tag).unwrap();
            assert_eq!(p % 256, 0);
            fill(&e.backend, p, size, i as u64 + 100 * tag as u64);
            live.push((p, size, i as u64 + 100 * tag as u64, tag));
        }
        ok(a);
    }
    let st = a.stats();
    for tag in [1u32, 2] {
        let reserved = st.tag(tag).unwrap().reserved_bytes;
        assert!(reserved <= 5 * PAGE, "tag {tag}: {reserved} bytes reserved");
    }
    // No two tags on one page, and no two live blocks overlap.
    let mut pages = std::collections::HashMap::new();
    let mut ranges: Vec<(u64, u64)> = live.iter().map(|&(p, s, _, _)| (p, p + s)).collect();
    ranges.sort_unstable();
    assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "overlap");
    for &(p, size, seed, tag) in &live {
        for page in [p / PAGE, (p + size - 1) / PAGE] {
            assert_eq!(
                *pages.entry(page).or_insert(tag),
                tag,
                "page {page:#x} shared"
            );
        }
        check(&e.backend, p, size, seed);
    }
    // Freed and emptied, every shared page goes back, and sleep/wake of a tag keeps the rest.
    for &(p, _, _, tag) in &live {
        if tag == 1 {
            a.deallocate(p, S0).unwrap();
        }
    }
    a.sleep(2, true).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes, 0);
    ok(a);
    a.wake(2).unwrap();
    for &(p, size, seed, tag) in &live {
        if tag == 2 {
            check(&e.backend, p, size, seed);
            a.deallocate(p, S0).unwrap();
        }
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes, 0);
    ok(a);
}

#[test]
fn freed_block_moves_to_another_stream_after_an_event() {
    // Device-to-device copies take 300 ms: work queued on a stream is really in flight.
    let link = slow_device_copies();
    let e = env_with(1 << 30, CachingConfig::default(), Some(link));
    let a = &e.alloc;
    let s1 = e.backend.stream_create(0).unwrap();
    let s2 = e.backend.stream_create(0).unwrap();
    let src = a.allocate(4096, S0).unwrap();
    fill(&e.backend, src, 4096, 42);
    let p = a.allocate(8192, s1).unwrap();
    // s1: a slow copy into p, then p is freed on s1 and allocated on s2.
    // SAFETY: both ranges are device memory; no host range is involved.
    unsafe {
        e.backend
            .copy_async(
                s1,
                &[CopyDesc {
                    dst: p,
                    src,
                    len: 4096,
                }],
            )
            .unwrap()
    };
    a.deallocate(p, s1).unwrap();
    let waits = a.stats().counts.stream_waits;
    let q = a.allocate(8192, s2).unwrap();
    assert_eq!(q, p, "the block freed on s1 is reused on s2");
    assert_eq!(a.stats().counts.stream_waits, waits + 1);
    // s2's write is ordered after s1's copy: it lands last.
    e.backend.memset_async(s2, q, 0xab, 4096).unwrap();
    e.backend.stream_synchronize(s2).unwrap();
    e.backend.stream_synchronize(s1).unwrap();
    assert!(read_all(&e.backend, q, 4096).iter().all(|&b| b == 0xab));
    a.deallocate(q, s2).unwrap();
    a.deallocate(src, S0).unwrap();
    ok(a);
    drop(e.alloc);
    e.backend.stream_destroy(s1).unwrap();
    e.backend.stream_destroy(s2).unwrap();
}

#[test]
fn record_stream_holds_the_block_until_the_other_stream_is_done() {
    let e = env();
    let a = &e.alloc;
    let s1 = e.backend.stream_create(0).unwrap();
    let s2 = e.backend.stream_create(0).unwrap();
    // Work on s2 takes 300 ms as events report it, on any device (a 4 KiB copy on a GPU is
    // done in microseconds, which hid the block's wait there).
    e.hooks
        .set_stream_latency(s2, Some(Duration::from_millis(300)));
    for large in [false, true] {
        let size = if large { 4 * MIB } else { 4096 };
        let p = a.allocate(size, s1).unwrap();
        let dst = a.allocate(size, s1).unwrap();
        // s2 reads p for 300 ms.
        // SAFETY: both ranges are device memory; no host range is involved.
        unsafe {
            e.backend
                .copy_async(
                    s2,
                    &[CopyDesc {
                        dst,
                        src: p,
                        len: 4096,
                    }],
                )
                .unwrap()
        };
        a.record_stream(p, s2).unwrap();
        a.deallocate(p, s1).unwrap();
        assert_eq!(a.stats().pending_blocks, 1);
        assert!(matches!(a.deallocate(p, s1), Err(Error::DoubleFree(_))));
        ok(a);
        // While s2 is busy, p is not handed out again (not even on s1).
        let q = a.allocate(size, s1).unwrap();
        assert_ne!(q, p);
        a.empty_cache().unwrap();
        assert_eq!(a.stats().pending_blocks, 1);
        e.backend.stream_synchronize(s2).unwrap();
        // The next slow path polls the events; the block is back in its bin.
        a.empty_cache().unwrap();
        assert_eq!(a.stats().pending_blocks, 0);
        ok(a);
        let r = a.allocate(size, s1).unwrap();
        if !large {
            assert_eq!(r, p);
        }
        for x in [q, r, dst] {
            a.deallocate(x, s1).unwrap();
        }
        ok(a);
    }
    // Freeing on another stream than the allocating one is ordered the same way.
    let p = a.allocate(4096, s1).unwrap();
    a.deallocate(p, s2).unwrap();
    e.backend.stream_synchronize(s1).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().pending_blocks, 0);
    ok(a);
    drop(e.alloc);
    e.backend.stream_destroy(s1).unwrap();
    e.backend.stream_destroy(s2).unwrap();
}

#[test]
fn memory_resource_trait_and_report() {
    let e = env();
    let r: &dyn MemoryResource = &e.alloc;
    assert_eq!(r.allocate(0, S0).unwrap(), 0);
    r.deallocate(0, S0).unwrap();
    let p = r.allocate(123, S0).unwrap();
    let q = e.alloc.allocate_tagged(5 * MIB, S0, 9).unwrap();
    assert_eq!(r.device(), 0);
    let report = e.alloc.report();
    assert!(report.contains("tag 9"), "{report}");
    assert!(report.contains("5.00 MiB"), "{report}");
    assert!(report.contains("123 B"), "{report}");
    assert_eq!(e.alloc.live_allocations().len(), 2);
    r.deallocate(p, S0).unwrap();
    e.alloc.deallocate(q, S0).unwrap();
    ok(&e.alloc);
}

#[test]
fn drop_returns_every_page() {
    let e = env_with(
        1 << 30,
        CachingConfig {
            report_leaks: false,
            ..CachingConfig::default()
        },
        None,
    );
    let baseline = e.backend.live_counts();
    let total = free_mem(&e.backend);
    let _leaked = e.alloc.allocate(3 * MIB, S0).unwrap();
    let _small = e.alloc.allocate_tagged(3000, S0, 4).unwrap();
    let cached = e.alloc.allocate(7 * MIB, S0).unwrap();
    e.alloc.deallocate(cached, S0).unwrap();
    e.alloc.sleep(4, true).unwrap();
    drop(e.alloc);
    assert_eq!(e.pool.stats().in_use, 0);
    e.pool.trim(0);
    drop(e.pool);
    assert_eq!(free_mem(&e.backend), total);
    let now = e.backend.live_counts();
    assert_eq!(now.handles, baseline.handles);
    assert_eq!(now.mappings, 0);
    assert!(now.reservations < baseline.reservations);
}

#[test]
fn peak_reserved_tracks_peak_allocated_for_large_sizes() {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    let e = env_with(4 << 30, CachingConfig::default(), None);
    let a = &e.alloc;
    let mut rng = SmallRng::seed_from_u64(1);
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..2000 {
        if live.len() < 40 && (live.is_empty() || rng.random_bool(0.5)) {
            let size = rng.random_range(PAGE + 1..64 * MIB);
            live.push(a.allocate(size, S0).unwrap());
        } else {
            let p = live.swap_remove(rng.random_range(0..live.len()));
            a.deallocate(p, S0).unwrap();
        }
    }
    let st = a.stats();
    // Large blocks are rounded to 512 bytes, not to pages (issue 17): the rest of a block's
    // last page serves other blocks, so reserved may exceed the block bytes by partly used
    // pages, and the block bytes exceed the requests by under 512 bytes each.
    assert!(st.peak_allocated_block_bytes < st.peak_allocated_bytes + 40 * 512);
    let ratio = st.peak_reserved_bytes as f64 / st.peak_allocated_bytes as f64;
    assert!(
        ratio <= 1.05,
        "peak reserved / peak requested = {ratio}\n{}",
        a.report()
    );
    ok(a);
}

#[test]
fn threads_get_distinct_memory() {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    let e = env();
    let a = &e.alloc;
    let backend = &e.backend;
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                let mut live: Vec<(u64, u64, u64)> = Vec::new();
                for i in 0..300u64 {
                    if live.len() < 20 && rng.random_bool(0.6) {
                        let size = if rng.random_bool(0.9) {
                            rng.random_range(1..200_000)
                        } else {
                            rng.random_range(MIB..6 * MIB)
                        };
                        let tag = (t % 2) as u32;
                        let p = a.allocate_tagged(size, S0, tag).unwrap();
                        let seed = t << 32 | i;
                        fill(backend, p, size, seed);
                        live.push((p, size, seed));
                    } else if !live.is_empty() {
                        check_and_free(
                            a,
                            backend,
                            live.swap_remove(rng.random_range(0..live.len())),
                        );
                    }
                }
                for l in live {
                    check_and_free(a, backend, l);
                }
            });
        }
    });
    ok(a);
    assert_eq!(a.stats().live_allocations, 0);
}
