use super::*;

/// Reserves `size` bytes of device VA aligned to `alignment` (0: the default) anywhere.
pub fn reserve(size: u64, alignment: u64) -> Result<CUdeviceptr> {
    let size = to_usize(size, "reserve size")?;
    let alignment = to_usize(alignment, "reserve alignment")?;
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out-pointer; a fresh reservation at a driver-chosen address
    // (addr 0, flags 0) cannot alias anything that exists.
    call("cuMemAddressReserve", || unsafe {
        sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0)
    })?;
    Ok(ptr)
}

/// Frees a reservation.
///
/// # Safety
///
/// 1. `(ptr, size)` is exactly what one [`reserve`] returned, freed once.
/// 2. Nothing is mapped inside it, and nothing (kernels, copies in flight) still uses it.
pub unsafe fn free(ptr: CUdeviceptr, size: u64) -> Result<()> {
    let size = to_usize(size, "free_va size")?;
    // SAFETY: the caller guarantees the range is an unused reservation of its own.
    call("cuMemAddressFree", || unsafe {
        sys::cuMemAddressFree(ptr, size)
    })
}
