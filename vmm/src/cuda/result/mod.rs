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
pub mod device;

/// Contexts (primary contexts only).
pub mod ctx;

/// Virtual address reservations.
pub mod va;

/// Physical memory handles.
pub mod phys;

/// Mapping physical memory into reserved VA.
pub mod map;

/// Access rights over mapped ranges.
pub mod access;

/// Memory information.
pub mod mem;

/// Streams.
pub mod stream;

/// Events.
pub mod event;

/// Copies and fills.
pub mod memcpy;

/// Page-locked host memory (`cuMemHostAlloc`), reachable from every device at the same address
/// (unified addressing).
pub mod host;

/// Modules (compiled device code) and their functions.
pub mod module;

/// Kernel launches.
pub mod launch;
