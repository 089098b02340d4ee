//! The CUDA backend against a real driver. GPU-only: every test is `#[ignore]`d so it shows as
//! skipped where there is no GPU; on a GPU machine run
//! `cargo test -p strata-vmm --test cuda_backend -- --include-ignored`. A test run that way
//! without a device still returns early with "skipped: no CUDA device".

use std::os::fd::AsFd;
use std::sync::Arc;

use strata_vmm::{
    round_up, Access, Backend, CopyDesc, CreateFlags, CudaBackend, Error, Location, PhysHandle,
    StreamHandle,
};

const D0: Location = Location::Device(0);

fn backend() -> Option<Arc<dyn Backend>> {
    match CudaBackend::new() {
        Ok(b) => Some(Arc::new(b)),
        Err(Error::NoDriver(why)) => {
            println!("skipped: no CUDA device ({why})");
            None
        }
        Err(Error::NoDevice(d)) => {
            println!("skipped: no CUDA device ({d})");
            None
        }
        Err(other) => panic!("CudaBackend::new failed unexpectedly: {other}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Reserve `units` granules, create one handle of that size, map it RW for device 0.
fn mapped(b: &Arc<dyn Backend>, units: u64) -> (u64, u64, PhysHandle) {
    let g = b.granularity(D0).unwrap();
    let size = units * g;
    let va = b.reserve(size, 0).unwrap();
    let h = b.create(D0, size, CreateFlags::empty()).unwrap();
    b.map(va, size, h, 0).unwrap();
    b.set_access(va, size, &[(D0, Access::ReadWrite)]).unwrap();
    (va, size, h)
}

fn teardown(b: &Arc<dyn Backend>, va: u64, size: u64, h: PhysHandle) {
    b.unmap(va, size).unwrap();
    b.release(h).unwrap();
    b.free_va(va, size).unwrap();
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn device_info_is_sane() {
    let Some(b) = backend() else { return };
    assert!(b.device_count() >= 1);
    let info = b.device_info(0).unwrap();
    let g = b.granularity(D0).unwrap();
    assert_eq!(info.granularity, g);
    assert!(g.is_power_of_two(), "granularity {g:#x}");
    assert!(info.total_memory > g);
    let mem = b.mem_info(0).unwrap();
    assert!(mem.free <= mem.total && mem.total > 0);
    assert!(matches!(
        b.device_info(b.device_count()),
        Err(Error::NoDevice(_))
    ));
    println!(
        "device 0: {} {} bytes, granularity {g:#x}",
        info.name, info.total_memory
    );
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn reserve_create_map_access_copy_round_trip() {
    let Some(b) = backend() else { return };
    let before = b.live_counts();
    let (va, size, h) = mapped(&b, 2);

    // Default stream write/read across the boundary between the two granules.
    let g = size / 2;
    let data = pattern(4096, 7);
    b.write(va + g - 1000, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    b.read(va + g - 1000, &mut back).unwrap();
    assert_eq!(back, data);

    // A stream, adjacent descriptors (coalesced), a device-to-device copy, memset, events.
    let s = b.stream_create(0).unwrap();
    let src = pattern(3 * 1024, 42);
    let copies = [
        CopyDesc {
            dst: va,
            src: src.as_ptr() as u64,
            len: 1024,
        },
        CopyDesc {
            dst: va + 1024,
            src: src.as_ptr() as u64 + 1024,
            len: 1024,
        },
        CopyDesc {
            dst: va + 2048,
            src: src.as_ptr() as u64 + 2048,
            len: 1024,
        },
    ];
    // SAFETY: `src` outlives the copy (the stream is synchronized below) and is not written.
    unsafe { b.copy_async(s, &copies).unwrap() };
    // Two non-adjacent host-to-device descriptors: a batch from pageable host memory where the
    // driver has cuMemcpyBatchAsync.
    let scattered = [
        CopyDesc {
            dst: va + 3 * 4096,
            src: src.as_ptr() as u64,
            len: 100,
        },
        CopyDesc {
            dst: va + 5 * 4096,
            src: src.as_ptr() as u64 + 200,
            len: 100,
        },
    ];
    // SAFETY: as above.
    unsafe { b.copy_async(s, &scattered).unwrap() };
    // Non-adjacent device-to-device copies (batch path where the driver has it).
    let d2d = [
        CopyDesc {
            dst: va + g,
            src: va,
            len: 512,
        },
        CopyDesc {
            dst: va + g + 4096,
            src: va + 2048,
            len: 1024,
        },
    ];
    // SAFETY: device ranges only, validated by the backend.
    unsafe { b.copy_async(s, &d2d).unwrap() };
    b.memset_async(s, va + g + 8192, 0xAB, 100).unwrap();
    let e = b.event_create().unwrap();
    b.event_record(e, s).unwrap();
    b.event_synchronize(e).unwrap();
    assert!(b.event_query(e).unwrap());
    b.stream_synchronize(s).unwrap();

    let mut got = vec![0u8; src.len()];
    b.read(va, &mut got).unwrap();
    assert_eq!(got, src);
    let mut got = vec![0u8; 100];
    b.read(va + 3 * 4096, &mut got).unwrap();
    assert_eq!(got, src[..100]);
    b.read(va + 5 * 4096, &mut got).unwrap();
    assert_eq!(got, src[200..300]);
    let mut got = vec![0u8; 512];
    b.read(va + g, &mut got).unwrap();
    assert_eq!(got, src[..512]);
    let mut got = vec![0u8; 1024];
    b.read(va + g + 4096, &mut got).unwrap();
    assert_eq!(got, src[2048..3072]);
    let mut got = vec![0u8; 100];
    b.read(va + g + 8192, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0xAB));

    // Cross-stream ordering through an event.
    let s2 = b.stream_create(0).unwrap();
    b.memset_async(s, va, 0x11, 64).unwrap();
    b.event_record(e, s).unwrap();
    b.stream_wait_event(s2, e).unwrap();
    b.memset_async(s2, va, 0x22, 32).unwrap();
    b.stream_synchronize(s2).unwrap();
    let mut got = vec![0u8; 64];
    b.read(va, &mut got).unwrap();
    assert!(got[..32].iter().all(|&x| x == 0x22));
    assert!(got[32..].iter().all(|&x| x == 0x11));

    b.event_destroy(e).unwrap();
    b.stream_destroy(s2).unwrap();
    b.stream_destroy(s).unwrap();
    teardown(&b, va, size, h);
    assert_eq!(b.live_counts(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn two_vas_one_handle_share_bytes() {
    let Some(b) = backend() else { return };
    let g = b.granularity(D0).unwrap();
    let h = b.create(D0, g, CreateFlags::empty()).unwrap();
    let a = b.reserve(g, 0).unwrap();
    let c = b.reserve(g, 0).unwrap();
    b.map(a, g, h, 0).unwrap();
    b.map(c, g, h, 0).unwrap();
    b.set_access(a, g, &[(D0, Access::ReadWrite)]).unwrap();
    b.set_access(c, g, &[(D0, Access::Read)]).unwrap();
    let data = pattern(8192, 3);
    b.write(a + 100, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    b.read(c + 100, &mut back).unwrap();
    assert_eq!(back, data);
    // Read-only view refuses writes.
    assert!(matches!(
        b.write(c, &[1, 2, 3]),
        Err(Error::IllegalAccess { .. })
    ));
    // Release first: mappings keep the memory alive (precondition 6).
    b.release(h).unwrap();
    b.read(c + 100, &mut back).unwrap();
    assert_eq!(back, data);
    b.unmap(a, g).unwrap();
    b.unmap(c, g).unwrap();
    b.free_va(a, g).unwrap();
    b.free_va(c, g).unwrap();
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn map_at_nonzero_offset_is_refused() {
    let Some(b) = backend() else { return };
    let g = b.granularity(D0).unwrap();
    let before = b.live_counts();
    let h = b.create(D0, 2 * g, CreateFlags::empty()).unwrap();
    let va = b.reserve(2 * g, 0).unwrap();
    // The driver maps handles from offset 0 only (an H200 answered CUDA_ERROR_NOT_SUPPORTED):
    // the backend refuses first, with the host backend's typed error.
    assert!(matches!(b.map(va, g, h, g), Err(Error::Unsupported(_))));
    // A prefix of the handle is fine.
    b.map(va, g, h, 0).unwrap();
    b.unmap(va, g).unwrap();
    b.release(h).unwrap();
    b.free_va(va, 2 * g).unwrap();
    assert_eq!(b.live_counts(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn error_rules_are_typed() {
    let Some(b) = backend() else { return };
    let g = b.granularity(D0).unwrap();
    let before = b.live_counts();

    assert!(matches!(b.reserve(0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.reserve(g + 1, 0), Err(Error::Misaligned { .. })));
    assert!(matches!(
        b.create(D0, 0, CreateFlags::empty()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.create(D0, g / 2, CreateFlags::empty()),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        b.create(Location::Device(b.device_count()), g, CreateFlags::empty()),
        Err(Error::NoDevice(_))
    ));

    let va = b.reserve(4 * g, 0).unwrap();
    let h = b.create(D0, 2 * g, CreateFlags::empty()).unwrap();
    assert!(matches!(
        b.map(va + 1, g, h, 0),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        b.map(va, 3 * g, h, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.map(va + 3 * g, 2 * g, h, 0),
        Err(Error::NotReserved { .. })
    ));
    assert!(matches!(
        b.map(va, g, PhysHandle(0xdead), 0),
        Err(Error::InvalidHandle { .. })
    ));
    b.map(va, 2 * g, h, 0).unwrap();
    assert!(matches!(
        b.map(va + g, g, h, 0),
        Err(Error::AlreadyMapped { .. })
    ));

    // Fresh mapping: no access.
    assert!(matches!(
        b.write(va, &[1]),
        Err(Error::IllegalAccess { .. })
    ));
    assert!(matches!(
        b.set_access(va, 4 * g, &[(D0, Access::ReadWrite)]),
        Err(Error::NotMapped { .. })
    ));
    b.set_access(va, 2 * g, &[(D0, Access::ReadWrite)]).unwrap();
    b.write(va, &[1, 2, 3]).unwrap();
    // Reserved but unmapped, and crossing into it.
    let mut buf = [0u8; 16];
    assert!(matches!(
        b.read(va + 2 * g, &mut buf),
        Err(Error::IllegalAccess { .. })
    ));
    assert!(matches!(
        b.read(va + 2 * g - 8, &mut buf),
        Err(Error::IllegalAccess { .. })
    ));
    assert!(matches!(
        b.memset_async(StreamHandle::DEFAULT, va + 3 * g, 0, 8),
        Err(Error::IllegalAccess { .. })
    ));

    assert!(matches!(b.unmap(va, g), Err(Error::PartialUnmap { .. })));
    assert!(matches!(b.unmap(va, 4 * g), Err(Error::NotMapped { .. })));
    assert!(matches!(
        b.unmap(va + 2 * g, g),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        b.free_va(va, 4 * g),
        Err(Error::StillMapped { .. })
    ));
    assert!(matches!(
        b.free_va(va + g, 3 * g),
        Err(Error::NotReserved { .. })
    ));

    // After unmap, a new mapping at the same VA starts with no access.
    b.unmap(va, 2 * g).unwrap();
    b.map(va, 2 * g, h, 0).unwrap();
    assert!(matches!(
        b.write(va, &[1]),
        Err(Error::IllegalAccess { .. })
    ));
    b.unmap(va, 2 * g).unwrap();

    assert!(matches!(b.export_fd(h), Err(Error::InvalidArgument(_))));
    b.release(h).unwrap();
    assert!(matches!(b.release(h), Err(Error::InvalidHandle { .. })));
    assert!(matches!(
        b.stream_synchronize(StreamHandle(0x1234)),
        Err(Error::InvalidHandle { .. })
    ));
    b.free_va(va, 4 * g).unwrap();
    assert_eq!(b.live_counts(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn absurd_create_is_out_of_memory() {
    let Some(b) = backend() else { return };
    let g = b.granularity(D0).unwrap();
    let before = b.live_counts();
    let absurd = round_up(1 << 50, g).unwrap();
    match b.create(D0, absurd, CreateFlags::empty()) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, absurd),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Within the device's total but beyond its free memory: the driver's own OOM path.
    let total = b.device_info(0).unwrap().total_memory;
    let size = total / g * g;
    match b.create(D0, size, CreateFlags::empty()) {
        Err(e) => {
            assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
            println!("driver OOM: {e}");
        }
        Ok(h) => {
            b.release(h).unwrap();
            panic!("created the whole device memory ({size} bytes)?");
        }
    }
    assert_eq!(b.live_counts(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn export_import_shares_memory() {
    let Some(b) = backend() else { return };
    let g = b.granularity(D0).unwrap();
    let h = b.create(D0, 2 * g, CreateFlags::EXPORTABLE).unwrap();
    let fd = b.export_fd(h).unwrap();
    let a = b.reserve(2 * g, 0).unwrap();
    let c = b.reserve(2 * g, 0).unwrap();
    b.map(a, 2 * g, h, 0).unwrap();
    // Some drivers cannot map an imported handle (an H200 virtual machine, driver 580.159:
    // CUDA_ERROR_NOT_SUPPORTED): the import's size probe or the map says so, typed.
    let mapped = b.import_fd(fd.as_fd()).and_then(|imported| {
        assert_eq!(b.handle_size(imported)?, 2 * g);
        match b.map(c, 2 * g, imported, 0) {
            Ok(()) => Ok(imported),
            Err(e) => {
                b.release(imported)?;
                Err(e)
            }
        }
    });
    let imported = match mapped {
        Ok(imported) => imported,
        Err(Error::Unsupported(words)) => {
            b.unmap(a, 2 * g).unwrap();
            b.release(h).unwrap();
            b.free_va(a, 2 * g).unwrap();
            b.free_va(c, 2 * g).unwrap();
            return strata_test_support::skip(
                "export_import_shares_memory",
                &format!("this driver cannot map imported handles: {words}"),
            );
        }
        Err(e) => panic!("{e}"),
    };
    b.set_access(a, 2 * g, &[(D0, Access::ReadWrite)]).unwrap();
    b.set_access(c, 2 * g, &[(D0, Access::ReadWrite)]).unwrap();
    let data = pattern(1000, 5);
    b.write(a + g + 10, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    b.read(c + g + 10, &mut back).unwrap();
    assert_eq!(back, data);
    b.unmap(a, 2 * g).unwrap();
    b.unmap(c, 2 * g).unwrap();
    b.release(imported).unwrap();
    b.release(h).unwrap();
    b.free_va(a, 2 * g).unwrap();
    b.free_va(c, 2 * g).unwrap();
    drop(fd);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn host_numa_memory_when_supported() {
    let Some(b) = backend() else { return };
    let g = match b.granularity(Location::Host) {
        Ok(g) => g,
        Err(Error::Unsupported(why)) => {
            println!("skipped: host VMM memory unsupported ({why})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let h = match b.create(Location::Host, g, CreateFlags::empty()) {
        Ok(h) => h,
        Err(Error::Unsupported(why)) => {
            println!("skipped: host VMM memory unsupported ({why})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let va = b
        .reserve(round_up(g, b.granularity(D0).unwrap()).unwrap(), 0)
        .unwrap();
    b.map(va, g, h, 0).unwrap();
    b.set_access(va, g, &[(D0, Access::ReadWrite)]).unwrap();
    let data = pattern(4096, 1);
    b.write(va, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    b.read(va, &mut back).unwrap();
    assert_eq!(back, data);
    b.unmap(va, g).unwrap();
    b.release(h).unwrap();
    b.free_va(va, round_up(g, b.granularity(D0).unwrap()).unwrap())
        .unwrap();
}

/// Queues one block-copy launch; `None` (after saying why) where this machine has a driver but
/// no NVRTC, the one reason the kernel may be unsupported on a GPU.
fn launch_blocks(
    b: &Arc<dyn Backend>,
    stream: StreamHandle,
    len: u64,
    pairs: &[(u64, u64)],
) -> Option<()> {
    let work = strata_vmm::device_work(b).expect("CUDA has device work");
    // SAFETY: the tests pass device ranges, or host memory they keep alive and untouched until
    // they synchronize the stream.
    match unsafe { work.copy_blocks_async(stream, len, pairs) } {
        Ok(()) => Some(()),
        Err(Error::Unsupported(why)) if strata_vmm::cuda::nvrtc::check_present().is_err() => {
            println!("skipped: block-copy kernel unavailable ({why})");
            None
        }
        Err(other) => panic!("block-copy launch failed: {other}"),
    }
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn block_copy_kernel_gathers_and_scatters() {
    let Some(b) = backend() else { return };
    let before = b.live_counts();
    let (va, size, h) = mapped(&b, 4);
    let half = size / 2;
    let s = b.stream_create(0).unwrap();
    // Aligned blocks (16-byte words) and odd-sized ones (the byte loop), 512 of each.
    for (len, count, seed) in [(4096u64, 512u64, 3u8), (100, 512, 9)] {
        let src = pattern((len * count) as usize, seed);
        b.write(va, &src).unwrap();
        // Scatter: block i to slot (count - 1 - i) * 2 of the other half (reversed, with gaps).
        let stride = round_up(len, 16).unwrap() * 2;
        let scatter: Vec<(u64, u64)> = (0..count)
            .map(|i| (va + i * len, va + half + (count - 1 - i) * stride))
            .collect();
        if launch_blocks(&b, s, len, &scatter).is_none() {
            break;
        }
        b.stream_synchronize(s).unwrap();
        for i in [0, 1, count / 2, count - 1] {
            let mut got = vec![0u8; len as usize];
            b.read(va + half + (count - 1 - i) * stride, &mut got)
                .unwrap();
            assert_eq!(
                got,
                src[(i * len) as usize..((i + 1) * len) as usize],
                "block {i}"
            );
        }
        // Gather them back, contiguous, after a clear of the first half.
        b.memset_async(s, va, 0, half).unwrap();
        let gather: Vec<(u64, u64)> = scatter.iter().map(|&(a, d)| (d, a)).collect();
        launch_blocks(&b, s, len, &gather).unwrap();
        b.stream_synchronize(s).unwrap();
        let mut got = vec![0u8; src.len()];
        b.read(va, &mut got).unwrap();
        assert_eq!(got, src, "gather of {count} × {len} bytes");
    }

    // Pinned host memory as the source (the kernel reads it over the link) and pageable host
    // memory as the destination (the backend falls back to DMA for it): same bytes either way.
    let len = 256u64;
    let count = 64u64;
    let pinned = b.host_alloc(len * count).unwrap();
    let data = pattern((len * count) as usize, 77);
    // SAFETY: `pinned` is a fresh host allocation of `len * count` bytes; nothing else uses it.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), pinned as *mut u8, data.len()) };
    let to_device: Vec<(u64, u64)> = (0..count)
        .map(|i| (pinned + i * len, va + (count - 1 - i) * len))
        .collect();
    if launch_blocks(&b, s, len, &to_device).is_some() {
        let mut pageable = vec![0u8; data.len()];
        let to_host: Vec<(u64, u64)> = (0..count)
            .map(|i| {
                (
                    va + (count - 1 - i) * len,
                    pageable.as_mut_ptr() as u64 + i * len,
                )
            })
            .collect();
        launch_blocks(&b, s, len, &to_host).unwrap();
        b.stream_synchronize(s).unwrap();
        assert_eq!(pageable, data);
    }
    b.stream_synchronize(s).unwrap();
    // SAFETY: from `host_alloc` above; the stream that used it is synchronized.
    unsafe { b.host_free(pinned, len * count).unwrap() };

    b.stream_destroy(s).unwrap();
    teardown(&b, va, size, h);
    assert_eq!(b.live_counts(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn block_copy_kernel_handles_more_pairs_than_one_grid_chunk() {
    let Some(b) = backend() else { return };
    let before = b.live_counts();
    // 3 × 65535 + 8 pairs of 16 bytes: several staging chunks (one granule stages
    // granularity / 16 pairs), and more than a 65535-block grid.
    let count = 3 * 65535 + 8u64;
    let len = 16u64;
    let g = b.granularity(D0).unwrap();
    let units = (2 * count * len).div_ceil(g) + 1;
    let (va, size, h) = mapped(&b, units);
    let dst_base = round_up(count * len, g).unwrap();
    let src = pattern((count * len) as usize, 5);
    b.write(va, &src).unwrap();
    // Reversed order on the default stream.
    let pairs: Vec<(u64, u64)> = (0..count)
        .map(|i| (va + i * len, va + dst_base + (count - 1 - i) * len))
        .collect();
    if launch_blocks(&b, StreamHandle::DEFAULT, len, &pairs).is_some() {
        b.stream_synchronize(StreamHandle::DEFAULT).unwrap();
        let mut got = vec![0u8; src.len()];
        b.read(va + dst_base, &mut got).unwrap();
        for i in 0..count as usize {
            let j = count as usize - 1 - i;
            assert_eq!(
                got[j * 16..(j + 1) * 16],
                src[i * 16..(i + 1) * 16],
                "pair {i}"
            );
        }
    }
    teardown(&b, va, size, h);
    assert_eq!(b.live_counts(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn block_copy_kernel_rejects_what_the_host_twin_rejects() {
    let Some(b) = backend() else { return };
    let (va, size, h) = mapped(&b, 2);
    let g = size / 2;
    let s = b.stream_create(0).unwrap();
    let work = strata_vmm::device_work(&b).expect("CUDA has device work");
    let launch = |len: u64, pairs: &[(u64, u64)]| {
        // SAFETY: device ranges only; every call here is refused before anything is queued.
        unsafe { work.copy_blocks_async(s, len, pairs) }
    };
    // Overlapping destinations, and a destination over a source.
    let err = launch(4096, &[(va, va + g), (va + 4096, va + g + 2048)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = launch(4096, &[(va, va + 2048)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // The same memory through a second VA of the same handle is an overlap too.
    let va2 = b.reserve(size, 0).unwrap();
    b.map(va2, size, h, 0).unwrap();
    b.set_access(va2, size, &[(D0, Access::ReadWrite)]).unwrap();
    let err = launch(4096, &[(va, va2 + 1024)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // A destination in a reservation with nothing mapped, arithmetic that overflows.
    let empty = b.reserve(g, 0).unwrap();
    let err = launch(64, &[(va, empty)]).unwrap_err();
    assert!(matches!(err, Error::IllegalAccess { .. }), "{err}");
    b.free_va(empty, g).unwrap();
    let err = launch(64, &[(u64::MAX - 8, va)]).unwrap_err();
    assert!(matches!(err, Error::Overflow(_)), "{err}");
    b.stream_synchronize(s).unwrap();
    b.unmap(va2, size).unwrap();
    b.free_va(va2, size).unwrap();
    b.stream_destroy(s).unwrap();
    teardown(&b, va, size, h);
}
