//! The symbol table: which names the shim hooks, and the explicit `cuGetProcAddress` table of
//! (base name, version range, flags) → hook.
//!
//! Pure data and lookups: no pointers, no driver calls. `lib.rs` maps each [`Hook`] to its
//! wrapper; `real.rs` keeps the real pointer behind each one.
//!
//! Why a table and not a version ladder: `cuGetProcAddress` takes a *base* name and a CUDA
//! version, and the driver returns the newest ABI of that name not newer than the version. A
//! wrapper with another ABI's signature is memory corruption waiting to happen (HAMi-core#57,
//! #233, #320), so every (name, version range, flags) row below names the exact ABI it wraps,
//! and rows that must pass through (the 32-bit `cuMemAlloc` of CUDA < 3.2) say so explicitly.

use std::ffi::CStr;

/// Every entry point the shim interposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    /// `CUresult cuMemAlloc_v2(CUdeviceptr*, size_t)`
    MemAlloc,
    /// `CUresult cuMemFree_v2(CUdeviceptr)`
    MemFree,
    /// `CUresult cuMemAllocAsync(CUdeviceptr*, size_t, CUstream)` (legacy default stream)
    MemAllocAsync,
    /// The same ABI, per-thread default stream.
    MemAllocAsyncPtsz,
    /// `CUresult cuMemFreeAsync(CUdeviceptr, CUstream)` (legacy default stream)
    MemFreeAsync,
    /// The same ABI, per-thread default stream.
    MemFreeAsyncPtsz,
    /// `CUresult cuMemGetInfo_v2(size_t* free, size_t* total)`
    MemGetInfo,
    /// `CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t)` (CUDA 11.3 ABI)
    GetProcAddress,
    /// `CUresult cuGetProcAddress_v2(const char*, void**, int, cuuint64_t,
    /// CUdriverProcAddressQueryResult*)` (CUDA 12.0 ABI)
    GetProcAddressV2,
    /// `cudaError_t cudaMalloc(void**, size_t)`
    CudaMalloc,
    /// `cudaError_t cudaFree(void*)`
    CudaFree,
}

/// Which library a hooked name really lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// `libcuda.so.1`
    Driver,
    /// `libcudart.so*`
    Runtime,
}

impl Hook {
    /// Every hook, in slot order ([`Hook::index`]).
    pub const ALL: [Hook; 11] = [
        Hook::MemAlloc,
        Hook::MemFree,
        Hook::MemAllocAsync,
        Hook::MemAllocAsyncPtsz,
        Hook::MemFreeAsync,
        Hook::MemFreeAsyncPtsz,
        Hook::MemGetInfo,
        Hook::GetProcAddress,
        Hook::GetProcAddressV2,
        Hook::CudaMalloc,
        Hook::CudaFree,
    ];

    /// Position in [`Hook::ALL`] (slot index).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The exported symbol of the real ABI this hook wraps.
    pub fn symbol(self) -> &'static CStr {
        match self {
            Hook::MemAlloc => c"cuMemAlloc_v2",
            Hook::MemFree => c"cuMemFree_v2",
            Hook::MemAllocAsync => c"cuMemAllocAsync",
            Hook::MemAllocAsyncPtsz => c"cuMemAllocAsync_ptsz",
            Hook::MemFreeAsync => c"cuMemFreeAsync",
            Hook::MemFreeAsyncPtsz => c"cuMemFreeAsync_ptsz",
            Hook::MemGetInfo => c"cuMemGetInfo_v2",
            Hook::GetProcAddress => c"cuGetProcAddress",
            Hook::GetProcAddressV2 => c"cuGetProcAddress_v2",
            Hook::CudaMalloc => c"cudaMalloc",
            Hook::CudaFree => c"cudaFree",
        }
    }

    pub fn library(self) -> Library {
        match self {
            Hook::CudaMalloc | Hook::CudaFree => Library::Runtime,
            _ => Library::Driver,
        }
    }

    /// The hook whose exported name is `name` (what `dlsym` is asked for).
    pub fn from_symbol(name: &[u8]) -> Option<Hook> {
        // Fast reject: every hooked name starts with "cu".
        if !name.starts_with(b"cu") {
            return None;
        }
        Hook::ALL
            .into_iter()
            .find(|h| h.symbol().to_bytes() == name)
    }

    /// The per-thread-default-stream twin of a legacy-stream hook.
    pub fn per_thread_twin(self) -> Option<Hook> {
        match self {
            Hook::MemAllocAsync => Some(Hook::MemAllocAsyncPtsz),
            Hook::MemFreeAsync => Some(Hook::MemFreeAsyncPtsz),
            _ => None,
        }
    }
}

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`
pub const FLAG_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// Which `cuGetProcAddress` flags a row matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flags {
    /// Any flags (the name has no stream-flavoured variants).
    Any,
    /// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` set.
    PerThread,
    /// `CU_GET_PROC_ADDRESS_DEFAULT` or `_LEGACY_STREAM`. With `DEFAULT` the driver may still
    /// hand out the per-thread variant (a `--default-stream per-thread` build): `lib.rs` checks
    /// the pointer it got against the real `_ptsz` symbol and switches to the twin.
    NotPerThread,
}

impl Flags {
    fn matches(self, flags: u64) -> bool {
        let per_thread = flags & FLAG_PER_THREAD_DEFAULT_STREAM != 0;
        match self {
            Flags::Any => true,
            Flags::PerThread => per_thread,
            Flags::NotPerThread => !per_thread,
        }
    }
}

/// One row of the `cuGetProcAddress` table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcRow {
    /// Base name, as callers pass it (`"cuMemAlloc"`, not `"cuMemAlloc_v2"`).
    pub name: &'static str,
    /// First `cudaVersion` (major*1000 + minor*10) the row covers.
    pub since: i32,
    /// First `cudaVersion` it no longer covers (`i32::MAX`: open-ended).
    pub until: i32,
    pub flags: Flags,
    /// The wrapper to hand out, or `None`: this ABI passes through untouched.
    pub hook: Option<Hook>,
}

const OPEN: i32 = i32::MAX;

/// The explicit table. Versions are the ones in `cudaTypedefs.h` (`PFN_cuMemAlloc_v3020`,
/// `PFN_cuMemAllocAsync_v11020`, `PFN_cuGetProcAddress_v11030` / `_v12000`, ...).
pub const PROC_TABLE: &[ProcRow] = &[
    // cuMemAlloc: v1 (32-bit CUdeviceptr) before 3.2 passes through; _v2 from 3.2.
    row("cuMemAlloc", 0, 3020, Flags::Any, None),
    row("cuMemAlloc", 3020, OPEN, Flags::Any, Some(Hook::MemAlloc)),
    row("cuMemFree", 0, 3020, Flags::Any, None),
    row("cuMemFree", 3020, OPEN, Flags::Any, Some(Hook::MemFree)),
    row("cuMemGetInfo", 0, 3020, Flags::Any, None),
    row(
        "cuMemGetInfo",
        3020,
        OPEN,
        Flags::Any,
        Some(Hook::MemGetInfo),
    ),
    // Stream-ordered allocation exists from 11.2; the driver refuses older versions itself.
    row(
        "cuMemAllocAsync",
        11020,
        OPEN,
        Flags::PerThread,
        Some(Hook::MemAllocAsyncPtsz),
    ),
    row(
        "cuMemAllocAsync",
        11020,
        OPEN,
        Flags::NotPerThread,
        Some(Hook::MemAllocAsync),
    ),
    row(
        "cuMemFreeAsync",
        11020,
        OPEN,
        Flags::PerThread,
        Some(Hook::MemFreeAsyncPtsz),
    ),
    row(
        "cuMemFreeAsync",
        11020,
        OPEN,
        Flags::NotPerThread,
        Some(Hook::MemFreeAsync),
    ),
    // cuGetProcAddress itself: the 4-argument ABI from 11.3, the 5-argument one from 12.0.
    row(
        "cuGetProcAddress",
        11030,
        12000,
        Flags::Any,
        Some(Hook::GetProcAddress),
    ),
    row(
        "cuGetProcAddress",
        12000,
        OPEN,
        Flags::Any,
        Some(Hook::GetProcAddressV2),
    ),
];

const fn row(
    name: &'static str,
    since: i32,
    until: i32,
    flags: Flags,
    hook: Option<Hook>,
) -> ProcRow {
    ProcRow {
        name,
        since,
        until,
        flags,
        hook,
    }
}

/// The row for a `cuGetProcAddress(name, _, version, flags)` request; `None` for names the
/// shim does not know (they pass through, `cuGetExportTable` included).
pub fn proc_lookup(name: &[u8], version: i32, flags: u64) -> Option<&'static ProcRow> {
    if !name.starts_with(b"cu") {
        return None;
    }
    PROC_TABLE.iter().find(|r| {
        r.name.as_bytes() == name
            && r.since <= version
            && version < r.until
            && r.flags.matches(flags)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_names_map_to_hooks() {
        for h in Hook::ALL {
            assert_eq!(Hook::from_symbol(h.symbol().to_bytes()), Some(h));
            assert_eq!(Hook::ALL[h.index()], h);
        }
        assert_eq!(Hook::from_symbol(b"cuMemAlloc"), None); // v1 ABI: not hooked
        assert_eq!(Hook::from_symbol(b"cuGetExportTable"), None);
        assert_eq!(Hook::from_symbol(b"malloc"), None);
        assert_eq!(Hook::CudaFree.library(), Library::Runtime);
        assert_eq!(Hook::MemFree.library(), Library::Driver);
    }

    #[test]
    fn proc_table_picks_the_exact_abi() {
        let hook = |n: &str, v, f| proc_lookup(n.as_bytes(), v, f).and_then(|r| r.hook);
        assert_eq!(hook("cuMemAlloc", 12080, 0), Some(Hook::MemAlloc));
        assert_eq!(hook("cuMemAlloc", 3020, 0), Some(Hook::MemAlloc));
        assert_eq!(hook("cuMemAlloc", 3010, 0), None); // 32-bit v1 passes through
        assert!(proc_lookup(b"cuMemAlloc", 2000, 0).is_some()); // ... explicitly
        assert_eq!(hook("cuMemFree", 12000, 1), Some(Hook::MemFree));
        assert_eq!(hook("cuMemGetInfo", 11000, 0), Some(Hook::MemGetInfo));
        assert_eq!(hook("cuMemAllocAsync", 12000, 0), Some(Hook::MemAllocAsync));
        assert_eq!(hook("cuMemAllocAsync", 12000, 1), Some(Hook::MemAllocAsync));
        assert_eq!(
            hook("cuMemAllocAsync", 12000, 2),
            Some(Hook::MemAllocAsyncPtsz)
        );
        assert_eq!(
            hook("cuMemFreeAsync", 11020, 2),
            Some(Hook::MemFreeAsyncPtsz)
        );
        assert_eq!(hook("cuMemAllocAsync", 11010, 0), None);
        assert_eq!(
            hook("cuGetProcAddress", 11030, 0),
            Some(Hook::GetProcAddress)
        );
        assert_eq!(
            hook("cuGetProcAddress", 11080, 0),
            Some(Hook::GetProcAddress)
        );
        assert_eq!(
            hook("cuGetProcAddress", 12000, 0),
            Some(Hook::GetProcAddressV2)
        );
        assert_eq!(
            hook("cuGetProcAddress", 12080, 2),
            Some(Hook::GetProcAddressV2)
        );
        assert_eq!(hook("cuGetProcAddress", 11020, 0), None);
        assert!(proc_lookup(b"cuGetExportTable", 12080, 0).is_none());
        assert!(proc_lookup(b"cuMemAlloc_v2", 12080, 0).is_none()); // base names only
        assert_eq!(
            Hook::MemAllocAsync.per_thread_twin(),
            Some(Hook::MemAllocAsyncPtsz)
        );
        assert_eq!(Hook::MemAlloc.per_thread_twin(), None);
    }

    #[test]
    fn rows_of_one_name_never_overlap() {
        for (i, a) in PROC_TABLE.iter().enumerate() {
            for b in &PROC_TABLE[i + 1..] {
                if a.name != b.name {
                    continue;
                }
                let versions = a.since < b.until && b.since < a.until;
                let flags = [0u64, 1, 2, 3]
                    .iter()
                    .any(|&f| a.flags.matches(f) && b.flags.matches(f));
                assert!(!(versions && flags), "{a:?} overlaps {b:?}");
            }
        }
    }
}
