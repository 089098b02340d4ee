//! `cuGetProcAddress` and `cuGetProcAddress_v2`: base name and version → the emulator's entry
//! point of the ABI that version had, with the stream flavour the flags ask for.
//!
//! Unknown names: `CUDA_ERROR_NOT_FOUND` from the 11.3 ABI; `CUDA_SUCCESS` with
//! `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND` from the 12.0 ABI (what NVIDIA's 12.2 driver answers
//! for `cuMemcpyBatchAsync`, checked by the real-library tests).

use std::ffi::{c_char, c_int, c_void};

use cudarc::driver::sys::CUresult;

use crate::{api, c_str, out, Res, INVALID_VALUE};

const PER_THREAD: u64 = 2;
const ALL_FLAGS: u64 = 3;

/// `(base name, first version of this ABI, legacy-stream entry, per-thread entry)`, newest
/// ABI of a name first.
fn table() -> &'static [(&'static str, c_int, *const c_void, *const c_void)] {
    use crate::mem::*;
    use crate::stream::*;
    use crate::*;
    macro_rules! f {
        ($f:expr) => {
            $f as *const c_void
        };
    }
    struct Table(Vec<(&'static str, c_int, *const c_void, *const c_void)>);
    // SAFETY: the table holds function addresses only (never written, valid for the life of
    // the library); sharing them between threads is sound.
    unsafe impl Sync for Table {}
    // SAFETY: as above.
    unsafe impl Send for Table {}
    static TABLE: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    &TABLE
        .get_or_init(|| {
            let one = |name, since, p: *const c_void| (name, since, p, p);
            Table(vec![
                one("cuInit", 2000, f!(cuInit)),
                one("cuDriverGetVersion", 2020, f!(cuDriverGetVersion)),
                one("cuGetErrorName", 6000, f!(cuGetErrorName)),
                one("cuGetErrorString", 6000, f!(cuGetErrorString)),
                one("cuDeviceGetCount", 2000, f!(cuDeviceGetCount)),
                one("cuDeviceGet", 2000, f!(cuDeviceGet)),
                one("cuDeviceGetName", 2000, f!(cuDeviceGetName)),
                one("cuDeviceTotalMem", 3020, f!(cuDeviceTotalMem_v2)),
                one("cuDeviceGetAttribute", 2000, f!(cuDeviceGetAttribute)),
                one(
                    "cuDevicePrimaryCtxRetain",
                    7000,
                    f!(cuDevicePrimaryCtxRetain),
                ),
                one(
                    "cuDevicePrimaryCtxRelease",
                    11000,
                    f!(cuDevicePrimaryCtxRelease_v2),
                ),
                one("cuCtxSetCurrent", 4000, f!(cuCtxSetCurrent)),
                one("cuCtxGetCurrent", 4000, f!(cuCtxGetCurrent)),
                one("cuCtxGetDevice", 2000, f!(cuCtxGetDevice)),
                one("cuCtxSynchronize", 2000, f!(cuCtxSynchronize)),
                one("cuMemGetInfo", 3020, f!(cuMemGetInfo_v2)),
                one("cuMemAlloc", 3020, f!(cuMemAlloc_v2)),
                one("cuMemFree", 3020, f!(cuMemFree_v2)),
                (
                    "cuMemAllocAsync",
                    11020,
                    f!(cuMemAllocAsync),
                    f!(cuMemAllocAsync_ptsz),
                ),
                (
                    "cuMemFreeAsync",
                    11020,
                    f!(cuMemFreeAsync),
                    f!(cuMemFreeAsync_ptsz),
                ),
                one("cuMemHostAlloc", 2020, f!(cuMemHostAlloc)),
                one("cuMemFreeHost", 2000, f!(cuMemFreeHost)),
                one("cuMemAddressReserve", 10020, f!(cuMemAddressReserve)),
                one("cuMemAddressFree", 10020, f!(cuMemAddressFree)),
                one("cuMemCreate", 10020, f!(cuMemCreate)),
                one("cuMemRelease", 10020, f!(cuMemRelease)),
                one("cuMemMap", 10020, f!(cuMemMap)),
                one("cuMemUnmap", 10020, f!(cuMemUnmap)),
                one("cuMemSetAccess", 10020, f!(cuMemSetAccess)),
                one("cuMemGetAccess", 10020, f!(cuMemGetAccess)),
                one(
                    "cuMemGetAllocationGranularity",
                    10020,
                    f!(cuMemGetAllocationGranularity),
                ),
                one(
                    "cuMemGetAllocationPropertiesFromHandle",
                    10020,
                    f!(cuMemGetAllocationPropertiesFromHandle),
                ),
                one(
                    "cuMemExportToShareableHandle",
                    10020,
                    f!(cuMemExportToShareableHandle),
                ),
                one(
                    "cuMemImportFromShareableHandle",
                    10020,
                    f!(cuMemImportFromShareableHandle),
                ),
                one("cuStreamCreate", 2000, f!(cuStreamCreate)),
                one("cuStreamDestroy", 4000, f!(cuStreamDestroy_v2)),
                one("cuStreamSynchronize", 2000, f!(cuStreamSynchronize)),
                one("cuStreamWaitEvent", 3020, f!(cuStreamWaitEvent)),
                one("cuEventCreate", 2000, f!(cuEventCreate)),
                one("cuEventDestroy", 4000, f!(cuEventDestroy_v2)),
                one("cuEventRecord", 2000, f!(cuEventRecord)),
                one("cuEventQuery", 2000, f!(cuEventQuery)),
                one("cuEventSynchronize", 2000, f!(cuEventSynchronize)),
                one("cuMemcpyAsync", 4000, f!(cuMemcpyAsync)),
                one("cuMemcpyBatchAsync", 12080, f!(cuMemcpyBatchAsync)),
                one("cuMemsetD8Async", 3020, f!(cuMemsetD8Async)),
                one("cuModuleLoadData", 2000, f!(cuModuleLoadData)),
                one("cuGetProcAddress", 12000, f!(cuGetProcAddress_v2)),
                one("cuGetProcAddress", 11030, f!(cuGetProcAddress)),
            ])
        })
        .0
}

/// The entry point for `(name, version, flags)`; `None`: no such symbol at that version.
fn lookup(symbol: *const c_char, version: c_int, flags: u64) -> Res<Option<*const c_void>> {
    if flags & !ALL_FLAGS != 0 {
        return Err(INVALID_VALUE);
    }
    // SAFETY: the driver API's contract: `symbol` is a NUL-terminated string.
    let name = unsafe { c_str(symbol)? }.to_bytes();
    Ok(table()
        .iter()
        .find(|(n, since, _, _)| n.as_bytes() == name && *since <= version)
        .map(|&(_, _, legacy, per_thread)| {
            if flags & PER_THREAD != 0 {
                per_thread
            } else {
                legacy
            }
        }))
}

/// # Safety
///
/// As the driver's `cuGetProcAddress` (CUDA 11.3 ABI).
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *const c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    api(|| match lookup(symbol, version, flags)? {
        Some(p) => out(pfn, p),
        None => {
            out(pfn, std::ptr::null())?;
            Err(CUresult::CUDA_ERROR_NOT_FOUND)
        }
    })
}

/// # Safety
///
/// As the driver's `cuGetProcAddress_v2` (CUDA 12.0 ABI): `status` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *const c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    api(|| {
        let found = lookup(symbol, version, flags)?;
        out(pfn, found.unwrap_or(std::ptr::null()))?;
        if !status.is_null() {
            // CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND
            out(status, if found.is_some() { 0 } else { 1 })?;
        }
        Ok(())
    })
}
