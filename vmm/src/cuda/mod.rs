//! The CUDA backend on cudarc's `driver::sys`, through our result layer ([`result`]).
//!
//! - Works on each device's **primary context** (retained in [`CudaBackend::new`], released on
//!   drop unless the process is exiting) and makes the right one current on the calling thread
//!   before each driver call.
//! - Enforces the [`Backend`] preconditions *before* calling the driver, with the same
//!   backend-independent `VaTable` the host backend uses (check, call, record), so both report
//!   the same typed errors and the driver never sees a call that breaks the contract.
//! - Never panics on a machine without CUDA: every driver call goes through
//!   [`result::call`], which turns cudarc's "library/symbol missing" panic into
//!   [`Error::NoDriver`].
//! - Runs [`DeviceWork`] (`cuda/work.rs`): the block-copy kernel (`cuda/launch.rs`), which NVRTC
//!   (`cuda/nvrtc.rs`) compiles once per device on first use, and cuBLAS (`cuda/blas.rs`).
//!   Without NVRTC (or a kernel the driver refuses) `copy_blocks_async` is
//!   [`Error::Unsupported`] and callers fall back to DMA. Pairs that touch pageable host memory
//!   (not from `host_alloc`) go to the DMA engines, which can reach it where a kernel cannot.
//!
//! Handles: [`PhysHandle`] is the `CUmemGenericAllocationHandle` value; [`StreamHandle`] is the
//! `CUstream` pointer value (0 = the legacy default stream); [`EventHandle`] is the pointer value
//! of the event created in device 0's context (more per-device events are made on demand, since
//! an event can only be recorded on a stream of its own context).
//!
//! Layout: this file holds the backend's state, construction, teardown and the [`Backend`] impl,
//! whose calls delegate by concern to `vmm.rs` (reservations, physical handles, mappings,
//! access), `share.rs` (fd export and import), `streams.rs` (streams, events) and `copies.rs`
//! (copies, fills, pinned host memory).

mod blas;
#[cfg(test)]
mod child;
mod copies;
#[cfg(test)]
mod emulated;
mod launch;
mod malloc_async;
pub mod nvrtc;
#[cfg(test)]
mod real_libs;
pub mod result;
mod share;
mod streams;
#[cfg(test)]
mod tests;
mod vmm;
mod work;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{
    Access, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, EventHandle, LiveCounts,
    Location, MemInfo, PhysHandle, StreamHandle,
};
use crate::vatable::VaTable;
use crate::work::DeviceWork;

pub use malloc_async::MallocAsync;
use result::CUcontext;

/// A retained primary context.
#[derive(Clone, Copy, Debug)]
struct Ctx(CUcontext);

// SAFETY: a `CUcontext` is an opaque driver handle, not memory this process dereferences; the
// driver API is thread-safe and explicitly allows making one context current on any number of
// threads (`cuCtxSetCurrent`). The backend keeps the context retained for its own lifetime.
unsafe impl Send for Ctx {}
// SAFETY: see `Send`: shared references only copy the handle value out.
unsafe impl Sync for Ctx {}

/// One device, its primary context and its fixed properties.
#[derive(Debug)]
struct Device {
    cu: sys::CUdevice,
    ctx: Ctx,
    name: String,
    total: u64,
    granularity: u64,
}

/// A physical handle this backend created or imported.
#[derive(Clone, Copy, Debug)]
struct HandleInfo {
    location: Location,
    size: u64,
    exportable: bool,
    /// References this backend holds to the same driver handle value (an import of our own
    /// export may come back as the same value): each one is released once.
    refs: u32,
}

use streams::{EventObj, StreamObj};

/// Bookkeeping protected by one lock (held across VMM driver calls so that check, call and
/// record are atomic with respect to other threads).
#[derive(Debug, Default)]
struct State {
    table: VaTable,
    handles: HashMap<u64, HandleInfo>,
    streams: HashMap<u64, Arc<StreamObj>>,
    events: HashMap<u64, Arc<EventObj>>,
    /// Live `host_alloc` allocations (pinned, device-reachable): start → size.
    pinned: BTreeMap<u64, u64>,
}

impl State {
    /// True when `addr..addr+len` lies inside one pinned allocation of ours (a kernel can reach
    /// it at the same address; pageable memory it cannot).
    fn pinned_contains(&self, addr: u64, len: u64) -> bool {
        self.pinned
            .range(..=addr)
            .next_back()
            .is_some_and(|(&p, &s)| {
                addr.checked_add(len)
                    .is_some_and(|end| end <= p.saturating_add(s))
            })
    }
}

/// The CUDA driver, primary contexts of every device.
pub struct CudaBackend {
    devices: Vec<Device>,
    driver_version: i32,
    host_granularity: OnceLock<std::result::Result<u64, String>>,
    batch: Option<result::memcpy::BatchFn>,
    batch_enabled: std::sync::atomic::AtomicBool,
    /// The block-copy kernel per device, compiled on first use; a failure is kept as the
    /// message of the [`Error::Unsupported`] every later launch returns.
    launchers: Vec<OnceLock<std::result::Result<launch::Launcher, String>>>,
    state: Mutex<State>,
    /// cuBLAS handles for `gemm_f32_async`, one per device, created on first use.
    blas: blas::Handles,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("devices", &self.devices)
            .field("driver_version", &self.driver_version)
            .field("batch_copies", &self.batch.is_some())
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Loads the driver, initializes it and retains every device's primary context.
    ///
    /// [`Error::NoDriver`] when no CUDA driver library can be loaded, it lacks a symbol we need,
    /// or it reports no device.
    pub fn new() -> Result<Self> {
        crate::raii::install_exit_hook();
        result::init()?;
        let driver_version = result::driver_version()?;
        let count = result::device::count()?;
        if count <= 0 {
            return Err(Error::NoDriver("the CUDA driver reports no device".into()));
        }
        let mut devices: Vec<Device> = Vec::with_capacity(count as usize);
        // On failure part way, `Retained` releases what was retained so far.
        let mut retained = Retained(Vec::new());
        for ordinal in 0..count {
            let cu = result::device::get(ordinal)?;
            let ctx = result::ctx::retain_primary(cu)?;
            retained.0.push(cu);
            // SAFETY: `ctx` was just retained and stays retained until `Retained` or the
            // backend's `Drop` releases it.
            unsafe { result::ctx::set_current(ctx)? };
            let name = result::device::name(cu)?;
            let total = result::device::total_mem(cu)?;
            let prop = result::phys::prop(device_location(ordinal as u32), false);
            let granularity = result::phys::granularity(&prop)?;
            if granularity == 0 {
                return Err(Error::Unsupported(format!(
                    "device {ordinal} reports a zero VMM granularity"
                )));
            }
            devices.push(Device {
                cu,
                ctx: Ctx(ctx),
                name,
                total,
                granularity,
            });
        }
        // Success: the backend owns the retains now (released in its `Drop`).
        retained.0.clear();
        let batch = result::memcpy::batch_fn();
        Ok(CudaBackend {
            devices,
            driver_version,
            host_granularity: OnceLock::new(),
            batch,
            batch_enabled: std::sync::atomic::AtomicBool::new(batch.is_some()),
            launchers: (0..count).map(|_| OnceLock::new()).collect(),
            state: Mutex::new(State::default()),
            blas: blas::Handles::new(count as usize),
        })
    }

    /// The driver's CUDA version (`12080` for 12.8).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// True when copies go through `cuMemcpyBatchAsync` (driver ≥ 12.8 exporting it).
    pub fn batch_copies(&self) -> bool {
        self.batch.is_some()
            && self
                .batch_enabled
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn device(&self, device: u32) -> Result<&Device> {
        self.devices
            .get(device as usize)
            .ok_or(Error::NoDevice(i64::from(device)))
    }

    /// Makes `device`'s primary context current on this thread.
    fn enter(&self, device: u32) -> Result<&Device> {
        let dev = self.device(device)?;
        // SAFETY: the context is retained for the backend's lifetime (released only in `Drop`).
        unsafe { result::ctx::set_current(dev.ctx.0)? };
        Ok(dev)
    }

    /// The device whose context serves a location (host memory: device 0).
    fn device_for(&self, location: Location) -> Result<u32> {
        match location {
            Location::Device(d) => self.device(d).map(|_| d),
            Location::Host => Ok(0),
        }
    }

    fn host_granularity(&self) -> Result<u64> {
        let got = self.host_granularity.get_or_init(|| {
            if self.driver_version < HOST_NUMA_DRIVER {
                return Err(format!(
                    "host VMM memory (CU_MEM_LOCATION_TYPE_HOST_NUMA) needs a CUDA 12.2+ driver; \
                     this one is {}.{}",
                    self.driver_version / 1000,
                    self.driver_version % 1000 / 10
                ));
            }
            let query = || -> Result<u64> {
                self.enter(0)?;
                let prop = result::phys::prop(host_location(), false);
                result::phys::granularity(&prop)
            };
            match query() {
                Ok(0) => Err("the driver reports a zero host granularity".into()),
                Ok(g) => Ok(g),
                Err(e) => Err(format!(
                    "host VMM memory (CU_MEM_LOCATION_TYPE_HOST_NUMA, CUDA 12.2+): {e}"
                )),
            }
        });
        got.clone().map_err(Error::Unsupported)
    }
}

/// Releases primary contexts retained by a half-built backend.
struct Retained(Vec<sys::CUdevice>);

impl Drop for Retained {
    fn drop(&mut self) {
        for &cu in &self.0 {
            // SAFETY: each entry is one retain this constructor made and nothing of the context
            // was published; the release balances it exactly.
            let _ = unsafe { result::ctx::release_primary(cu) };
        }
    }
}

/// A scratch reservation freed on drop (import size probe).
struct Scratch {
    va: u64,
    size: u64,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: our own reservation, every probe mapping was unmapped (or failed to map) before
        // this runs, and nothing else knows the address.
        if let Err(e) = unsafe { result::va::free(self.va, self.size) } {
            crate::raii::record_deferred(e);
        }
    }
}

fn device_location(device: u32) -> result::CUmemLocation {
    result::phys::location(
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        device as i32,
    )
}

/// First driver version (`cuDriverGetVersion`) with `CU_MEM_LOCATION_TYPE_HOST_NUMA` in
/// `cuMemCreate` (12.2).
const HOST_NUMA_DRIVER: i32 = 12020;

fn host_location() -> result::CUmemLocation {
    result::phys::location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)
}

fn host_total_bytes() -> u64 {
    // SAFETY: `sysconf` only reads system configuration values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if crate::raii::process_is_exiting() {
            return;
        }
        for d in 0..self.launchers.len() {
            if let Some(Ok(launcher)) = self.launchers[d].take() {
                // Its slots, memory and module belong to this device's context.
                match self.enter(d as u32) {
                    Ok(_) => drop(launcher),
                    Err(e) => {
                        crate::raii::record_deferred(e);
                        std::mem::forget(launcher);
                    }
                }
            }
        }
        self.destroy_blas_handles();
        for dev in &self.devices {
            // SAFETY: `new` retained each primary context exactly once; this is the matching
            // release, and nothing of this backend uses the context afterwards (`&mut self`).
            if let Err(e) = unsafe { result::ctx::release_primary(dev.cu) } {
                crate::raii::record_deferred(e);
            }
        }
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn device_info(&self, device: u32) -> Result<DeviceInfo> {
        let dev = self.device(device)?;
        Ok(DeviceInfo {
            ordinal: device,
            name: dev.name.clone(),
            total_memory: dev.total,
            granularity: dev.granularity,
        })
    }

    fn granularity(&self, location: Location) -> Result<u64> {
        match location {
            Location::Device(d) => Ok(self.device(d)?.granularity),
            Location::Host => self.host_granularity(),
        }
    }

    fn mem_info(&self, device: u32) -> Result<MemInfo> {
        self.enter(device)?;
        let (free, total) = result::mem::get_info()?;
        Ok(MemInfo { free, total })
    }

    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.reserve_va(size, alignment)
    }

    fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.free_reservation(ptr, size)
    }

    fn create(&self, location: Location, size: u64, flags: CreateFlags) -> Result<PhysHandle> {
        self.create_handle(location, size, flags)
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.release_handle(handle)
    }

    fn handle_size(&self, handle: PhysHandle) -> Result<u64> {
        let state = self.state.lock();
        state
            .handles
            .get(&handle.0)
            .map(|h| h.size)
            .ok_or(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            })
    }

    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        self.map_handle(va, size, handle, offset)
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> Result<()> {
        self.unmap_range(va, size)
    }

    fn set_access(&self, va: DevicePtr, size: u64, grants: &[(Location, Access)]) -> Result<()> {
        self.set_range_access(va, size, grants)
    }

    fn export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.export_handle(handle)
    }

    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle> {
        self.import_handle(fd)
    }

    fn stream_create(&self, device: u32) -> Result<StreamHandle> {
        self.create_stream(device)
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.destroy_stream(stream)
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.synchronize_stream(stream)
    }

    fn event_create(&self) -> Result<EventHandle> {
        self.create_event()
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.destroy_event(event)
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.record_event(event, stream)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.query_event(event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.synchronize_event(event)
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.wait_event(stream, event)
    }

    unsafe fn copy_async(&self, stream: StreamHandle, copies: &[CopyDesc]) -> Result<()> {
        // SAFETY: the caller upholds this method's `# Safety` list, which is the callee's.
        unsafe { self.queue_copies(stream, copies) }
    }

    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        self.queue_memset(stream, dst, value, len)
    }

    fn host_alloc(&self, size: u64) -> Result<DevicePtr> {
        self.alloc_pinned(size)
    }

    unsafe fn host_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        // SAFETY: the caller upholds this method's `# Safety` list, which is the callee's.
        unsafe { self.free_pinned(ptr, size) }
    }

    fn device_work(self: Arc<Self>) -> Option<Arc<dyn DeviceWork>> {
        Some(self)
    }

    fn live_counts(&self) -> LiveCounts {
        let state = self.state.lock();
        LiveCounts {
            reservations: state.table.reservation_count(),
            handles: state.handles.values().map(|h| u64::from(h.refs)).sum(),
            mappings: state.table.mapping_count(),
            streams: state.streams.len() as u64,
            events: state.events.len() as u64,
        }
    }
}

/// Opens the CUDA backend as a trait object.
pub fn open() -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(CudaBackend::new()?))
}
