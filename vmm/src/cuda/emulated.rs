//! `CudaBackend` over the emulated driver (`tests/cuda-emu`, built by these tests): what the
//! shared suites do not reach — two devices, worker threads without a current context, host
//! VMM memory, the paths that are not emulated (kernels, cuBLAS) — and one regression test per
//! bug the emulator found in `cuda/`.
//!
//! Every test re-runs itself in a child with the emulator on `LD_LIBRARY_PATH` (`child.rs`).

use std::sync::Arc;

use super::CudaBackend;
use crate::backend::Backend;
use crate::error::Error;
use crate::types::{Access, CopyDesc, CreateFlags, Location, PhysHandle, StreamHandle};

/// The emulator's folder (`libcuda.so.1` and `libcuda.so`), then NVIDIA's real NVRTC when
/// `.ci/cuda-libs` installed it (so the block-copy kernel compiles and only the module load is
/// refused). `Err(reason)` where the emulator is not built (a GPU machine's bundle).
fn library_path() -> Result<std::ffi::OsString, String> {
    let mut path = strata_test_support::cuda_emulator("cuda-emu-vmm-tests")?.into_os_string();
    if let Some(libs) = strata_test_support::cuda_libs() {
        if libs.join("libnvrtc.so.12").exists() {
            path.push(":");
            path.push(libs);
        }
    }
    Ok(path)
}

/// True in the child; in the parent, runs `test` in a child over the emulator and returns false.
fn in_child(test: &str) -> bool {
    in_child_with(test, &[])
}

/// As [`in_child`], with `extra` set in the child's environment.
fn in_child_with(test: &str, extra: &[(&str, &str)]) -> bool {
    if super::child::is_child() {
        return true;
    }
    let path = match library_path() {
        Ok(path) => path,
        Err(reason) => {
            strata_test_support::skip(test, &reason);
            return false;
        }
    };
    let mut env = vec![("STRATA_CUDA_EMU_DEVICES", "2x1GiB")];
    env.extend_from_slice(extra);
    super::child::rerun(module_path!(), test, &path, &env);
    false
}

/// The backend over the emulated driver; fails loudly if another driver answered.
fn open() -> Arc<dyn Backend> {
    let b: Arc<dyn Backend> = Arc::new(CudaBackend::new().expect("the emulated driver opens"));
    let name = b.device_info(0).expect("device 0").name;
    assert!(
        name.starts_with("strata emulated device"),
        "the child loaded another CUDA driver ({name}), not the emulator"
    );
    assert_eq!(b.device_count(), 2);
    b
}

/// Reserves, creates at `loc`, maps and grants `grants` over `size` bytes.
fn mapped(
    b: &Arc<dyn Backend>,
    loc: Location,
    size: u64,
    grants: &[(Location, Access)],
) -> (u64, PhysHandle) {
    let va = b.reserve(size, 0).unwrap();
    let h = b.create(loc, size, CreateFlags::empty()).unwrap();
    b.map(va, size, h, 0).unwrap();
    if !grants.is_empty() {
        b.set_access(va, size, grants).unwrap();
    }
    (va, h)
}

fn teardown(b: &Arc<dyn Backend>, va: u64, size: u64, h: PhysHandle) {
    b.unmap(va, size).unwrap();
    b.release(h).unwrap();
    b.free_va(va, size).unwrap();
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

#[test]
fn emulated_two_devices_share_memory_through_grants_and_streams() {
    if !in_child("emulated_two_devices_share_memory_through_grants_and_streams") {
        return;
    }
    let b = open();
    let before = b.live_counts();
    let d1 = Location::Device(1);
    let g = b.granularity(d1).unwrap();
    // Device 0 has no access yet: its stream may not touch the memory.
    let (va, h) = mapped(&b, d1, 2 * g, &[(d1, Access::ReadWrite)]);
    let s0 = b.stream_create(0).unwrap();
    let s1 = b.stream_create(1).unwrap();
    let src = pattern(4096, 5);
    let copy = [CopyDesc {
        dst: va,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
    }];
    // SAFETY: `src` outlives the copy (the stream is synchronized below or the copy refused).
    let refused = unsafe { b.copy_async(s0, &copy) };
    assert!(
        matches!(refused, Err(Error::IllegalAccess { .. })),
        "{refused:?}"
    );
    b.set_access(
        va,
        2 * g,
        &[
            (d1, Access::ReadWrite),
            (Location::Device(0), Access::ReadWrite),
        ],
    )
    .unwrap();
    // SAFETY: as above.
    unsafe { b.copy_async(s0, &copy).unwrap() };
    // Device 1's stream waits for device 0's copy through an event.
    let e = b.event_create().unwrap();
    b.event_record(e, s0).unwrap();
    b.stream_wait_event(s1, e).unwrap();
    b.memset_async(s1, va + g, 0xab, 4096).unwrap();
    b.stream_synchronize(s1).unwrap();
    b.stream_synchronize(s0).unwrap();
    assert!(b.event_query(e).unwrap());
    let mut got = vec![0u8; 4096];
    b.read(va, &mut got).unwrap();
    assert_eq!(got, src);
    b.read(va + g, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0xab));
    b.event_destroy(e).unwrap();
    b.stream_destroy(s0).unwrap();
    b.stream_destroy(s1).unwrap();
    teardown(&b, va, 2 * g, h);
    assert_eq!(b.live_counts(), before);
}

#[test]
fn emulated_calls_from_threads_without_a_current_context_work() {
    if !in_child("emulated_calls_from_threads_without_a_current_context_work") {
        return;
    }
    let b = open();
    let workers: Vec<_> = (0..4u32)
        .map(|i| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let d = i % 2;
                let loc = Location::Device(d);
                let g = b.granularity(loc).unwrap();
                assert!(b.mem_info(d).unwrap().free < b.mem_info(d).unwrap().total);
                let s = b.stream_create(d).unwrap();
                let e = b.event_create().unwrap();
                let (va, h) = mapped(&b, loc, g, &[(loc, Access::ReadWrite)]);
                let pinned = b.host_alloc(4096).unwrap();
                b.memset_async(s, va, i as u8 + 1, 4096).unwrap();
                let copy = [CopyDesc {
                    dst: pinned,
                    src: va,
                    len: 4096,
                }];
                // SAFETY: `pinned` is ours until freed after the synchronize below.
                unsafe { b.copy_async(s, &copy).unwrap() };
                b.event_record(e, s).unwrap();
                b.event_synchronize(e).unwrap();
                // SAFETY: the copy that wrote it completed (event synchronized).
                let got = unsafe { std::slice::from_raw_parts(pinned as *const u8, 4096) };
                assert!(got.iter().all(|&x| x == i as u8 + 1));
                // SAFETY: nothing uses it any more.
                unsafe { b.host_free(pinned, 4096).unwrap() };
                b.event_destroy(e).unwrap();
                b.stream_destroy(s).unwrap();
                teardown(&b, va, g, h);
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
}

#[test]
fn emulated_host_vmm_memory_maps_for_devices() {
    if !in_child("emulated_host_vmm_memory_maps_for_devices") {
        return;
    }
    let b = open();
    let g = b.granularity(Location::Host).unwrap();
    let (va, h) = mapped(
        &b,
        Location::Host,
        g,
        &[(Location::Device(0), Access::ReadWrite)],
    );
    let data = pattern(1000, 9);
    b.write(va + 100, &data).unwrap();
    let mut got = vec![0u8; 1000];
    b.read(va + 100, &mut got).unwrap();
    assert_eq!(got, data);
    teardown(&b, va, g, h);
}

#[test]
fn emulated_kernels_and_cublas_fall_back_with_unsupported() {
    if !in_child("emulated_kernels_and_cublas_fall_back_with_unsupported") {
        return;
    }
    let b = open();
    let d0 = Location::Device(0);
    let g = b.granularity(d0).unwrap();
    let (va, h) = mapped(&b, d0, g, &[(d0, Access::ReadWrite)]);
    let s = b.stream_create(0).unwrap();
    let pinned = b.host_alloc(4096).unwrap();
    let work = crate::device_work(&b).unwrap();
    // Pinned ↔ device pairs take the kernel; the emulator loads no module.
    let pairs = [(pinned, va), (pinned + 1024, va + 4096)];
    // SAFETY: both ranges are ours and stay valid; the call is refused before any copy.
    let got = unsafe { work.copy_blocks_async(s, 512, &pairs) };
    assert!(matches!(got, Err(Error::Unsupported(_))), "{got:?}");
    if super::nvrtc::check_present().is_ok() {
        // NVRTC compiled the kernel; the emulated driver refused to load it.
        let msg = got.unwrap_err().to_string();
        assert!(msg.contains("CUDA_ERROR_NOT_SUPPORTED"), "{msg}");
    }
    // Remembered: a second call is refused the same way, without another compile.
    // SAFETY: as above.
    let again = unsafe { work.copy_blocks_async(s, 512, &pairs) };
    assert!(matches!(again, Err(Error::Unsupported(_))), "{again:?}");
    let gemm = crate::GemmF32::packed(4, 4, 4, va, va + 64, va + 128);
    let got = work.gemm_f32_async(StreamHandle::DEFAULT, &gemm);
    assert!(matches!(got, Err(Error::Unsupported(_))), "{got:?}");
    b.stream_synchronize(s).unwrap();
    // SAFETY: nothing uses it.
    unsafe { b.host_free(pinned, 4096).unwrap() };
    b.stream_destroy(s).unwrap();
    teardown(&b, va, g, h);
}

#[test]
fn emulated_host_access_over_device_memory_is_refused_by_backend_and_driver() {
    if !in_child("emulated_host_access_over_device_memory_is_refused_by_backend_and_driver") {
        return;
    }
    let b = open();
    let d0 = Location::Device(0);
    let g = b.granularity(d0).unwrap();
    let (va, h) = mapped(&b, d0, g, &[]);
    // The backend refuses it up front, with the host backend's typed error ...
    let got = b.set_access(va, g, &[(Location::Host, Access::ReadWrite)]);
    assert!(matches!(got, Err(Error::InvalidArgument(_))), "{got:?}");
    // ... and the driver, asked directly, refuses it too (documented for cuMemSetAccess).
    let desc = super::result::CUmemAccessDesc {
        location: super::host_location(),
        flags: super::result::access::flags(Access::ReadWrite),
    };
    // SAFETY: the range is our own full mapping; nothing uses it.
    let raw = unsafe { super::result::access::set(va, g, &[desc]) };
    assert!(
        super::result::is_code(
            raw.as_ref().unwrap_err(),
            super::result::CUresult::CUDA_ERROR_INVALID_VALUE
        ),
        "{raw:?}"
    );
    teardown(&b, va, g, h);
}

#[test]
fn emulated_batch_copies_scatter_and_gather() {
    if !in_child("emulated_batch_copies_scatter_and_gather") {
        return;
    }
    let cuda = CudaBackend::new().expect("the emulated driver opens");
    // The emulator is a 12.8 driver exporting cuMemcpyBatchAsync: the batch path is taken.
    assert!(cuda.batch_copies());
    let b: Arc<dyn Backend> = Arc::new(cuda);
    let d0 = Location::Device(0);
    let g = b.granularity(d0).unwrap();
    let (va, h) = mapped(&b, d0, g, &[(d0, Access::ReadWrite)]);
    let s = b.stream_create(0).unwrap();
    let src = pattern(64 * 100, 3);
    // 64 blocks of 100 bytes, reversed and spaced: not adjacent, so one batch of 64 copies.
    let scatter: Vec<CopyDesc> = (0..64u64)
        .map(|i| CopyDesc {
            dst: va + (63 - i) * 256,
            src: src.as_ptr() as u64 + i * 100,
            len: 100,
        })
        .collect();
    // SAFETY: `src` outlives the copies (synchronized below).
    unsafe { b.copy_async(s, &scatter).unwrap() };
    let mut back = vec![0u8; src.len()];
    let gather: Vec<CopyDesc> = (0..64u64)
        .map(|i| CopyDesc {
            dst: back.as_mut_ptr() as u64 + i * 100,
            src: va + (63 - i) * 256,
            len: 100,
        })
        .collect();
    // SAFETY: `back` is exclusively ours until the stream is synchronized.
    unsafe { b.copy_async(s, &gather).unwrap() };
    b.stream_synchronize(s).unwrap();
    assert_eq!(back, src);
    b.stream_destroy(s).unwrap();
    teardown(&b, va, g, h);
}

#[test]
fn emulated_driver_refuses_a_map_at_a_nonzero_offset() {
    if !in_child("emulated_driver_refuses_a_map_at_a_nonzero_offset") {
        return;
    }
    let b = open();
    let g = b.granularity(Location::Device(0)).unwrap();
    let va = b.reserve(2 * g, 0).unwrap();
    let h = b
        .create(Location::Device(0), 2 * g, CreateFlags::empty())
        .unwrap();
    // The driver itself, as the H200's answered (CUDA_ERROR_NOT_SUPPORTED), ...
    // SAFETY: `va` is our own fresh reservation of 2 granules and `h` a live handle; the call
    // is refused before anything is mapped.
    let raw = unsafe { super::result::map::map(va, g, g, h.0) };
    assert!(
        raw.as_ref().is_err_and(|e| super::result::is_code(
            e,
            cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
        )),
        "{raw:?}"
    );
    // ... and the backend, before the driver sees it, with the same typed error as the host's.
    assert!(matches!(b.map(va, g, h, g), Err(Error::Unsupported(_))));
    b.map(va, 2 * g, h, 0).unwrap();
    teardown(&b, va, 2 * g, h);
}

#[test]
fn emulated_imported_handles_refused_in_the_refusal_mode() {
    let test = "emulated_imported_handles_refused_in_the_refusal_mode";
    if !in_child_with(test, &[("STRATA_CUDA_EMU_IMPORTED_MAPS", "refuse")]) {
        return;
    }
    let b = open();
    let d0 = Location::Device(0);
    let g = b.granularity(d0).unwrap();
    let h = b.create(d0, g, CreateFlags::EXPORTABLE).unwrap();
    let fd = b.export_fd(h).unwrap();
    // The import's size probe maps the handle: refused, in the driver's words.
    let refused = b.import_fd(std::os::fd::AsFd::as_fd(&fd));
    match &refused {
        Err(Error::Unsupported(words)) => assert!(
            words.contains("imported") && words.contains("CUDA_ERROR_NOT_SUPPORTED"),
            "{words}"
        ),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // The exporter's own handle still maps.
    let va = b.reserve(g, 0).unwrap();
    b.map(va, g, h, 0).unwrap();
    teardown(&b, va, g, h);
    assert_eq!(b.live_counts().handles, 0);
}

#[test]
fn emulated_driver_charges_the_latency_profile() {
    if !in_child_with(
        "emulated_driver_charges_the_latency_profile",
        &[("STRATA_HOST_LATENCY", "a100")],
    ) {
        return;
    }
    let b = open();
    let d0 = Location::Device(0);
    let g = b.granularity(d0).unwrap();
    let va = b.reserve(g, 0).unwrap();
    let median = |mut v: Vec<std::time::Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (mut create, mut map) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = std::time::Instant::now();
        let h = b.create(d0, g, CreateFlags::empty()).unwrap();
        create.push(t.elapsed());
        let t = std::time::Instant::now();
        b.map(va, g, h, 0).unwrap();
        map.push(t.elapsed());
        b.unmap(va, g).unwrap();
        b.release(h).unwrap();
    }
    let (create, map) = (median(create), median(map));
    // Orders only: kvcached's A100 create (193 µs) is a lower bound and far above a map.
    assert!(
        create >= std::time::Duration::from_micros(193),
        "{create:?}"
    );
    assert!(create > 2 * map, "create {create:?} vs map {map:?}");
    b.free_va(va, g).unwrap();
}

#[test]
fn emulated_malloc_async_frees_only_its_own_pointers() {
    if !in_child("emulated_malloc_async_frees_only_its_own_pointers") {
        return;
    }
    let b = open();
    let free_before = b.mem_info(0).unwrap().free;
    let mut pool = super::MallocAsync::new(&b, 0).unwrap();
    let small = pool.allocate(4096).unwrap();
    let large = pool.allocate(3 << 20).unwrap();
    assert!(small != 0 && large != 0 && small != large);
    pool.free(small).unwrap();
    assert!(matches!(pool.free(small), Err(Error::UnknownPointer(p)) if p == small));
    assert!(matches!(
        pool.free(large + 256),
        Err(Error::UnknownPointer(_))
    ));
    pool.synchronize().unwrap();
    let mut other = super::MallocAsync::new(&b, 1).unwrap();
    assert!(matches!(other.free(large), Err(Error::UnknownPointer(_))));
    drop(other);
    // Dropping it frees the live block and waits for its stream.
    drop(pool);
    let free_after = b.mem_info(0).unwrap().free;
    assert_eq!(
        free_after, free_before,
        "the dropped allocator gave its block back"
    );
}
