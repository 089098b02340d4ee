use super::*;

/// The access flags value for a grant.
pub fn flags(access: crate::types::Access) -> sys::CUmemAccess_flags {
    match access {
        crate::types::Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        crate::types::Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        crate::types::Access::ReadWrite => {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        }
    }
}

/// Sets access for every descriptor over `ptr..ptr+size`, in one call.
///
/// # Safety
///
/// 1. The range is fully mapped by the caller.
/// 2. No work in flight relies on access this call removes.
pub unsafe fn set(ptr: CUdeviceptr, size: u64, descs: &[CUmemAccessDesc]) -> Result<()> {
    let size = to_usize(size, "set_access size")?;
    // SAFETY: `descs` is a valid slice of `descs.len()` descriptors for the call; the caller
    // guarantees the range.
    call("cuMemSetAccess", || unsafe {
        sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
    })
}
