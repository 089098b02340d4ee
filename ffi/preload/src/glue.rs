//! The allocator glue: the process's [`Runtime`] over strata's backend ([`strata_vmm::global`],
//! so `STRATA_BACKEND=host` serves from the host emulation) and each device's
//! [`CachingAllocator`] in it, created on first use and asked for once
//! ([`DeviceRuntime::allocator_once`](strata_runtime::DeviceRuntime::allocator_once)).
//!
//! Nothing here knows about CUDA ABIs: `lib.rs` turns the outcomes into `CUresult`s.
//!
//! Re-entrancy: while strata's own code runs on a thread (opening the backend loads the real
//! driver through `dlsym`; the CUDA backend calls `cuMemGetInfo_v2`), [`Inside`] is held and
//! every hook on that thread passes through to the real function, so strata never ends up
//! serving itself.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use strata_allocator::{AllocatorStats, CachingAllocator, CachingConfig, PoolConfig};
use strata_runtime::{DeviceRuntime, Runtime, RuntimeConfig};
use strata_vmm::{DevicePtr, Error, StreamHandle};

use crate::config::{self, log};

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Marks this thread as running strata's own code while alive.
pub struct Inside(());

impl Inside {
    pub fn enter() -> Inside {
        DEPTH.with(|d| d.set(d.get() + 1));
        Inside(())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// True while this thread runs strata's own code (hooks must pass through).
pub fn inside() -> bool {
    DEPTH.with(|d| d.get() > 0)
}

/// True when hooks should serve from strata on this thread. In a child forked after the shim
/// opened its backend, never: the child's hooks pass through to the real driver, which answers
/// as it does after fork (CUDA refuses a context inherited over fork), and the parent's pools
/// are never served to the child (that would alias the parent's memory).
pub fn active() -> bool {
    !config::get().disable && !inside() && !strata_vmm::fork::forked()
}

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// Whether the backend was opened (introspection: lookups alone must not initialize anything).
pub fn initialized() -> bool {
    INITIALIZED.load(Ordering::Acquire)
}

/// The process's runtime, opened on first use; `None` when no backend opens (asked once).
fn shim() -> Option<&'static Runtime> {
    static SHIM: OnceLock<Option<&'static Runtime>> = OnceLock::new();
    *SHIM.get_or_init(|| {
        let _inside = Inside::enter();
        INITIALIZED.store(true, Ordering::Release);
        match strata_runtime::global(runtime_config) {
            Ok(runtime) => {
                let n = runtime.device_count();
                log!("backend {} with {n} device(s)", runtime.backend().kind());
                crate::ops::start();
                Some(runtime)
            }
            Err(e) => {
                eprintln!("strata-preload: no strata backend ({e}); passing allocations through");
                None
            }
        }
    })
}

fn runtime_config() -> RuntimeConfig {
    let limit = config::get().limit;
    RuntimeConfig {
        pool: PoolConfig {
            // No background thread and no idle pages: the shim holds what it serves.
            low_watermark: 0,
            high_watermark: 0,
            limit,
            idle_trim_after: None,
            background: false,
        },
        caching: CachingConfig {
            limit,
            report_leaks: false,
            ..CachingConfig::default()
        },
    }
}

/// The process's runtime, if the shim opened it (figures).
pub fn runtime() -> Option<&'static Runtime> {
    initialized().then(shim).flatten()
}

/// The allocator of `device`, created on first use; `None` when strata cannot serve it.
pub fn allocator(device: u32) -> Option<&'static CachingAllocator> {
    let d = shim()?.devices().get(device as usize)?;
    if let Some(a) = d.existing_allocator() {
        return Some(a);
    }
    let _inside = Inside::enter();
    d.allocator_once(|e| {
        eprintln!("strata-preload: no allocator for device {device} ({e}); passing through")
    })
}

/// The allocators created so far.
fn created() -> impl Iterator<Item = &'static CachingAllocator> {
    let devices: &'static [DeviceRuntime] = if initialized() {
        shim().map(Runtime::devices).unwrap_or_default()
    } else {
        &[]
    };
    devices.iter().filter_map(DeviceRuntime::existing_allocator)
}

/// What an allocation request came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Alloc {
    Served(DevicePtr),
    /// strata is out of memory (or at `STRATA_PRELOAD_LIMIT`): the caller reports OOM.
    OutOfMemory,
    /// strata cannot serve this one: call the real function.
    PassThrough,
}

/// Serves `size` (> 0) bytes on `device` from strata.
pub fn allocate(size: u64, device: u32) -> Alloc {
    let Some(alloc) = allocator(device) else {
        return Alloc::PassThrough;
    };
    let _inside = Inside::enter();
    match alloc.allocate(size, StreamHandle::DEFAULT) {
        Ok(ptr) => Alloc::Served(ptr),
        Err(e) if e.is_out_of_memory() => {
            log!("out of memory for {size} bytes on device {device}: {e}");
            Alloc::OutOfMemory
        }
        Err(e) => {
            eprintln!("strata-preload: allocation of {size} bytes failed ({e}); passing through");
            Alloc::PassThrough
        }
    }
}

/// The allocator whose arena holds `ptr` (whether or not `ptr` is live).
pub fn owner(ptr: DevicePtr) -> Option<&'static CachingAllocator> {
    created().find(|a| {
        let (start, size) = a.arena();
        ptr >= start && ptr - start < size
    })
}

/// True when `ptr` is a live strata allocation.
pub fn owns(ptr: DevicePtr) -> bool {
    owner(ptr).is_some_and(|a| a.size_of(ptr).is_ok())
}

/// What a free request came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Free {
    Freed,
    /// In strata's arena but not a live allocation (double or interior free).
    Invalid,
    /// Not strata's: call the real function.
    Foreign,
}

/// Frees `ptr` if strata owns it; `sync` runs first (waits for work that may still use it).
pub fn free(ptr: DevicePtr, sync: impl FnOnce() -> i32) -> Free {
    let Some(alloc) = owner(ptr) else {
        return Free::Foreign;
    };
    let rc = sync();
    if rc != 0 {
        log!("synchronize before freeing {ptr:#x} returned {rc}");
    }
    let _inside = Inside::enter();
    match alloc.deallocate(ptr, StreamHandle::DEFAULT) {
        Ok(()) => Free::Freed,
        Err(e @ (Error::UnknownPointer(_) | Error::DoubleFree(_))) => {
            log!("free of {ptr:#x}: {e}");
            Free::Invalid
        }
        Err(e) => {
            eprintln!("strata-preload: free of {ptr:#x} failed: {e}");
            Free::Invalid
        }
    }
}

/// `(free, total)` of `device` as strata serves it: total is the device's memory; free is what
/// one large allocation can get: the device's free memory plus the pages strata holds that a
/// large allocation can take (cached large runs, empty small segments and the pool's free
/// pages), capped under the
/// limit by what is left of it. Free room inside pages of small blocks is not counted (a
/// large allocation cannot use it). It only falls while allocations are made and rises when
/// they are freed.
pub fn mem_info(device: u32) -> Option<(u64, u64)> {
    let runtime = shim()?;
    let _inside = Inside::enter();
    let backend = runtime.backend();
    let info = backend.device_info(device).ok()?;
    let device_free = backend.mem_info(device).ok()?.free;
    let total = info.total_memory;
    let allocator = runtime
        .devices()
        .get(device as usize)
        .and_then(DeviceRuntime::existing_allocator);
    let (takeable, held) = match allocator {
        Some(a) => {
            let s = a.stats();
            let pool = a.pool().stats();
            let pool_free = pool.free as u64 * pool.page_size;
            // What strata holds: mapped pages plus the pool's free ones.
            let cached = s.cached_large_bytes + s.cached_small_bytes;
            (cached + pool_free, s.reserved_bytes + pool_free)
        }
        _ => (0, 0),
    };
    let mut free = device_free.saturating_add(takeable);
    // The allocator's cap once it exists (`strata limit` changes it), else the configured one.
    let limit = match allocator {
        Some(a) => a.limit(),
        None => config::get().limit,
    };
    if let Some(limit) = limit {
        free = free.min(limit.saturating_sub(held).saturating_add(takeable));
    }
    Some((free.min(total), total))
}

/// A snapshot of `device`'s allocator, if created.
pub fn stats(device: u32) -> Option<AllocatorStats> {
    let a = created().find(|a| a.pool().device() == device)?;
    let _inside = Inside::enter();
    Some(a.stats())
}

/// Number of devices strata serves (opens the backend).
pub fn device_count() -> u32 {
    shim().map_or(0, |s| s.device_count() as u32)
}
