use super::*;

/// Maps `size` bytes of `handle` from `offset` at `ptr`.
///
/// # Safety
///
/// 1. `ptr..ptr+size` lies inside one reservation of the caller and is not mapped.
/// 2. `handle` is live; `offset + size` does not exceed its size.
pub unsafe fn map(
    ptr: CUdeviceptr,
    size: u64,
    offset: u64,
    handle: CUmemGenericAllocationHandle,
) -> Result<()> {
    let size = to_usize(size, "map size")?;
    let offset = to_usize(offset, "map offset")?;
    // SAFETY: the caller guarantees the target range and the handle; flags must be 0.
    call("cuMemMap", || unsafe {
        sys::cuMemMap(ptr, size, offset, handle, 0)
    })
}

/// Unmaps whole mappings covering exactly `ptr..ptr+size`.
///
/// # Safety
///
/// 1. The range covers whole mappings made by [`map`](fn@map) exactly.
/// 2. No work in flight (kernels, copies) touches the range: the driver does not wait.
pub unsafe fn unmap(ptr: CUdeviceptr, size: u64) -> Result<()> {
    let size = to_usize(size, "unmap size")?;
    // SAFETY: the caller guarantees the range and that nothing in flight uses it.
    call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, size) })
}
