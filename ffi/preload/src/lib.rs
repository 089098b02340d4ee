//! `libstrata_preload.so`: a driver-level LD_PRELOAD interposer that serves CUDA allocations
//! from strata.
//!
//! Engines, NCCL and the CUDA runtime reach the driver through `dlsym` on their own libcuda
//! handle and through `cuGetProcAddress`, so a preloaded `cuMemAlloc_v2` alone is never called.
//! This library therefore exports:
//!
//! - `dlsym`: for a hooked name found on any handle, returns the wrapper (and remembers the
//!   real pointer); everything else is the real `dlsym`'s answer;
//! - `cuGetProcAddress` / `cuGetProcAddress_v2`: calls the real one, then swaps in the wrapper
//!   for the rows of the explicit table in `table` (and for `cuGetProcAddress` itself);
//! - the wrappers: `cuMemAlloc_v2`, `cuMemFree_v2`, `cuMemAllocAsync[_ptsz]`,
//!   `cuMemFreeAsync[_ptsz]`, `cuMemGetInfo_v2`, `cudaMalloc`, `cudaFree`;
//! - introspection for tests and tools: `strata_preload_owns`, `strata_preload_stats`,
//!   `strata_preload_initialized`.
//!
//! Layers: `table` (names, the proc-address table), `real` (real functions), `glue`
//! (allocators), this file (the C ABI). Every export runs behind a panic boundary.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

mod config;
mod glue;
mod ops;
mod real;
mod table;

use config::log;
use glue::{Alloc, Free};
use table::Hook;

type CuResult = c_int;
type CuDevicePtr = u64;
type CuStream = *mut c_void;
type CudaError = c_int;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
const CUDA_ERROR_UNKNOWN: CuResult = 999;

const CUDA_RT_SUCCESS: CudaError = 0;
const CUDA_RT_ERROR_INVALID_VALUE: CudaError = 1;
const CUDA_RT_ERROR_MEMORY_ALLOCATION: CudaError = 2;
const CUDA_RT_ERROR_INITIALIZATION: CudaError = 3;
const CUDA_RT_ERROR_UNKNOWN: CudaError = 999;

/// Runs `f`; a panic is reported and turned into `fallback` (never unwinds into C).
fn boundary<R>(name: &str, fallback: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        eprintln!("strata-preload: internal panic in {name}");
        fallback
    })
}

/// The shim's wrapper for `hook`.
fn wrapper(hook: Hook) -> *mut c_void {
    match hook {
        Hook::MemAlloc => cuMemAlloc_v2 as *mut c_void,
        Hook::MemFree => cuMemFree_v2 as *mut c_void,
        Hook::MemAllocAsync => cuMemAllocAsync as *mut c_void,
        Hook::MemAllocAsyncPtsz => cuMemAllocAsync_ptsz as *mut c_void,
        Hook::MemFreeAsync => cuMemFreeAsync as *mut c_void,
        Hook::MemFreeAsyncPtsz => cuMemFreeAsync_ptsz as *mut c_void,
        Hook::MemGetInfo => cuMemGetInfo_v2 as *mut c_void,
        Hook::GetProcAddress => cuGetProcAddress as *mut c_void,
        Hook::GetProcAddressV2 => cuGetProcAddress_v2 as *mut c_void,
        Hook::CudaMalloc => cudaMalloc as *mut c_void,
        Hook::CudaFree => cudaFree as *mut c_void,
    }
}

/// True when `p` is one of the shim's wrappers (never taken as a real function).
pub(crate) fn is_wrapper(p: *mut c_void) -> bool {
    Hook::ALL.into_iter().any(|h| wrapper(h) == p)
}

/// The real function behind `hook` as a typed pointer.
///
/// # Safety
///
/// `F` must be the function-pointer type of `hook`'s ABI.
unsafe fn real_fn<F: Copy>(hook: Hook) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    let p = real::hook(hook)?;
    // SAFETY: `p` is non-null and is the real `hook.symbol()`, whose type the caller vouches
    // for; F is pointer-sized (checked above).
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

// ---------------------------------------------------------------------------------------------
// dlsym

/// Interposed `dlsym`: hooked names found on any handle (a libcuda handle included) resolve to
/// the shim's wrappers; everything else is the real answer.
///
/// `RTLD_NEXT` is resolved relative to this library (the first object when preloaded), as in
/// every dlsym interposer that cannot see its caller's return address.
///
/// # Safety
///
/// As `dlsym(3)`: `handle` is a valid handle or pseudo-handle, `symbol` a C string or null.
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    boundary("dlsym", std::ptr::null_mut(), || {
        let Some(real) = real::dlsym() else {
            return std::ptr::null_mut();
        };
        // SAFETY: arguments forwarded unchanged; the caller upholds dlsym's contract.
        let found = unsafe { real(handle, symbol) };
        if symbol.is_null() || found.is_null() || !glue::active() {
            return found;
        }
        // SAFETY: non-null `symbol` is a NUL-terminated C string (dlsym's contract).
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        let Some(hook) = Hook::from_symbol(name) else {
            return found;
        };
        if is_wrapper(found) {
            // The lookup found the shim itself (RTLD_DEFAULT): only hand the wrapper out when a
            // real function exists behind it, so "is CUDA here?" probes stay truthful.
            if real::hook(hook).is_none() {
                return std::ptr::null_mut();
            }
        } else {
            real::offer(hook, found);
        }
        log!("dlsym({}) -> wrapper", hook.symbol().to_string_lossy());
        wrapper(hook)
    })
}

// ---------------------------------------------------------------------------------------------
// cuGetProcAddress

type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
type GetProcV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

/// After a successful real lookup, swaps in the wrapper for the table's rows.
///
/// # Safety
///
/// `symbol` is a C string and `pfn` a valid out-pointer the real call just filled.
unsafe fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    if symbol.is_null() || pfn.is_null() || !glue::active() {
        return;
    }
    // SAFETY: the caller vouches for both pointers.
    let (name, got) = unsafe { (CStr::from_ptr(symbol).to_bytes(), *pfn) };
    if got.is_null() {
        return;
    }
    let Some(row) = table::proc_lookup(name, version, flags) else {
        return;
    };
    let Some(mut hook) = row.hook else {
        return;
    };
    // CU_GET_PROC_ADDRESS_DEFAULT may still yield the per-thread variant.
    if let Some(twin) = hook.per_thread_twin() {
        if real::hook(twin) == Some(got) {
            hook = twin;
        }
    }
    real::offer(hook, got);
    log!(
        "cuGetProcAddress({}, {version}, {flags}) -> wrapper of {}",
        String::from_utf8_lossy(name),
        hook.symbol().to_string_lossy()
    );
    // SAFETY: `pfn` is a valid out-pointer.
    unsafe { *pfn = wrapper(hook) };
}

/// Interposed `cuGetProcAddress` (CUDA 11.3 ABI).
///
/// # Safety
///
/// As the driver's: `symbol` a C string, `pfn` a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    boundary("cuGetProcAddress", CUDA_ERROR_UNKNOWN, || {
        // SAFETY: GetProcAddress is the 4-argument ABI.
        let Some(real) = (unsafe { real_fn::<GetProcV1>(Hook::GetProcAddress) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: arguments forwarded unchanged.
        let rc = unsafe { real(symbol, pfn, version, flags) };
        if rc == CUDA_SUCCESS {
            // SAFETY: the real call succeeded, so both pointers were valid.
            unsafe { substitute(symbol, pfn, version, flags) };
        }
        rc
    })
}

/// Interposed `cuGetProcAddress_v2` (CUDA 12.0 ABI, with `symbolStatus`).
///
/// # Safety
///
/// As the driver's: `symbol` a C string, `pfn` a valid out-pointer, `status` null or valid.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    boundary("cuGetProcAddress_v2", CUDA_ERROR_UNKNOWN, || {
        // SAFETY: GetProcAddressV2 is the 5-argument ABI.
        let Some(real) = (unsafe { real_fn::<GetProcV2>(Hook::GetProcAddressV2) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: arguments forwarded unchanged.
        let rc = unsafe { real(symbol, pfn, version, flags, status) };
        if rc == CUDA_SUCCESS {
            // SAFETY: the real call succeeded, so both pointers were valid.
            unsafe { substitute(symbol, pfn, version, flags) };
        }
        rc
    })
}

// ---------------------------------------------------------------------------------------------
// Driver allocation

type MemAllocFn = unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
type MemFreeFn = unsafe extern "C" fn(CuDevicePtr) -> CuResult;
type MemAllocAsyncFn = unsafe extern "C" fn(*mut CuDevicePtr, usize, CuStream) -> CuResult;
type MemFreeAsyncFn = unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult;
type MemGetInfoFn = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;

/// The device of the calling thread's current context; `None` when strata should not serve
/// (no current context: the real call reports the error).
fn driver_device() -> Option<u32> {
    match real::ctx_device() {
        Some(Ok(dev)) => u32::try_from(dev).ok(),
        Some(Err(_)) => None,
        None => Some(0),
    }
}

/// Serves a driver allocation, or returns `None` to call the real function.
fn driver_alloc(what: &str, dptr: *mut CuDevicePtr, size: usize) -> Option<CuResult> {
    if !glue::active() {
        return None;
    }
    if dptr.is_null() || size == 0 {
        return Some(CUDA_ERROR_INVALID_VALUE);
    }
    let device = driver_device()?;
    match glue::allocate(size as u64, device) {
        Alloc::Served(ptr) => {
            // SAFETY: `dptr` is non-null and the caller's out-pointer.
            unsafe { *dptr = ptr };
            log!("{what}({size}) on device {device} -> {ptr:#x} (strata)");
            Some(CUDA_SUCCESS)
        }
        Alloc::OutOfMemory => Some(CUDA_ERROR_OUT_OF_MEMORY),
        Alloc::PassThrough => None,
    }
}

/// Frees a strata pointer, or returns `None` to call the real function.
fn driver_free(what: &str, ptr: CuDevicePtr, stream: Option<CuStream>) -> Option<CuResult> {
    if ptr == 0 || !glue::active() {
        return None;
    }
    match glue::free(ptr, || real::synchronize(stream)) {
        Free::Freed => {
            log!("{what}({ptr:#x}) (strata)");
            Some(CUDA_SUCCESS)
        }
        Free::Invalid => Some(CUDA_ERROR_INVALID_VALUE),
        Free::Foreign => {
            log!("{what}({ptr:#x}) -> real");
            None
        }
    }
}

/// # Safety
///
/// As the driver's `cuMemAlloc_v2`: `dptr` a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, size: usize) -> CuResult {
    boundary("cuMemAlloc_v2", CUDA_ERROR_UNKNOWN, || {
        if let Some(rc) = driver_alloc("cuMemAlloc_v2", dptr, size) {
            return rc;
        }
        // SAFETY: the real cuMemAlloc_v2 has this ABI; arguments forwarded unchanged.
        match unsafe { real_fn::<MemAllocFn>(Hook::MemAlloc) } {
            // SAFETY: as above.
            Some(f) => unsafe { f(dptr, size) },
            None => CUDA_ERROR_NOT_INITIALIZED,
        }
    })
}

/// # Safety
///
/// As the driver's `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CuDevicePtr) -> CuResult {
    boundary("cuMemFree_v2", CUDA_ERROR_UNKNOWN, || {
        if let Some(rc) = driver_free("cuMemFree_v2", ptr, None) {
            return rc;
        }
        // SAFETY: the real cuMemFree_v2 has this ABI; arguments forwarded unchanged.
        match unsafe { real_fn::<MemFreeFn>(Hook::MemFree) } {
            // SAFETY: as above.
            Some(f) => unsafe { f(ptr) },
            None => CUDA_ERROR_NOT_INITIALIZED,
        }
    })
}

fn alloc_async(hook: Hook, dptr: *mut CuDevicePtr, size: usize, stream: CuStream) -> CuResult {
    if let Some(rc) = driver_alloc("cuMemAllocAsync", dptr, size) {
        return rc;
    }
    // SAFETY: both async hooks have this ABI; arguments forwarded unchanged.
    match unsafe { real_fn::<MemAllocAsyncFn>(hook) } {
        // SAFETY: as above.
        Some(f) => unsafe { f(dptr, size, stream) },
        None => CUDA_ERROR_NOT_INITIALIZED,
    }
}

fn free_async(hook: Hook, ptr: CuDevicePtr, stream: CuStream) -> CuResult {
    if let Some(rc) = driver_free("cuMemFreeAsync", ptr, Some(stream)) {
        return rc;
    }
    // SAFETY: both async hooks have this ABI; arguments forwarded unchanged.
    match unsafe { real_fn::<MemFreeAsyncFn>(hook) } {
        // SAFETY: as above.
        Some(f) => unsafe { f(ptr, stream) },
        None => CUDA_ERROR_NOT_INITIALIZED,
    }
}

/// Stream-ordered allocation, served from strata (ordered after the stream by strata's own
/// default-stream rules; the memory is usable on any stream).
///
/// # Safety
///
/// As the driver's `cuMemAllocAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CuDevicePtr,
    size: usize,
    stream: CuStream,
) -> CuResult {
    boundary("cuMemAllocAsync", CUDA_ERROR_UNKNOWN, || {
        alloc_async(Hook::MemAllocAsync, dptr, size, stream)
    })
}

/// # Safety
///
/// As the driver's `cuMemAllocAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CuDevicePtr,
    size: usize,
    stream: CuStream,
) -> CuResult {
    boundary("cuMemAllocAsync_ptsz", CUDA_ERROR_UNKNOWN, || {
        alloc_async(Hook::MemAllocAsyncPtsz, dptr, size, stream)
    })
}

/// Stream-ordered free: a strata pointer is freed once `stream`'s work completed.
///
/// # Safety
///
/// As the driver's `cuMemFreeAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: CuDevicePtr, stream: CuStream) -> CuResult {
    boundary("cuMemFreeAsync", CUDA_ERROR_UNKNOWN, || {
        free_async(Hook::MemFreeAsync, ptr, stream)
    })
}

/// # Safety
///
/// As the driver's `cuMemFreeAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(ptr: CuDevicePtr, stream: CuStream) -> CuResult {
    boundary("cuMemFreeAsync_ptsz", CUDA_ERROR_UNKNOWN, || {
        free_async(Hook::MemFreeAsyncPtsz, ptr, stream)
    })
}

/// Capacity as strata serves it: `total` is the device's memory, `free` what strata can still
/// serve (see `glue::mem_info`).
///
/// # Safety
///
/// As the driver's `cuMemGetInfo_v2`: both out-pointers valid.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    boundary("cuMemGetInfo_v2", CUDA_ERROR_UNKNOWN, || {
        if glue::active() {
            if free.is_null() || total.is_null() {
                return CUDA_ERROR_INVALID_VALUE;
            }
            if let Some((f, t)) = driver_device().and_then(glue::mem_info) {
                // SAFETY: both out-pointers are non-null and the caller's.
                unsafe {
                    *free = f as usize;
                    *total = t as usize;
                }
                log!("cuMemGetInfo_v2 -> free {f}, total {t}");
                return CUDA_SUCCESS;
            }
        }
        // SAFETY: the real cuMemGetInfo_v2 has this ABI; arguments forwarded unchanged.
        match unsafe { real_fn::<MemGetInfoFn>(Hook::MemGetInfo) } {
            // SAFETY: as above.
            Some(f) => unsafe { f(free, total) },
            None => CUDA_ERROR_NOT_INITIALIZED,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Runtime allocation

type CudaMallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> CudaError;
type CudaFreeFn = unsafe extern "C" fn(*mut c_void) -> CudaError;

/// # Safety
///
/// As the runtime's `cudaMalloc`: `dev_ptr` a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> CudaError {
    boundary("cudaMalloc", CUDA_RT_ERROR_UNKNOWN, || {
        if glue::active() && size > 0 && !dev_ptr.is_null() {
            let device = real::runtime_device()
                .or_else(|| real::ctx_device().and_then(Result::ok))
                .unwrap_or(0);
            if let Ok(device) = u32::try_from(device) {
                match glue::allocate(size as u64, device) {
                    Alloc::Served(ptr) => {
                        // SAFETY: `dev_ptr` is non-null and the caller's out-pointer.
                        unsafe { *dev_ptr = ptr as usize as *mut c_void };
                        log!("cudaMalloc({size}) on device {device} -> {ptr:#x} (strata)");
                        return CUDA_RT_SUCCESS;
                    }
                    Alloc::OutOfMemory => return CUDA_RT_ERROR_MEMORY_ALLOCATION,
                    Alloc::PassThrough => {}
                }
            }
        }
        // SAFETY: the real cudaMalloc has this ABI; arguments forwarded unchanged.
        match unsafe { real_fn::<CudaMallocFn>(Hook::CudaMalloc) } {
            // SAFETY: as above.
            Some(f) => unsafe { f(dev_ptr, size) },
            None => CUDA_RT_ERROR_INITIALIZATION,
        }
    })
}

/// # Safety
///
/// As the runtime's `cudaFree`.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> CudaError {
    boundary("cudaFree", CUDA_RT_ERROR_UNKNOWN, || {
        if !ptr.is_null() && glue::active() {
            match glue::free(ptr as usize as u64, || real::synchronize(None)) {
                Free::Freed => {
                    log!("cudaFree({ptr:p}) (strata)");
                    return CUDA_RT_SUCCESS;
                }
                Free::Invalid => return CUDA_RT_ERROR_INVALID_VALUE,
                Free::Foreign => log!("cudaFree({ptr:p}) -> real"),
            }
        }
        // SAFETY: the real cudaFree has this ABI; arguments forwarded unchanged (cudaFree(NULL)
        // is the runtime's context-initialization idiom and always reaches it).
        match unsafe { real_fn::<CudaFreeFn>(Hook::CudaFree) } {
            // SAFETY: as above.
            Some(f) => unsafe { f(ptr) },
            None => CUDA_RT_ERROR_INITIALIZATION,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Introspection

/// Figures of one device's strata allocator (`strata_preload_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct StrataPreloadStats {
    pub live_allocations: u64,
    pub allocs: u64,
    pub frees: u64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_reserved_bytes: u64,
}

/// 1 when `ptr` is a live allocation strata served, else 0.
#[no_mangle]
pub extern "C" fn strata_preload_owns(ptr: u64) -> c_int {
    boundary("strata_preload_owns", 0, || c_int::from(glue::owns(ptr)))
}

/// 1 once the shim opened strata's backend (an allocation or capacity query), else 0. Lookups
/// (`dlsym`, `cuGetProcAddress`, `cuGetExportTable`) never initialize anything.
#[no_mangle]
pub extern "C" fn strata_preload_initialized() -> c_int {
    boundary("strata_preload_initialized", 0, || {
        c_int::from(glue::initialized())
    })
}

/// Fills `out` with `device`'s figures: 0 on success, -1 when no allocator exists for it yet
/// or `out` is null.
///
/// # Safety
///
/// `out` is null or valid for writes of one `StrataPreloadStats`.
#[no_mangle]
pub unsafe extern "C" fn strata_preload_stats(
    device: c_int,
    out: *mut StrataPreloadStats,
) -> c_int {
    boundary("strata_preload_stats", -1, || {
        let Ok(device) = u32::try_from(device) else {
            return -1;
        };
        let Some(s) = glue::stats(device) else {
            return -1;
        };
        if out.is_null() {
            return -1;
        }
        let figures = StrataPreloadStats {
            live_allocations: s.live_allocations,
            allocs: s.counts.allocs,
            frees: s.counts.frees,
            allocated_bytes: s.allocated_bytes,
            reserved_bytes: s.reserved_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
        };
        // SAFETY: `out` is non-null and valid for writes (the caller's contract).
        unsafe { out.write(figures) };
        0
    })
}

/// Number of devices strata serves (opens the backend); 0 when none.
#[no_mangle]
pub extern "C" fn strata_preload_device_count() -> c_int {
    boundary("strata_preload_device_count", 0, || {
        glue::device_count() as c_int
    })
}
