use super::*;

/// Allocates `size` bytes of portable pinned host memory (a context must be current).
pub fn alloc(size: u64) -> Result<CUdeviceptr> {
    let n = to_usize(size, "host allocation size")?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the call; the flag is a valid allocation flag.
    call("cuMemHostAlloc", || unsafe {
        sys::cuMemHostAlloc(&mut p, n, sys::CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(p as CUdeviceptr)
}

/// Frees memory from [`alloc`].
///
/// # Safety
///
/// 1. `ptr` came from [`alloc`] and is freed once.
/// 2. No copy or kernel in flight touches it, and nobody uses it afterwards.
pub unsafe fn free(ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: the caller guarantees `ptr` is a live pinned allocation nobody uses any more.
    call("cuMemFreeHost", || unsafe {
        sys::cuMemFreeHost(ptr as usize as *mut c_void)
    })
}
