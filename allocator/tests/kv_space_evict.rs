//! `KvSpace` eviction and restore of pages (what a tier manager does under it): holes keep their
//! VA, read zeros behind the zero page or fault without it, and read their bytes again once
//! restored and copied back; a restore that runs out of memory leaves the hole.
//!
//! Set-up shared with `kv_space.rs` in `kv_common/`.

mod kv_common;

use std::sync::Arc;

use kv_common::{
    all_rigs, check_tokens, config, fake_rig, host_rig, kinds, ok, read_bytes, seed_of,
    write_tokens, HOST_GPU_PAGE, HOST_SMALL_PAGE,
};
use strata_allocator::{Kind, KvSpace, SlotId};
use strata_kernels::pattern::first_mismatch;
use strata_vmm::{
    copy_async_in, Backend, CopyDesc, CopyKind, CopyScope, DevicePtr, Error, HostBuffer,
    Reservation, Stream,
};

/// Copies page `p` of `slot` out of every tensor (backend reads), in tensor order.
fn save_page(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, p: usize) -> Vec<Vec<u8>> {
    let page = space.page_size();
    let mut out = Vec::new();
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            out.push(read_bytes(backend, base + p as u64 * page, page));
        }
    }
    out
}

fn load_page(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    slot: SlotId,
    p: usize,
    saved: &[Vec<u8>],
) {
    let page = space.page_size();
    let mut it = saved.iter();
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            let bytes = it.next().expect("one saved page per tensor");
            backend
                .write(base + p as u64 * page, bytes)
                .expect("write back");
        }
    }
}

#[test]
fn evict_and_restore_pages_keep_the_va_and_the_bytes_copied_back() {
    for zero_page in [false, true] {
        for rig in all_rigs(None) {
            let baseline = rig.backend.live_counts();
            {
                let mut space = KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page))
                    .expect("space");
                let page = rig.page;
                let a = space.admit().unwrap();
                let b = space.admit().unwrap();
                space.grow(a, 20).unwrap(); // 8 pages per tensor
                space.grow(b, 5).unwrap(); // 2 pages
                write_tokens(&space, &rig.backend, a, 0, 20);
                write_tokens(&space, &rig.backend, b, 0, 5);
                let ptr = space.slot_ptr(a, 1, Kind::V).unwrap();
                let saved: Vec<_> = (2..5)
                    .map(|p| save_page(&space, &rig.backend, a, p))
                    .collect();
                let in_use = rig.pool.stats().in_use;
                let s0 = space.stats();

                space.evict_pages(a, 2..4).unwrap();
                space.evict_page(a, 4).unwrap();
                ok(&space);
                assert_eq!(space.evicted_pages(a).unwrap(), vec![2, 3, 4]);
                assert!(!space.is_resident(a, 3).unwrap());
                assert!(space.is_resident(a, 5).unwrap());
                assert_eq!(space.tokens(a).unwrap(), 20, "tokens unchanged");
                assert_eq!(space.mapped_pages(a).unwrap(), 8, "extent unchanged");
                assert_eq!(rig.pool.stats().in_use, in_use - 3 * 4, "{}", rig.name);
                let s1 = space.stats();
                assert_eq!(s1.pages_mapped, s0.pages_mapped - 12);
                assert_eq!(s1.pages_evicted, 3);
                // The hole reads zeros behind the zero page, and faults without it.
                let hole = ptr + 3 * page;
                if zero_page {
                    assert!(read_bytes(&rig.backend, hole, page).iter().all(|&x| x == 0));
                    let e = rig
                        .backend
                        .write(hole, &[1])
                        .expect_err("zero page is read-only");
                    assert!(matches!(e, Error::IllegalAccess { .. }), "{e}");
                } else {
                    let mut one = [0u8; 1];
                    rig.backend
                        .read(hole, &mut one)
                        .expect_err("a hole is unmapped");
                }
                // Runs with a hole, past the extent or empty are refused and change nothing.
                for bad in [1..3, 7..9, 5..5] {
                    let e = space.evict_pages(a, bad.clone()).expect_err("bad evict");
                    assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
                }
                for bad in [1..3, 4..6, 3..3] {
                    let e = space
                        .restore_pages(a, bad.clone())
                        .expect_err("bad restore");
                    assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
                }
                assert_eq!(space.evicted_pages(a).unwrap(), vec![2, 3, 4]);
                ok(&space);
                // The other slot and the resident pages of this one are untouched.
                check_tokens(&space, &rig.backend, b, 5);
                let bpt = space.config().bytes_per_token;
                let head = read_bytes(
                    &rig.backend,
                    space.slot_ptr(a, 0, Kind::K).unwrap(),
                    2 * page,
                );
                assert_eq!(first_mismatch(&head, seed_of(a, 0, Kind::K), 0), None);
                let tail_from = 5 * page;
                let tail = read_bytes(&rig.backend, ptr + tail_from, 20 * bpt - tail_from);
                assert_eq!(
                    first_mismatch(&tail, seed_of(a, 1, Kind::V), tail_from),
                    None
                );

                let set_access = space.stats().set_access_calls;
                space.restore_pages(a, 2..5).unwrap();
                assert_eq!(
                    space.stats().set_access_calls - set_access,
                    space.tensor_count() as u64,
                    "one set_access per tensor over the run"
                );
                assert_eq!(space.slot_ptr(a, 1, Kind::V).unwrap(), ptr, "same VA");
                for (p, bytes) in (2..5).zip(&saved) {
                    load_page(&space, &rig.backend, a, p, bytes);
                }
                check_tokens(&space, &rig.backend, a, 20);
                assert_eq!(space.evicted_pages(a).unwrap(), Vec::<usize>::new());
                assert_eq!(rig.pool.stats().in_use, in_use);
                assert_eq!(space.stats().pages_evicted, 0);
                ok(&space);

                // Free truncates a slot with holes to its first hole.
                space.evict_page(a, 6).unwrap();
                space.evict_page(a, 3).unwrap();
                space.free(a).unwrap();
                ok(&space);
                assert_eq!(rig.pool.stats().in_use, (3 + 2) * 4);
                assert_eq!(space.stats().slots_deferred, 1);
                // Shrink forgets the holes it cuts off.
                space.evict_page(b, 1).unwrap();
                space.shrink(b, 2).unwrap(); // 1 page
                assert_eq!(space.evicted_pages(b).unwrap(), Vec::<usize>::new());
                check_tokens(&space, &rig.backend, b, 2);
                ok(&space);
            }
            let now = rig.backend.live_counts();
            assert_eq!(
                (now.mappings, now.reservations),
                (baseline.mappings, baseline.reservations)
            );
            assert_eq!(rig.pool.stats().in_use, 0);
        }
    }
}

/// Copies `descs` between `host` and the tensors of `space` and waits for them.
fn copy_between(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    stream: &Stream,
    host: &HostBuffer,
    descs: &[CopyDesc],
) {
    let reservations: Vec<&Reservation> = (0..space.config().layers)
        .flat_map(|l| kinds().map(move |k| (l, k)))
        .map(|(l, k)| &**space.tensor_reservation(l, k))
        .collect();
    let scope = CopyScope {
        buffers: &[host],
        reservations: &reservations,
    };
    copy_async_in(backend, stream.handle(), CopyKind::Batch(descs), scope)
        .expect("copy")
        .synchronize()
        .expect("wait for the copy");
}

/// What a tier manager does: the bytes of pages 2..5 go down to host memory with backend
/// copies, the pages are evicted (and reused by another slot), restored at the same addresses and
/// the bytes copied back; the slot then reads exactly as before (strict host backend: nothing
/// here touches device memory through the CPU).
#[test]
fn spill_and_restore_through_backend_copies_keep_every_byte() {
    for granularity in [HOST_SMALL_PAGE, HOST_GPU_PAGE] {
        let Some(rig) = host_rig(None, granularity) else {
            return;
        };
        for zero_page in [false, true] {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page)).expect("space");
            let page = rig.page;
            let a = space.admit().unwrap();
            space.grow(a, 20).unwrap();
            write_tokens(&space, &rig.backend, a, 0, 20);
            let run = 2..5usize;
            let run_bytes = run.len() as u64 * page;
            let tensors: Vec<(u32, Kind)> = (0..space.config().layers)
                .flat_map(|l| kinds().map(|k| (l, k)))
                .collect();
            let host = HostBuffer::new(&rig.backend, run_bytes * tensors.len() as u64)
                .expect("host buffer");
            let ptrs: Vec<DevicePtr> = tensors
                .iter()
                .map(|&(l, k)| space.slot_ptr(a, l, k).unwrap() + run.start as u64 * page)
                .collect();
            let stream = Stream::new(&rig.backend, 0).expect("stream");
            let down: Vec<CopyDesc> = ptrs
                .iter()
                .enumerate()
                .map(|(t, &va)| CopyDesc {
                    dst: host.ptr() + t as u64 * run_bytes,
                    src: va,
                    len: run_bytes,
                })
                .collect();
            copy_between(&space, &rig.backend, &stream, &host, &down);
            space.evict_pages(a, run.clone()).unwrap();
            // Another request takes the freed pool pages and writes its own bytes into them.
            let b = space.admit().unwrap();
            space.grow(b, 8).unwrap();
            write_tokens(&space, &rig.backend, b, 0, 8);
            let in_use = rig.pool.stats().in_use;
            space.restore_pages(a, run.clone()).unwrap();
            assert_eq!(rig.pool.stats().in_use, in_use + 3 * 4, "fresh pages");
            let up: Vec<CopyDesc> = down
                .iter()
                .map(|d| CopyDesc {
                    dst: d.src,
                    src: d.dst,
                    len: d.len,
                })
                .collect();
            copy_between(&space, &rig.backend, &stream, &host, &up);
            for (&(l, k), &va) in tensors.iter().zip(&ptrs) {
                assert_eq!(
                    space.slot_ptr(a, l, k).unwrap() + run.start as u64 * page,
                    va,
                    "same VA"
                );
            }
            check_tokens(&space, &rig.backend, a, 20);
            check_tokens(&space, &rig.backend, b, 8);
            ok(&space);
        }
    }
}

#[test]
fn restore_out_of_memory_leaves_the_hole() {
    let (rig, _) = fake_rig(Some(12));
    let mut space = KvSpace::new(Arc::clone(&rig.pool), config(rig.page, true)).expect("space");
    let a = space.admit().unwrap();
    let b = space.admit().unwrap();
    space.grow(a, 6).unwrap(); // 3 pages × 4 tensors = the whole limit
    space.evict_page(a, 1).unwrap();
    space.grow(b, 1).unwrap(); // takes the 4 freed pages
    let e = space.restore_page(a, 1).expect_err("pool is full");
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(space.evicted_pages(a).unwrap(), vec![1]);
    ok(&space);
    space.shrink(b, 0).unwrap();
    space
        .restore_page(a, 1)
        .expect("restore after room was made");
    ok(&space);
}
