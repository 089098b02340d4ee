use super::*;

/// A `CUmemLocation` of the given type and id.
pub fn location(type_: sys::CUmemLocationType, id: c_int) -> CUmemLocation {
    CUmemLocation { type_, id }
}

/// A pinned allocation property at `location`, optionally requesting POSIX-fd export.
pub fn prop(location: CUmemLocation, exportable: bool) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if exportable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        },
        location,
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Minimum mapping granularity for allocations described by `prop`.
pub fn granularity(prop: &CUmemAllocationProp) -> Result<u64> {
    let mut gran: usize = 0;
    // SAFETY: `gran` is a valid out-pointer and `prop` a valid, fully initialized property
    // for the duration of the call.
    call("cuMemGetAllocationGranularity", || unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(gran as u64)
}

/// Creates `size` bytes of physical memory as described by `prop`.
///
/// `CUDA_ERROR_OUT_OF_MEMORY` comes back as [`Error::Driver`] with that code (see
/// [`is_code`]); the backend turns it into [`Error::OutOfMemory`] with the free memory.
pub fn create(size: u64, prop: &CUmemAllocationProp) -> Result<CUmemGenericAllocationHandle> {
    let size = to_usize(size, "create size")?;
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid out-pointer, `prop` a valid property; flags must be 0.
    call("cuMemCreate", || unsafe {
        sys::cuMemCreate(&mut handle, size, prop, 0)
    })?;
    Ok(handle)
}

/// Drops the caller's reference to a handle.
///
/// # Safety
///
/// 1. `handle` came from [`create`] or [`import_fd`] and is released exactly once.
/// 2. The handle value is not used again afterwards (mappings made from it stay valid until
///    unmapped).
pub unsafe fn release(handle: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller guarantees the handle is live and released once.
    call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) })
}

/// The properties a handle was created (or imported) with.
///
/// # Safety
///
/// 1. `handle` is a live handle (not yet released).
pub unsafe fn properties(handle: CUmemGenericAllocationHandle) -> Result<CUmemAllocationProp> {
    let mut out = prop(
        location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, 0),
        false,
    );
    // SAFETY: `out` is a valid out-pointer; the caller guarantees `handle` is live.
    call("cuMemGetAllocationPropertiesFromHandle", || unsafe {
        sys::cuMemGetAllocationPropertiesFromHandle(&mut out, handle)
    })?;
    Ok(out)
}

/// Exports a handle created with POSIX-fd export as a new file descriptor owned by the
/// caller.
///
/// # Safety
///
/// 1. `handle` is a live handle (not yet released).
pub unsafe fn export_fd(handle: CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes an `int` to the
    // pointer it is given; `fd` is a valid, writable `c_int`. The caller guarantees `handle`.
    call("cuMemExportToShareableHandle", || unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::InvalidState(format!(
            "cuMemExportToShareableHandle returned success but fd {fd}"
        )));
    }
    // SAFETY: on success the driver created `fd` for the caller, who now solely owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Imports a handle from a POSIX file descriptor. The descriptor stays owned by the caller
/// (the driver does not close it); the returned handle must be released.
pub fn import_fd(fd: BorrowedFd<'_>) -> Result<CUmemGenericAllocationHandle> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    // The driver's convention for POSIX fds: the descriptor value itself is passed in the
    // pointer-sized argument (`(void *)(uintptr_t)fd` in NVIDIA's samples), not a pointer to
    // it.
    let os_handle = fd.as_raw_fd() as usize as *mut c_void;
    // SAFETY: `handle` is a valid out-pointer; `os_handle` is an fd value the driver reads
    // (not dereferenced as memory); `fd` is borrowed, so it stays open for the call.
    call("cuMemImportFromShareableHandle", || unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            os_handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(handle)
}
