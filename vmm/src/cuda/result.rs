//! A thin result layer over cudarc's `driver::sys`, in cudarc's own style: module-scoped verbs
//! (`va::reserve`, `phys::create`, `map::map`, `access::set`, ...) that return [`Result`] and
//! carry numbered `# Safety` lists where the caller must uphold something the driver cannot check.
//!
//! cudarc wraps no VMM call, so this layer is ours. Two things make it more careful than a plain
//! wrapper:
//!
//! - cudarc loads every symbol lazily and **panics** when the library or the symbol is missing.
//!   Every driver call here goes through [`call`], which catches that panic and reports it as
//!   [`Error::NoDriver`], so a missing `libcuda` (or an old one without a symbol) is an error,
//!   never an unwind into the caller.
//! - Sizes cross the boundary as `usize`; callers hand `u64` values, converted with a check.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys;

use crate::error::{Error, Result};

pub use sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmemAccessDesc, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation, CUmodule, CUresult, CUstream,
};

/// Runs one driver call, turning a panic from cudarc's lazy loader (no library, missing symbol)
/// into [`Error::NoDriver`] and a non-success code into [`Error::Driver`].
pub fn call(name: &'static str, f: impl FnOnce() -> CUresult) -> Result<()> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(driver_error(name, code)),
        Err(_) => Err(Error::NoDriver(format!(
            "{name}: the CUDA driver library or this symbol could not be loaded"
        ))),
    }
}

/// The error for a failed call: its name, numeric code and the driver's name for the code.
pub fn driver_error(call: &'static str, code: CUresult) -> Error {
    Error::Driver {
        call,
        code: code as i32,
        name: error_name(code),
    }
}

/// The driver's name for `code` (`CUDA_ERROR_OUT_OF_MEMORY`), or a debug rendering if the driver
/// cannot say.
pub fn error_name(code: CUresult) -> String {
    let mut ptr: *const c_char = std::ptr::null();
    let got = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ptr` is a valid out-pointer for the duration of the call; the driver stores a
        // pointer to a static, NUL-terminated string in it (or leaves it untouched on failure).
        unsafe { sys::cuGetErrorName(code, &mut ptr) }
    }));
    match got {
        Ok(CUresult::CUDA_SUCCESS) if !ptr.is_null() => {
            // SAFETY: on success `ptr` points to a static NUL-terminated string owned by the
            // driver, valid for the life of the process.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        }
        _ => format!("{code:?}"),
    }
}

/// True when `code` is the error `call` returned.
pub fn is_code(err: &Error, code: CUresult) -> bool {
    matches!(err, Error::Driver { code: c, .. } if *c == code as i32)
}

/// `u64` → `usize` for a size crossing into the driver.
pub fn to_usize(value: u64, what: &'static str) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::Overflow(what))
}

/// True when a CUDA driver library can be loaded on this machine (no panic either way).
pub fn driver_present() -> bool {
    catch_unwind(|| {
        // SAFETY: loading a shared library runs its initializers; libcuda's are designed to be
        // loaded this way (it is what the CUDA runtime does). Nothing else is called.
        unsafe { sys::is_culib_present() }
    })
    .unwrap_or(false)
}

/// True when the loaded driver library exports `symbol` (a NUL-terminated name). False when no
/// driver library can be loaded.
pub fn symbol_present(symbol: &CStr) -> bool {
    if !driver_present() {
        return false;
    }
    catch_unwind(|| {
        // SAFETY: `culib` loads the same library `driver_present` just found (it panics otherwise,
        // which is caught). Looking a symbol up calls nothing; the pointer type is irrelevant
        // because the symbol is never called through this lookup.
        unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(symbol.to_bytes_with_nul())
                .is_ok()
        }
    })
    .unwrap_or(false)
}

/// Every driver symbol this layer calls (except the optional `cuMemcpyBatchAsync`).
pub const REQUIRED_SYMBOLS: &[&CStr] = &[
    c"cuInit",
    c"cuDriverGetVersion",
    c"cuGetErrorName",
    c"cuDeviceGetCount",
    c"cuDeviceGet",
    c"cuDeviceGetName",
    c"cuDeviceTotalMem_v2",
    c"cuDevicePrimaryCtxRetain",
    c"cuDevicePrimaryCtxRelease_v2",
    c"cuCtxSetCurrent",
    c"cuMemAddressReserve",
    c"cuMemAddressFree",
    c"cuMemGetAllocationGranularity",
    c"cuMemCreate",
    c"cuMemRelease",
    c"cuMemGetAllocationPropertiesFromHandle",
    c"cuMemExportToShareableHandle",
    c"cuMemImportFromShareableHandle",
    c"cuMemMap",
    c"cuMemUnmap",
    c"cuMemSetAccess",
    c"cuMemGetInfo_v2",
    c"cuStreamCreate",
    c"cuStreamDestroy_v2",
    c"cuStreamSynchronize",
    c"cuStreamWaitEvent",
    c"cuEventCreate",
    c"cuEventDestroy_v2",
    c"cuEventRecord",
    c"cuEventQuery",
    c"cuEventSynchronize",
    c"cuMemcpyAsync",
    c"cuMemsetD8Async",
];

/// Driver symbols the block-copy kernel needs beyond [`REQUIRED_SYMBOLS`] (probed before its
/// first launch, so a driver without them means "no kernel", not "no backend").
pub const KERNEL_SYMBOLS: &[&CStr] = &[
    c"cuDeviceGetAttribute",
    c"cuModuleLoadData",
    c"cuModuleUnload",
    c"cuModuleGetFunction",
    c"cuLaunchKernel",
    c"cuMemHostAlloc",
    c"cuMemFreeHost",
];

/// The names in `symbols` the loaded driver library does not export (all of them when no
/// library loads). Probing up front means a later call never hits cudarc's panic on a missing
/// symbol, even in a build with `panic = "abort"`.
pub fn missing_symbols(symbols: &[&CStr]) -> Vec<String> {
    symbols
        .iter()
        .filter(|s| !symbol_present(s))
        .map(|s| s.to_string_lossy().into_owned())
        .collect()
}

/// Initializes the driver (`cuInit(0)`). [`Error::NoDriver`] when no library can be loaded or
/// the driver reports no device / no usable installation.
pub fn init() -> Result<()> {
    if !driver_present() {
        return Err(Error::NoDriver("libcuda.so could not be loaded".into()));
    }
    let missing = missing_symbols(REQUIRED_SYMBOLS);
    if !missing.is_empty() {
        return Err(Error::NoDriver(format!(
            "the CUDA driver library lacks {}",
            missing.join(", ")
        )));
    }
    // SAFETY: `cuInit` takes only a flags value (0 is the only valid one) and may be called any
    // number of times from any thread.
    match call("cuInit", || unsafe { sys::cuInit(0) }) {
        Err(e)
            if is_code(&e, CUresult::CUDA_ERROR_NO_DEVICE)
                || is_code(&e, CUresult::CUDA_ERROR_SYSTEM_NOT_READY)
                || is_code(&e, CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)
                || is_code(&e, CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE) =>
        {
            Err(Error::NoDriver(e.to_string()))
        }
        other => other,
    }
}

/// The driver's CUDA version as `1000 * major + 10 * minor` (12080 for 12.8).
pub fn driver_version() -> Result<i32> {
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out-pointer for the call.
    call("cuDriverGetVersion", || unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// Devices.
pub mod device {
    use super::*;

    /// Number of CUDA devices (after [`init`]).
    pub fn count() -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the call.
        call("cuDeviceGetCount", || unsafe {
            sys::cuDeviceGetCount(&mut n)
        })?;
        Ok(n)
    }

    /// The device handle of ordinal `ordinal`.
    pub fn get(ordinal: i32) -> Result<CUdevice> {
        let mut dev: CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer; an out-of-range ordinal is reported as an error.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        Ok(dev)
    }

    /// The device's marketing name.
    pub fn name(dev: CUdevice) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        let len = buf.len() as c_int;
        // SAFETY: `buf` is writable for `len` bytes; the driver writes at most `len` bytes,
        // NUL-terminated.
        call("cuDeviceGetName", || unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), len, dev)
        })?;
        // Force termination in case the driver filled the buffer exactly.
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` is NUL-terminated (forced above) and lives across the borrow.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// One integer attribute of the device (compute capability, grid limits, ...).
    pub fn attribute(dev: CUdevice, attribute: sys::CUdevice_attribute) -> Result<i32> {
        let mut value: c_int = 0;
        // SAFETY: `value` is a valid out-pointer; the driver validates `dev` and `attribute`.
        call("cuDeviceGetAttribute", || unsafe {
            sys::cuDeviceGetAttribute(&mut value, attribute, dev)
        })?;
        Ok(value)
    }

    /// Total device memory in bytes.
    pub fn total_mem(dev: CUdevice) -> Result<u64> {
        let mut bytes: usize = 0;
        // SAFETY: `bytes` is a valid out-pointer for the call.
        call("cuDeviceTotalMem_v2", || unsafe {
            sys::cuDeviceTotalMem_v2(&mut bytes, dev)
        })?;
        Ok(bytes as u64)
    }
}

/// Contexts (primary contexts only).
pub mod ctx {
    use super::*;

    /// Retains the primary context of `dev` (creating it on first retain).
    pub fn retain_primary(dev: CUdevice) -> Result<CUcontext> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `dev` is validated by the driver.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(ctx)
    }

    /// Releases one reference to the primary context of `dev`.
    ///
    /// # Safety
    ///
    /// 1. Each call matches exactly one earlier successful [`retain_primary`] of `dev` by the
    ///    caller.
    /// 2. After the caller's last release, the caller uses no object (stream, event, memory) of
    ///    that context any more and does not make it current again.
    pub unsafe fn release_primary(dev: CUdevice) -> Result<()> {
        // SAFETY: the caller guarantees the release balances one of its own retains.
        call("cuDevicePrimaryCtxRelease_v2", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(dev)
        })
    }

    /// Makes `ctx` current on the calling thread.
    ///
    /// # Safety
    ///
    /// 1. `ctx` is null or a context that is alive (for a primary context: retained by the caller
    ///    for the whole time it stays current through this call).
    pub unsafe fn set_current(ctx: CUcontext) -> Result<()> {
        // SAFETY: the caller guarantees `ctx` is alive.
        call("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(ctx) })
    }
}

/// Virtual address reservations.
pub mod va {
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
}

/// Physical memory handles.
pub mod phys {
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
}

/// Mapping physical memory into reserved VA.
pub mod map {
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
}

/// Access rights over mapped ranges.
pub mod access {
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
}

/// Memory information.
pub mod mem {
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
}

/// Streams.
pub mod stream {
    use super::*;

    /// Creates a non-blocking stream in the current context.
    pub fn create() -> Result<CUstream> {
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer; the flag is a valid stream flag.
        call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(stream)
    }

    /// Destroys a stream (queued work still completes).
    ///
    /// # Safety
    ///
    /// 1. `stream` is a live stream created by [`create`], destroyed once and never used again.
    pub unsafe fn destroy(stream: CUstream) -> Result<()> {
        // SAFETY: the caller guarantees the stream is live and destroyed once.
        call("cuStreamDestroy_v2", || unsafe {
            sys::cuStreamDestroy_v2(stream)
        })
    }

    /// Waits for all work queued on `stream`.
    ///
    /// # Safety
    ///
    /// 1. `stream` is null (the legacy default stream of the current context) or live.
    pub unsafe fn synchronize(stream: CUstream) -> Result<()> {
        // SAFETY: the caller guarantees the stream is null or live.
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream)
        })
    }

    /// Makes future work on `stream` wait for `event`.
    ///
    /// # Safety
    ///
    /// 1. `stream` is null or live; `event` is live.
    pub unsafe fn wait_event(stream: CUstream, event: CUevent) -> Result<()> {
        // SAFETY: the caller guarantees both handles; flags 0 is the default wait.
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream, event, 0)
        })
    }
}

/// Events.
pub mod event {
    use super::*;

    /// Creates an event without timing in the current context.
    pub fn create() -> Result<CUevent> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: `event` is a valid out-pointer; the flag is a valid event flag.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        Ok(event)
    }

    /// Destroys an event.
    ///
    /// # Safety
    ///
    /// 1. `event` is live, destroyed once and never used again.
    pub unsafe fn destroy(event: CUevent) -> Result<()> {
        // SAFETY: the caller guarantees the event is live and destroyed once.
        call("cuEventDestroy_v2", || unsafe {
            sys::cuEventDestroy_v2(event)
        })
    }

    /// Records `event` at the current end of `stream`.
    ///
    /// # Safety
    ///
    /// 1. `event` is live; `stream` is null or live, in the same context as `event`.
    pub unsafe fn record(event: CUevent, stream: CUstream) -> Result<()> {
        // SAFETY: the caller guarantees both handles.
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event, stream)
        })
    }

    /// True when the work before the last record of `event` completed.
    ///
    /// # Safety
    ///
    /// 1. `event` is live.
    pub unsafe fn query(event: CUevent) -> Result<bool> {
        // SAFETY: the caller guarantees the event is live.
        match call("cuEventQuery", || unsafe { sys::cuEventQuery(event) }) {
            Ok(()) => Ok(true),
            Err(e) if is_code(&e, CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Blocks until `event` completed.
    ///
    /// # Safety
    ///
    /// 1. `event` is live.
    pub unsafe fn synchronize(event: CUevent) -> Result<()> {
        // SAFETY: the caller guarantees the event is live.
        call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(event)
        })
    }
}

/// Copies and fills.
pub mod memcpy {
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
}

/// Page-locked host memory (`cuMemHostAlloc`), reachable from every device at the same address
/// (unified addressing).
pub mod host {
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
}

/// Modules (compiled device code) and their functions.
pub mod module {
    use super::*;

    /// Loads a module into the current context from an image in memory.
    ///
    /// # Safety
    ///
    /// 1. `image` is a complete cubin, or PTX text ending in NUL (as NVRTC produced it): the
    ///    driver parses it without a length.
    /// 2. A context is current; the module belongs to it and is unloaded with that context
    ///    current ([`unload`]).
    pub unsafe fn load_data(image: &[u8]) -> Result<CUmodule> {
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: `module` is a valid out-pointer; the caller guarantees the image is complete.
        call("cuModuleLoadData", || unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
        })?;
        Ok(module)
    }

    /// Unloads a module.
    ///
    /// # Safety
    ///
    /// 1. `module` came from [`load_data`], is unloaded once with its context current, and no
    ///    launch of its functions is still queued or running.
    pub unsafe fn unload(module: CUmodule) -> Result<()> {
        // SAFETY: the caller guarantees the module is live, idle and unloaded once.
        call("cuModuleUnload", || unsafe { sys::cuModuleUnload(module) })
    }

    /// The entry point `name` of a loaded module.
    ///
    /// # Safety
    ///
    /// 1. `module` is live (loaded and not unloaded).
    pub unsafe fn function(module: CUmodule, name: &CStr) -> Result<CUfunction> {
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: `f` is a valid out-pointer, `name` a NUL-terminated string that outlives the
        // call; the caller guarantees the module.
        call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut f, module, name.as_ptr())
        })?;
        Ok(f)
    }
}

/// Kernel launches.
pub mod launch {
    use super::*;

    /// Queues `f` on `stream` with a one-dimensional grid and block and no dynamic shared
    /// memory. `params` holds one pointer per kernel parameter, each to a value of exactly the
    /// parameter's type; the driver copies the values before returning.
    ///
    /// # Safety
    ///
    /// 1. `f` is a function of a live module of the current context.
    /// 2. `params` matches the kernel's parameter list in number, order and types.
    /// 3. Every memory the kernel touches with these parameters is valid for it (device VA
    ///    mapped with access for this device, or pinned host memory) until the launch completes.
    /// 4. `stream` is null or live, in the current context.
    pub unsafe fn kernel(
        f: CUfunction,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees the function, the parameters and the memory they reach;
        // `params` outlives the call; `extra` is null (parameters come from `params`).
        call("cuLaunchKernel", || unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
