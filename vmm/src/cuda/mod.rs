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

mod blas;
#[cfg(test)]
mod child;
#[cfg(test)]
mod emulated;
mod launch;
pub mod nvrtc;
#[cfg(test)]
mod real_libs;
pub mod result;
mod work;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::{Mutex, RwLock};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{
    Access, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, EventHandle, LiveCounts,
    Location, MemInfo, PhysHandle, StreamHandle,
};
use crate::vatable::{Accessor, Translation, VaTable};
use crate::work::DeviceWork;
use result::{CUcontext, CUevent, CUmemAccessDesc, CUresult, CUstream};

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

/// A stream; `alive` (under `gate`) guards against use after destroy from another thread.
#[derive(Debug)]
struct StreamObj {
    device: u32,
    raw: u64,
    gate: RwLock<bool>,
}

/// Per-device driver events behind one [`EventHandle`].
#[derive(Debug)]
struct EventState {
    /// The event in each device's context, created on first record there (0: none yet).
    per_device: Vec<u64>,
    /// The device whose event was recorded last (`None`: never recorded, i.e. complete).
    last: Option<u32>,
}

#[derive(Debug)]
struct EventObj {
    gate: RwLock<bool>,
    state: Mutex<EventState>,
}

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

    /// Granularity used for VA-only rules (reservations): the largest of the devices'.
    fn va_granularity(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.granularity)
            .max()
            .unwrap_or(1)
    }

    /// Granularity for `unmap`/`set_access`: the smallest of the known ones. Whole mappings are
    /// aligned to their own location's granularity already (checked at `map`); a sub-range that
    /// is aligned to this but not to its memory's granularity is refused by the driver.
    fn range_granularity(&self) -> u64 {
        let device_min = self
            .devices
            .iter()
            .map(|d| d.granularity)
            .min()
            .unwrap_or(1);
        match self.host_granularity.get() {
            Some(Ok(host)) => device_min.min(*host),
            _ => device_min,
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

    fn out_of_memory(&self, location: Location, requested: u64) -> Error {
        let available = match location {
            Location::Device(d) => self.mem_info(d).map(|m| m.free).unwrap_or(0),
            Location::Host => host_available_bytes(),
        };
        Error::OutOfMemory {
            location,
            requested,
            available,
        }
    }

    fn access_desc(&self, location: Location, access: Access) -> Result<CUmemAccessDesc> {
        let location = match location {
            Location::Device(d) => {
                self.device(d)?;
                device_location(d)
            }
            Location::Host => host_location(),
        };
        Ok(CUmemAccessDesc {
            location,
            flags: result::access::flags(access),
        })
    }

    /// Finds the stream; the returned object's gate must be read-locked by the caller.
    fn stream_obj(&self, stream: StreamHandle) -> Result<Option<Arc<StreamObj>>> {
        if stream == StreamHandle::DEFAULT {
            return Ok(None);
        }
        let state = self.state.lock();
        state
            .streams
            .get(&stream.0)
            .cloned()
            .map(Some)
            .ok_or(Error::InvalidHandle {
                kind: "stream",
                id: stream.0,
            })
    }

    /// Runs `f` on the raw event of `event`'s last record, with that record's device current
    /// and the event's gate held (so no other thread destroys it meanwhile); `unrecorded` when it
    /// was never recorded (complete, as CUDA reports it).
    fn with_last_record<T>(
        &self,
        event: EventHandle,
        unrecorded: T,
        f: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        let obj = self.event_obj(event)?;
        let alive = obj.gate.read();
        if !*alive {
            return Err(Error::InvalidHandle {
                kind: "event",
                id: event.0,
            });
        }
        let (device, raw) = {
            let st = obj.state.lock();
            match st.last {
                None => return Ok(unrecorded),
                Some(d) => (d, st.per_device[d as usize]),
            }
        };
        self.enter(device)?;
        f(raw)
    }

    fn event_obj(&self, event: EventHandle) -> Result<Arc<EventObj>> {
        let state = self.state.lock();
        state
            .events
            .get(&event.0)
            .cloned()
            .ok_or(Error::InvalidHandle {
                kind: "event",
                id: event.0,
            })
    }

    /// Runs `f` with the stream's device context current and its raw handle, holding the
    /// stream's gate so that no other thread destroys it meanwhile. The default stream runs on
    /// `default_device`.
    fn with_stream<R>(
        &self,
        stream: StreamHandle,
        default_device: u32,
        f: impl FnOnce(u32, CUstream) -> Result<R>,
    ) -> Result<R> {
        let obj = self.stream_obj(stream)?;
        match obj {
            None => {
                self.enter(default_device)?;
                f(default_device, std::ptr::null_mut())
            }
            Some(obj) => {
                let alive = obj.gate.read();
                if !*alive {
                    return Err(Error::InvalidHandle {
                        kind: "stream",
                        id: stream.0,
                    });
                }
                self.enter(obj.device)?;
                f(obj.device, raw_stream(obj.raw))
            }
        }
    }

    /// Validates every copy for `accessor` and returns the coalesced `(dst, src, len)` list.
    fn plan_copies(
        table: &VaTable,
        accessor: Accessor,
        copies: &[CopyDesc],
    ) -> Result<Vec<(u64, u64, u64)>> {
        let mut plan: Vec<(u64, u64, u64)> = Vec::with_capacity(copies.len());
        for c in copies {
            if c.len == 0 {
                continue;
            }
            table.translate(c.dst, c.len, accessor, Access::ReadWrite)?;
            table.translate(c.src, c.len, accessor, Access::Read)?;
            if let Some(last) = plan.last_mut() {
                let dst_next = last.0.checked_add(last.2);
                let src_next = last.1.checked_add(last.2);
                if dst_next == Some(c.dst) && src_next == Some(c.src) {
                    if let Some(len) = last.2.checked_add(c.len) {
                        last.2 = len;
                        continue;
                    }
                }
            }
            plan.push((c.dst, c.src, c.len));
        }
        Ok(plan)
    }

    /// The device a created stream belongs to.
    fn stream_device(state: &State, stream: StreamHandle) -> Result<u32> {
        state
            .streams
            .get(&stream.0)
            .map(|s| s.device)
            .ok_or(Error::InvalidHandle {
                kind: "stream",
                id: stream.0,
            })
    }

    /// The device that runs work on `stream` and what `check` returns for it: a created
    /// stream's own device; for the default stream, the first device for which `check` passes
    /// (else the error device 0 gets).
    fn device_for_work<T>(
        &self,
        state: &State,
        stream: StreamHandle,
        check: impl Fn(Accessor) -> Result<T>,
    ) -> Result<(u32, T)> {
        let accessor = |d: u32| Accessor::Location(Location::Device(d));
        if stream != StreamHandle::DEFAULT {
            let d = Self::stream_device(state, stream)?;
            return check(accessor(d)).map(|t| (d, t));
        }
        for d in 0..self.devices.len() as u32 {
            if let Ok(t) = check(accessor(d)) {
                return Ok((d, t));
            }
        }
        check(accessor(0)).map(|t| (0, t))
    }

    /// Submits a validated plan on `raw` (context current).
    ///
    /// # Safety
    ///
    /// 1. Every range of `plan` satisfies [`result::memcpy::copy_async`]'s conditions.
    /// 2. `raw` is null or a live stream whose context is current.
    unsafe fn submit(&self, plan: &[(u64, u64, u64)], raw: CUstream) -> Result<()> {
        use std::sync::atomic::Ordering;
        if plan.len() > 1 && !raw.is_null() && self.batch_enabled.load(Ordering::Relaxed) {
            if let Some(f) = self.batch {
                let mut dsts: Vec<u64> = plan.iter().map(|p| p.0).collect();
                let mut srcs: Vec<u64> = plan.iter().map(|p| p.1).collect();
                let mut lens: Vec<usize> = plan
                    .iter()
                    .map(|p| result::to_usize(p.2, "copy length"))
                    .collect::<Result<_>>()?;
                // SAFETY: the caller guarantees every range and that `raw` is a live non-null
                // stream with its context current; `f` is the driver's own symbol.
                let got =
                    unsafe { result::memcpy::batch_async(f, &mut dsts, &mut srcs, &mut lens, raw) };
                match got {
                    Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_NOT_SUPPORTED) => {
                        // The driver exports the symbol but refuses batches here: stop trying.
                        self.batch_enabled.store(false, Ordering::Relaxed);
                    }
                    other => return other,
                }
            }
        }
        for &(dst, src, len) in plan {
            // SAFETY: as above, per copy.
            unsafe { result::memcpy::copy_async(dst, src, len, raw)? };
        }
        Ok(())
    }

    /// Finds the size of an imported handle: the largest `k * granularity` that maps at offset
    /// 0, by binary search on a scratch reservation (the driver has no size query for handles).
    fn probe_handle_size(&self, handle: u64, location: Location, granularity: u64) -> Result<u64> {
        let bound = match location {
            Location::Device(d) => self.device(d)?.total,
            Location::Host => host_total_bytes(),
        };
        let max_units = (bound / granularity).max(1);
        let span = max_units
            .checked_mul(granularity)
            .ok_or(Error::Overflow("probe span"))?;
        self.enter(self.device_for(location)?)?;
        let va = result::va::reserve(span, granularity)?;
        let scratch = Scratch { va, size: span };
        let fits = |units: u64| -> Result<bool> {
            let size = units * granularity;
            // SAFETY: `scratch` is our own fresh reservation of `span >= size` bytes with nothing
            // mapped; `handle` is live (just imported, not yet published).
            match unsafe { result::map::map(scratch.va, size, 0, handle) } {
                Ok(()) => {
                    // SAFETY: the mapping was just made, covers exactly this range, and nothing
                    // has access to it.
                    unsafe { result::map::unmap(scratch.va, size)? };
                    Ok(true)
                }
                Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_INVALID_VALUE) => Ok(false),
                Err(e) => Err(e),
            }
        };
        if !fits(1)? {
            return Err(Error::Unsupported(
                "imported handle: cannot map even one granule to find its size".into(),
            ));
        }
        // Invariant: `lo` units map, `hi` units do not (`max_units + 1` is beyond the bound).
        let (mut lo, mut hi) = (1u64, max_units + 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        drop(scratch);
        Ok(lo * granularity)
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

fn raw_stream(raw: u64) -> CUstream {
    raw as usize as CUstream
}

fn raw_event(raw: u64) -> CUevent {
    raw as usize as CUevent
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

fn location_from(loc: &result::CUmemLocation) -> Result<Location> {
    match loc.type_ {
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => u32::try_from(loc.id)
            .map(Location::Device)
            .map_err(|_| Error::InvalidArgument(format!("device id {}", loc.id))),
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        | sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA
        | sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Ok(Location::Host),
        other => Err(Error::Unsupported(format!(
            "imported handle at location type {other:?}"
        ))),
    }
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

fn host_available_bytes() -> u64 {
    // SAFETY: `sysconf` only reads system configuration values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_AVPHYS_PAGES),
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
        let alignment = VaTable::check_reserve(size, alignment, self.va_granularity())?;
        self.enter(0)?;
        let mut state = self.state.lock();
        let ptr = match result::va::reserve(size, alignment) {
            Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                return Err(Error::OutOfAddressSpace { requested: size })
            }
            other => other?,
        };
        if let Err(e) = state.table.add_reservation(ptr, size) {
            // SAFETY: the reservation was just made, nothing is mapped in it and nobody else
            // has seen its address.
            let _ = unsafe { result::va::free(ptr, size) };
            return Err(e);
        }
        Ok(ptr)
    }

    fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut state = self.state.lock();
        state.table.check_free(ptr, size)?;
        self.enter(0)?;
        // SAFETY: the table confirms `(ptr, size)` is exactly one live reservation of ours with
        // nothing mapped inside; the caller's contract (precondition 2, 4) covers in-flight work.
        unsafe { result::va::free(ptr, size)? };
        state.table.remove_reservation(ptr, size)
    }

    fn create(&self, location: Location, size: u64, flags: CreateFlags) -> Result<PhysHandle> {
        let granularity = self.granularity(location)?;
        if size == 0 {
            return Err(Error::InvalidArgument("size must not be zero".into()));
        }
        if size % granularity != 0 {
            return Err(Error::Misaligned {
                what: "size",
                value: size,
                granularity,
            });
        }
        let device = self.device_for(location)?;
        let bound = match location {
            Location::Device(d) => self.device(d)?.total,
            Location::Host => host_total_bytes(),
        };
        if size > bound {
            return Err(self.out_of_memory(location, size));
        }
        let cu_location = match location {
            Location::Device(d) => device_location(d),
            Location::Host => host_location(),
        };
        let exportable = flags.contains(CreateFlags::EXPORTABLE);
        let prop = result::phys::prop(cu_location, exportable);
        self.enter(device)?;
        let handle = match result::phys::create(size, &prop) {
            Ok(h) => h,
            Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                return Err(self.out_of_memory(location, size));
            }
            Err(e)
                if location == Location::Host
                    && result::is_code(&e, CUresult::CUDA_ERROR_NOT_SUPPORTED) =>
            {
                return Err(Error::Unsupported(format!("host VMM memory: {e}")));
            }
            Err(e) => return Err(e),
        };
        let mut state = self.state.lock();
        let entry = state.handles.entry(handle).or_insert(HandleInfo {
            location,
            size,
            exportable,
            refs: 0,
        });
        entry.refs += 1;
        Ok(PhysHandle(handle))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let mut state = self.state.lock();
        let Some(info) = state.handles.get_mut(&handle.0) else {
            return Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            });
        };
        let device = self.device_for(info.location)?;
        self.enter(device)?;
        // SAFETY: the handle is live (we hold a reference to it, counted in `refs`) and this
        // releases exactly one of those references; mappings of it stay valid (precondition 6).
        unsafe { result::phys::release(handle.0)? };
        info.refs -= 1;
        if info.refs == 0 {
            state.handles.remove(&handle.0);
        }
        Ok(())
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
        let mut state = self.state.lock();
        let Some(info) = state.handles.get(&handle.0).copied() else {
            return Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            });
        };
        let granularity = self.granularity(info.location)?;
        state
            .table
            .check_map(va, size, offset, info.size, granularity)?;
        self.enter(self.device_for(info.location)?)?;
        // SAFETY: the table confirms the target lies inside one of our reservations and is
        // unmapped, that `offset + size` fits the handle, and the handle is live (we hold it and
        // the state lock, so no release runs concurrently).
        unsafe { result::map::map(va, size, offset, handle.0)? };
        state
            .table
            .insert_mapping(va, size, handle, offset, info.size, granularity)
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> Result<()> {
        let mut state = self.state.lock();
        let granularity = self.range_granularity();
        state.table.check_unmap(va, size, granularity)?;
        self.enter(0)?;
        // SAFETY: the table confirms the range covers whole mappings of ours exactly;
        // precondition 4 makes the caller responsible for in-flight work on the range.
        unsafe { result::map::unmap(va, size)? };
        state.table.remove_mappings(va, size, granularity)?;
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: u64, grants: &[(Location, Access)]) -> Result<()> {
        let mut state = self.state.lock();
        let granularity = self.range_granularity();
        state
            .table
            .check_set_access(va, size, grants, granularity)?;
        state.table.check_host_grants(va, size, grants, |h| {
            state.handles.get(&h.0).map(|info| info.location)
        })?;
        let descs = grants
            .iter()
            .map(|&(l, a)| self.access_desc(l, a))
            .collect::<Result<Vec<_>>>()?;
        self.enter(0)?;
        // SAFETY: the table confirms the whole range is mapped by us; revoking access under
        // in-flight work is the caller's responsibility (precondition 5 / 8).
        unsafe { result::access::set(va, size, &descs)? };
        state.table.set_access(va, size, grants, granularity)?;
        Ok(())
    }

    fn export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let state = self.state.lock();
        let Some(info) = state.handles.get(&handle.0) else {
            return Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            });
        };
        if !info.exportable {
            return Err(Error::InvalidArgument(format!(
                "handle {:#x} was not created with CreateFlags::EXPORTABLE",
                handle.0
            )));
        }
        self.enter(self.device_for(info.location)?)?;
        // SAFETY: the handle is live: we hold a reference and the state lock (no release
        // meanwhile).
        unsafe { result::phys::export_fd(handle.0) }
    }

    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle> {
        self.enter(0)?;
        let handle = result::phys::import_fd(fd)?;
        // Releases the new reference if anything below fails.
        struct Guard(u64, bool);
        impl Drop for Guard {
            fn drop(&mut self) {
                if self.1 {
                    // SAFETY: the handle was just imported and never published.
                    let _ = unsafe { result::phys::release(self.0) };
                }
            }
        }
        let mut guard = Guard(handle, true);
        // SAFETY: the handle was just imported and is live.
        let props = unsafe { result::phys::properties(handle)? };
        let location = location_from(&props.location)?;
        let location = match location {
            Location::Device(d) if self.device(d).is_err() => {
                return Err(Error::NoDevice(d.into()))
            }
            other => other,
        };
        let exportable = props.requestedHandleTypes
            == sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let granularity = self.granularity(location)?;
        let mut state = self.state.lock();
        let size = match state.handles.get(&handle) {
            Some(known) => known.size,
            None => self.probe_handle_size(handle, location, granularity)?,
        };
        let entry = state.handles.entry(handle).or_insert(HandleInfo {
            location,
            size,
            exportable,
            refs: 0,
        });
        entry.refs += 1;
        guard.1 = false;
        Ok(PhysHandle(handle))
    }

    fn stream_create(&self, device: u32) -> Result<StreamHandle> {
        self.enter(device)?;
        let raw = result::stream::create()? as usize as u64;
        let obj = Arc::new(StreamObj {
            device,
            raw,
            gate: RwLock::new(true),
        });
        self.state.lock().streams.insert(raw, obj);
        Ok(StreamHandle(raw))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        let obj = {
            let mut state = self.state.lock();
            state
                .streams
                .remove(&stream.0)
                .ok_or(Error::InvalidHandle {
                    kind: "stream",
                    id: stream.0,
                })?
        };
        // Waits for calls on this stream in other threads to finish.
        let mut alive = obj.gate.write();
        *alive = false;
        self.enter(obj.device)?;
        // SAFETY: the stream was live (in our table until just now), is removed from the table
        // and marked dead under its gate, so nobody uses it again; destroyed exactly once.
        unsafe { result::stream::destroy(raw_stream(obj.raw)) }
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        if stream == StreamHandle::DEFAULT {
            // The legacy stream is per context: synchronize each device's.
            for d in 0..self.devices.len() as u32 {
                self.enter(d)?;
                // SAFETY: the null stream is always valid with a context current.
                unsafe { result::stream::synchronize(std::ptr::null_mut())? };
            }
            return Ok(());
        }
        self.with_stream(stream, 0, |_, raw| {
            // SAFETY: `with_stream` holds the stream's gate (alive) with its context current.
            unsafe { result::stream::synchronize(raw) }
        })
    }

    fn event_create(&self) -> Result<EventHandle> {
        self.enter(0)?;
        let raw = result::event::create()? as usize as u64;
        let mut per_device = vec![0u64; self.devices.len()];
        per_device[0] = raw;
        let obj = Arc::new(EventObj {
            gate: RwLock::new(true),
            state: Mutex::new(EventState {
                per_device,
                last: None,
            }),
        });
        self.state.lock().events.insert(raw, obj);
        Ok(EventHandle(raw))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        let obj = {
            let mut state = self.state.lock();
            state.events.remove(&event.0).ok_or(Error::InvalidHandle {
                kind: "event",
                id: event.0,
            })?
        };
        let mut alive = obj.gate.write();
        *alive = false;
        let per_device = std::mem::take(&mut obj.state.lock().per_device);
        let mut first_err = None;
        for (d, raw) in per_device.into_iter().enumerate() {
            if raw == 0 {
                continue;
            }
            let destroyed = self.enter(d as u32).and_then(|_| {
                // SAFETY: each per-device event is live, owned by this handle only, removed
                // from the table and marked dead under the gate: destroyed exactly once.
                unsafe { result::event::destroy(raw_event(raw)) }
            });
            if let Err(e) = destroyed {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let obj = self.event_obj(event)?;
        let alive = obj.gate.read();
        if !*alive {
            return Err(Error::InvalidHandle {
                kind: "event",
                id: event.0,
            });
        }
        self.with_stream(stream, 0, |device, raw_s| {
            let mut st = obj.state.lock();
            let slot = &mut st.per_device[device as usize];
            if *slot == 0 {
                // The context of `device` is current (`with_stream`).
                *slot = result::event::create()? as usize as u64;
            }
            let raw_e = *slot;
            // SAFETY: the event is live (gate held, created in this stream's context) and the
            // stream is null or live (gate held by `with_stream`), with its context current.
            unsafe { result::event::record(raw_event(raw_e), raw_s)? };
            st.last = Some(device);
            Ok(())
        })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.with_last_record(event, true, |raw| {
            // SAFETY: the event is live (its gate is held for this call).
            unsafe { result::event::query(raw_event(raw)) }
        })
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.with_last_record(event, (), |raw| {
            // SAFETY: the event is live (its gate is held for this call).
            unsafe { result::event::synchronize(raw_event(raw)) }
        })
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let obj = self.event_obj(event)?;
        let alive = obj.gate.read();
        if !*alive {
            return Err(Error::InvalidHandle {
                kind: "event",
                id: event.0,
            });
        }
        let raw_e = {
            let st = obj.state.lock();
            // Waiting for an event never recorded is a no-op (as in CUDA).
            st.last.map(|d| st.per_device[d as usize])
        };
        self.with_stream(stream, 0, |_, raw_s| match raw_e {
            None => Ok(()),
            // SAFETY: both handles are live (gates held); the driver allows an event of another
            // context here.
            Some(raw_e) => unsafe { result::stream::wait_event(raw_s, raw_event(raw_e)) },
        })
    }

    unsafe fn copy_async(&self, stream: StreamHandle, copies: &[CopyDesc]) -> Result<()> {
        let (default_device, plan) = {
            let state = self.state.lock();
            self.device_for_work(&state, stream, |a| {
                Self::plan_copies(&state.table, a, copies)
            })?
        };
        if plan.is_empty() {
            return Ok(());
        }
        self.with_stream(stream, default_device, |_, raw| {
            // SAFETY: every device range was validated (mapped, with the access this stream's
            // device needs); host ranges are the caller's obligation (this fn's `# Safety`);
            // `with_stream` holds the stream alive with its context current.
            unsafe { self.submit(&plan, raw) }
        })
    }

    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let device = {
            let state = self.state.lock();
            let device = if stream == StreamHandle::DEFAULT {
                let mut found = None;
                for d in 0..self.devices.len() as u32 {
                    let acc = Accessor::Location(Location::Device(d));
                    if state
                        .table
                        .translate(dst, len, acc, Access::ReadWrite)
                        .is_ok()
                    {
                        found = Some(d);
                        break;
                    }
                }
                found.unwrap_or(0)
            } else {
                Self::stream_device(&state, stream)?
            };
            let acc = Accessor::Location(Location::Device(device));
            match state.table.translate(dst, len, acc, Access::ReadWrite)? {
                Translation::Device(_) => {}
                Translation::Host => {
                    return Err(Error::IllegalAccess {
                        va: dst,
                        size: len,
                        reason: "memset target is not device VA",
                    })
                }
            }
            device
        };
        self.with_stream(stream, device, |_, raw| {
            // SAFETY: the range was validated as mapped device VA with write access for the
            // stream's device; the stream is held alive with its context current.
            unsafe { result::memcpy::memset_d8_async(dst, value, len, raw) }
        })
    }

    fn host_alloc(&self, size: u64) -> Result<DevicePtr> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "host_alloc size must not be zero".into(),
            ));
        }
        if size > crate::MAX_HOST_CHUNK {
            return Err(Error::InvalidArgument(format!(
                "host_alloc of {size} bytes above the {} byte chunk limit",
                crate::MAX_HOST_CHUNK
            )));
        }
        self.enter(0)?;
        let ptr = match result::host::alloc(size) {
            Ok(ptr) => ptr,
            // Pinned host memory exhausted: out of memory on the host, like the host backend.
            Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                return Err(crate::hostbuf::host_out_of_memory(size));
            }
            Err(e) => return Err(e),
        };
        self.state.lock().pinned.insert(ptr, size);
        Ok(ptr)
    }

    unsafe fn host_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut state = self.state.lock();
        if state.pinned.get(&ptr) != Some(&size) {
            return Err(Error::UnknownPointer(ptr));
        }
        self.enter(0)?;
        // SAFETY: the table proves `ptr` is a live `host_alloc` of this size; the caller
        // guarantees nothing uses it any more.
        unsafe { result::host::free(ptr)? };
        state.pinned.remove(&ptr);
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn driver_here() -> bool {
        result::driver_present()
    }

    #[test]
    fn new_without_driver_is_no_driver_not_a_panic() {
        let got = std::panic::catch_unwind(CudaBackend::new);
        let got = got.expect("CudaBackend::new must not panic");
        if driver_here() {
            // A machine with a driver: either it works or it reports a typed error.
            if let Err(e) = got {
                eprintln!("CudaBackend::new on a driver machine: {e}");
            }
            return;
        }
        match got {
            Err(Error::NoDriver(msg)) => assert!(!msg.is_empty()),
            Err(other) => panic!("expected NoDriver, got {other}"),
            Ok(_) => panic!("expected NoDriver on a machine without libcuda"),
        }
    }

    #[test]
    fn open_is_no_driver_without_cuda() {
        let got = std::panic::catch_unwind(open).expect("open must not panic");
        if !driver_here() {
            assert!(matches!(got, Err(Error::NoDriver(_))));
        }
    }

    #[test]
    fn auto_selection_does_not_panic() {
        let got = std::panic::catch_unwind(|| crate::open(crate::Choice::Auto));
        assert!(got.is_ok(), "open(Auto) panicked");
    }

    #[test]
    fn result_layer_reports_no_driver_instead_of_panicking() {
        if driver_here() {
            return;
        }
        assert!(matches!(result::init(), Err(Error::NoDriver(_))));
        // Calling a verb without `init` goes through cudarc's lazy loader, which panics without
        // a library: the result layer must turn that into an error.
        assert!(matches!(result::device::count(), Err(Error::NoDriver(_))));
        assert!(matches!(
            result::va::reserve(1 << 21, 0),
            Err(Error::NoDriver(_))
        ));
        assert!(matches!(result::driver_version(), Err(Error::NoDriver(_))));
        assert!(result::memcpy::batch_fn().is_none());
        assert!(!result::symbol_present(c"cuMemcpyBatchAsync"));
    }

    #[test]
    fn missing_nvrtc_is_unsupported_not_a_panic() {
        use super::nvrtc::{self, Image};
        let present = std::panic::catch_unwind(nvrtc::check_present).expect("no panic");
        let compiled = std::panic::catch_unwind(|| {
            nvrtc::compile(
                strata_kernels::blockcopy::CUDA_SOURCE,
                c"t.cu",
                80,
                Image::Ptx,
            )
        })
        .expect("compile must not panic");
        match present {
            Ok(()) => {
                // NVRTC here: the kernel source compiles on its own (no headers needed).
                let ptx = compiled.expect("CUDA_SOURCE compiles with NVRTC");
                assert_eq!(ptx.last(), Some(&0), "PTX is NUL-terminated");
            }
            Err(e) => {
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
                assert!(matches!(compiled, Err(Error::Unsupported(_))));
                assert!(matches!(
                    nvrtc::supported_archs(),
                    Err(Error::Unsupported(_))
                ));
            }
        }
    }

    #[test]
    fn access_flags_match_the_driver_values() {
        use sys::CUmemAccess_flags as F;
        assert_eq!(
            result::access::flags(Access::None),
            F::CU_MEM_ACCESS_FLAGS_PROT_NONE
        );
        assert_eq!(
            result::access::flags(Access::Read),
            F::CU_MEM_ACCESS_FLAGS_PROT_READ
        );
        assert_eq!(
            result::access::flags(Access::ReadWrite),
            F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        );
    }

    #[test]
    fn copy_plans_coalesce_adjacent_descriptors_and_check_access() {
        let g = 1u64 << 21;
        let mut table = VaTable::new();
        let base = 0x7000_0000_0000u64;
        table.add_reservation(base, 4 * g).unwrap();
        table
            .insert_mapping(base, 2 * g, PhysHandle(1), 0, 2 * g, g)
            .unwrap();
        let d0 = Accessor::Location(Location::Device(0));
        let host = 0x1000u64;
        let copies = [
            CopyDesc {
                dst: base,
                src: host,
                len: 100,
            },
            CopyDesc {
                dst: base + 100,
                src: host + 100,
                len: 50,
            },
            CopyDesc {
                dst: base + 4096,
                src: host + 150,
                len: 10,
            },
            CopyDesc {
                dst: base + 9999,
                src: host,
                len: 0,
            },
        ];
        // No access yet: illegal.
        assert!(matches!(
            CudaBackend::plan_copies(&table, d0, &copies),
            Err(Error::IllegalAccess { .. })
        ));
        table
            .set_access(base, 2 * g, &[(Location::Device(0), Access::ReadWrite)], g)
            .unwrap();
        let plan = CudaBackend::plan_copies(&table, d0, &copies).unwrap();
        assert_eq!(plan, vec![(base, host, 150), (base + 4096, host + 150, 10)]);
        // Another device has no grant.
        let d1 = Accessor::Location(Location::Device(1));
        assert!(CudaBackend::plan_copies(&table, d1, &copies).is_err());
        // Unmapped part of the reservation.
        let bad = [CopyDesc {
            dst: base + 2 * g,
            src: host,
            len: 1,
        }];
        assert!(matches!(
            CudaBackend::plan_copies(&table, d0, &bad),
            Err(Error::IllegalAccess { .. })
        ));
        // Read-only source is fine, read-only destination is not.
        table
            .set_access(base, g, &[(Location::Device(0), Access::Read)], g)
            .unwrap();
        let from = [CopyDesc {
            dst: host,
            src: base,
            len: 8,
        }];
        assert!(CudaBackend::plan_copies(&table, d0, &from).is_ok());
        let to = [CopyDesc {
            dst: base,
            src: host,
            len: 8,
        }];
        assert!(CudaBackend::plan_copies(&table, d0, &to).is_err());
    }
}
