use super::*;

/// `(free, total)` bytes of the device whose context is current on this thread.
pub fn get_info() -> Result<(u64, u64)> {
    let mut free: usize = 0;
    let mut total: usize = 0;
    // SAFETY: both are valid out-pointers; without a current context the driver reports an
    // error.
    call("cuMemGetInfo_v2", || unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// Allocates `size` bytes from the current device's default memory pool, ordered on `stream`
/// (`cuMemAllocAsync`: what `cudaMallocAsync` calls).
///
/// # Safety
///
/// 1. `stream` is a live stream of the context current on this thread.
pub unsafe fn alloc_async(size: u64, stream: CUstream) -> Result<CUdeviceptr> {
    let n = to_usize(size, "stream-ordered allocation size")?;
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a valid out-pointer; the caller guarantees the stream is live in the
    // current context.
    call("cuMemAllocAsync", || unsafe {
        sys::cuMemAllocAsync(&mut p, n, stream)
    })?;
    Ok(p)
}

/// Frees `ptr`, ordered on `stream` (`cuMemFreeAsync`).
///
/// # Safety
///
/// 1. `ptr` came from [`alloc_async`] and is freed once.
/// 2. `stream` is a live stream of the context current on this thread, and every use of `ptr`
///    is ordered before the free on it.
pub unsafe fn free_async(ptr: CUdeviceptr, stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees a live allocation, freed once, after its last use.
    call("cuMemFreeAsync", || unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}
