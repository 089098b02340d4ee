use super::*;

/// The 12.8 signature of `cuMemcpyBatchAsync` (the unversioned symbol keeps it in 13.x
/// drivers; 13.0 headers call `cuMemcpyBatchAsync_v2`, which drops `failIdx`).
pub type BatchFn = unsafe extern "C" fn(
    *mut CUdeviceptr,
    *mut CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    CUstream,
) -> CUresult;

/// Looks `cuMemcpyBatchAsync` up without panicking: `None` when the library or the symbol is
/// missing or the driver is older than 12.8.
pub fn batch_fn() -> Option<BatchFn> {
    if !driver_present() || driver_version().ok()? < 12080 {
        return None;
    }
    catch_unwind(|| {
        // SAFETY: `culib` returns the library `driver_present` found; the symbol, when
        // present in a ≥ 12.8 driver, has exactly the `BatchFn` signature (CUDA 12.8
        // `cuda.h`). The function pointer is copied out; the library is never unloaded
        // (cudarc keeps it in a static).
        unsafe {
            sys::culib()
                .get::<BatchFn>(b"cuMemcpyBatchAsync\0")
                .ok()
                .map(|sym| *sym)
        }
    })
    .ok()
    .flatten()
}

/// Queues a copy of `len` bytes from `src` to `dst` (unified addressing: host or device).
///
/// # Safety
///
/// 1. `src..src+len` is readable and `dst..dst+len` writable (host memory valid, device VA
///    mapped with access for the stream's device) until the copy completes.
/// 2. No one else touches the destination until then.
/// 3. `stream` is null or live, with its context current.
pub unsafe fn copy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: u64,
    stream: CUstream,
) -> Result<()> {
    let len = to_usize(len, "copy length")?;
    // SAFETY: the caller guarantees both ranges and the stream.
    call("cuMemcpyAsync", || unsafe {
        sys::cuMemcpyAsync(dst, src, len, stream)
    })
}

/// Queues `dsts.len()` copies as one batch with stream-ordered source access.
///
/// # Safety
///
/// 1. `dsts`, `srcs`, `lens` have the same non-zero length; every range satisfies the
///    conditions of [`copy_async`].
/// 2. `stream` is a live, non-null stream (the batch API refuses the legacy stream), with
///    its context current.
/// 3. `f` is the `cuMemcpyBatchAsync` symbol of the loaded driver ([`batch_fn`]).
pub unsafe fn batch_async(
    f: BatchFn,
    dsts: &mut [CUdeviceptr],
    srcs: &mut [CUdeviceptr],
    lens: &mut [usize],
    stream: CUstream,
) -> Result<()> {
    let count = dsts.len();
    if count == 0 || srcs.len() != count || lens.len() != count {
        return Err(Error::InvalidArgument(
            "batch copy: descriptor arrays differ in length or are empty".into(),
        ));
    }
    let zero = phys::location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, 0);
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: zero,
        dstLocHint: zero,
        flags: 0,
    };
    let mut attr_idx: usize = 0;
    let mut fail_idx: usize = usize::MAX;
    // SAFETY: the three arrays hold `count` elements each and outlive the call; one
    // attribute applies from index 0 to all copies; `fail_idx` is a valid out-pointer; the
    // caller guarantees the ranges, the stream and that `f` is the real symbol.
    call("cuMemcpyBatchAsync", || unsafe {
        f(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            lens.as_mut_ptr(),
            count,
            &mut attrs,
            &mut attr_idx,
            1,
            &mut fail_idx,
            stream,
        )
    })
}

/// Queues a fill of `len` bytes at device VA `dst` with `value`.
///
/// # Safety
///
/// 1. `dst..dst+len` is device VA mapped with write access for the stream's device, not
///    used by anyone else until the fill completes.
/// 2. `stream` is null or live, with its context current.
pub unsafe fn memset_d8_async(
    dst: CUdeviceptr,
    value: u8,
    len: u64,
    stream: CUstream,
) -> Result<()> {
    let len = to_usize(len, "memset length")?;
    // SAFETY: the caller guarantees the range and the stream.
    call("cuMemsetD8Async", || unsafe {
        sys::cuMemsetD8Async(dst, value, len, stream)
    })
}
