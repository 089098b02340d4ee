//! The host backend: the CUDA VMM semantics emulated with the operating system's own VMM.
//!
//! - Physical memory: one sparse memfd per emulated device (and one for [`Location::Host`]);
//!   `create` takes a range of it (or its own memfd when exportable); the last reference punches
//!   the range out, so memory really returns.
//! - Virtual memory: `reserve` is a `PROT_NONE` `MAP_NORESERVE` mapping; `map` maps the memfd
//!   range over it with no access; `unmap` puts the reservation back; `set_access` records grants
//!   (and, outside strict mode, `mprotect`s the user VA to the strongest grant).
//! - Copies never touch the user VA: device ranges are translated through the VA table
//!   (`vatable.rs`) to (memfd, offset) and copied through a private shadow view, with the
//!   handles pinned (`copy.rs`).
//! - Streams are in-order worker threads; [`StreamHandle::DEFAULT`] runs work in the caller.
//!
//! See DESIGN.md ("vmm") and the [`Backend`] preconditions.

mod config;
mod copy;
mod device;
pub(crate) mod fault;
mod os;
mod stream;
mod work;

pub use config::{parse_devices, parse_size, HostConfig, Link, LinkModel};
pub use fault::{FaultOp, OpGate};

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{
    Access, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, EventHandle, LiveCounts,
    Location, MemInfo, PhysHandle, StreamHandle,
};
use crate::vatable::{Accessor, VaTable};
use crate::work::DeviceWork;
use strata_latency::{Call, Charger, Profile};

use device::{Backing, HandleEntry, Pool};
use fault::FaultPlan;
use stream::{EventShared, StreamShared};

/// VA bookkeeping, handles and pools: everything guarded by the one state lock.
struct State {
    va: VaTable,
    handles: HashMap<u64, HandleEntry>,
    /// One pool per device, then the host pool.
    pools: Vec<Pool>,
    next_handle: u64,
}

/// Shared by the backend and the tasks its stream workers run.
struct Inner {
    config: HostConfig,
    state: Mutex<State>,
    streams: Mutex<HashMap<u64, Arc<StreamShared>>>,
    events: Mutex<HashMap<u64, Arc<EventShared>>>,
    next_stream: AtomicU64,
    next_event: AtomicU64,
    faults: FaultPlan,
    /// Live `host_alloc` allocations: address → size.
    host_allocs: Mutex<HashMap<u64, u64>>,
    /// What each call and copy costs (`STRATA_HOST_LATENCY`; nothing by default).
    latency: Charger,
    /// `STRATA_HOST_IMPORTED_MAPS=refuse`: imported handles cannot be mapped.
    refuse_imported_maps: bool,
}

/// Emulated devices on memfd-backed physical memory (see the module documentation).
pub struct HostBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HostBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBackend")
            .field("config", &self.inner.config)
            .field("live", &self.live_counts())
            .finish()
    }
}

/// Opens a host backend as a trait object.
pub fn open(config: HostConfig) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(HostBackend::new(config)?))
}

fn invalid_handle(kind: &'static str, id: u64) -> Error {
    Error::InvalidHandle { kind, id }
}

impl HostBackend {
    /// Starts a backend with `config.devices.len()` emulated devices, charging the latency
    /// profile `STRATA_HOST_LATENCY` names (`none` when unset) and refusing to map imported
    /// handles when `STRATA_HOST_IMPORTED_MAPS=refuse` (as a real driver did: REFERENCE.md §1.8).
    pub fn new(config: HostConfig) -> Result<Self> {
        let (latency, refuse_imported_maps) = config::driver_env()?;
        let backend = Self::with_latency(config, latency)?;
        Ok(if refuse_imported_maps {
            backend.refusing_imported_maps()
        } else {
            backend
        })
    }

    /// This backend, made to refuse mapping imported handles with [`Error::Unsupported`]
    /// (`STRATA_HOST_IMPORTED_MAPS=refuse`), as the driver of an H200 virtual machine did.
    /// Call right after construction (no effect once the backend is shared).
    pub fn refusing_imported_maps(mut self) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.refuse_imported_maps = true;
        }
        self
    }

    /// As [`HostBackend::new`] with `latency` charged (whatever the environment says) and
    /// imported handles mappable.
    pub fn with_latency(config: HostConfig, latency: Profile) -> Result<Self> {
        crate::raii::install_exit_hook();
        let page = os::page_size();
        let g = config.granularity;
        if !g.is_power_of_two() || g < page {
            return Err(Error::Config {
                name: "granularity",
                value: g.to_string(),
                reason: format!("must be a power of two of at least {page} bytes"),
            });
        }
        if config.devices.is_empty() || config.devices.len() > 64 || config.devices.contains(&0) {
            return Err(Error::Config {
                name: "devices",
                value: format!("{:?}", config.devices),
                reason: "expected 1 to 64 devices, each with a capacity above zero".into(),
            });
        }
        let mut pools = Vec::with_capacity(config.devices.len() + 1);
        for (d, &capacity) in config.devices.iter().enumerate() {
            let ordinal = u32::try_from(d).map_err(|_| Error::Overflow("device ordinal"))?;
            pools.push(Pool::new(Location::Device(ordinal), capacity, g)?);
        }
        pools.push(Pool::new(Location::Host, os::physical_memory(), g)?);
        Ok(HostBackend {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(State {
                    va: VaTable::new(),
                    handles: HashMap::new(),
                    pools,
                    next_handle: 1,
                }),
                streams: Mutex::new(HashMap::new()),
                events: Mutex::new(HashMap::new()),
                next_stream: AtomicU64::new(1),
                next_event: AtomicU64::new(1),
                faults: FaultPlan::default(),
                host_allocs: Mutex::new(HashMap::new()),
                latency: Charger::new(latency),
                refuse_imported_maps: false,
            }),
        })
    }

    /// The configuration this backend was built with.
    pub fn config(&self) -> &HostConfig {
        &self.inner.config
    }

    /// The latency profile this backend charges.
    pub fn latency(&self) -> &Profile {
        self.inner.latency.profile()
    }

    /// Makes the `nth` subsequent call of `op` (1: the next one) fail with
    /// [`Error::InjectedFault`] before it changes any state. One-shot; replaces an earlier plan
    /// for the same operation.
    pub fn inject_fault(&self, op: FaultOp, nth: u64) {
        self.inner.faults.arm(op, nth);
    }

    /// Disarms every injected fault.
    pub fn clear_faults(&self) {
        self.inner.faults.clear();
    }

    /// Runs `gate` at the start of every call of `op` (`None`: no more), on the calling thread
    /// and before any backend lock is taken, so a test can hold a driver call (or make it slow,
    /// as a real `cuMemCreate` is) and check what other threads do meanwhile. The gate runs
    /// before an injected fault of the same call. Test-only: nothing is gated by default.
    pub fn set_op_gate(&self, op: FaultOp, gate: Option<OpGate>) {
        self.inner.faults.set_gate(op, gate);
    }

    /// Bytes of physical memory really held at `location` (the memfds' allocated blocks),
    /// including exportable handles created there; imported handles are not counted.
    pub fn resident_bytes(&self, location: Location) -> Result<u64> {
        let st = self.inner.state.lock();
        let index = self.inner.pool_index(location)?;
        let mut total = st.pools[index].resident()?;
        for h in st.handles.values() {
            if let (Backing::Own { fd, .. }, false, true) =
                (&h.backing, h.imported, h.location == location)
            {
                total = total
                    .checked_add(os::resident(fd.as_fd())?)
                    .ok_or(Error::Overflow("resident bytes"))?;
            }
        }
        Ok(total)
    }

    fn stream(&self, stream: StreamHandle) -> Result<Arc<StreamShared>> {
        self.inner
            .streams
            .lock()
            .get(&stream.0)
            .cloned()
            .ok_or(invalid_handle("stream", stream.0))
    }

    fn event(&self, event: EventHandle) -> Result<Arc<EventShared>> {
        self.inner
            .events
            .lock()
            .get(&event.0)
            .cloned()
            .ok_or(invalid_handle("event", event.0))
    }

    /// Who accesses memory for work on `stream`, and its worker (None: the default stream).
    fn accessor(&self, stream: StreamHandle) -> Result<(Accessor, Option<Arc<StreamShared>>)> {
        if stream == StreamHandle::DEFAULT {
            return Ok((Accessor::Any, None));
        }
        let s = self.stream(stream)?;
        Ok((Accessor::Location(Location::Device(s.device())), Some(s)))
    }
}

impl Inner {
    fn device_count(&self) -> u32 {
        // At most 64 devices (checked in `new`).
        self.config.devices.len() as u32
    }

    fn check_device(&self, device: u32) -> Result<usize> {
        if device < self.device_count() {
            Ok(device as usize)
        } else {
            Err(Error::NoDevice(i64::from(device)))
        }
    }

    fn pool_index(&self, location: Location) -> Result<usize> {
        match location {
            Location::Device(d) => self.check_device(d),
            Location::Host => Ok(self.config.devices.len()),
        }
    }

    /// Drops one reference bookkeeping already removed; frees the handle at zero.
    fn maybe_free(&self, st: &mut State, id: u64) -> Result<()> {
        let Some(entry) = st.handles.get(&id) else {
            return Ok(());
        };
        if entry.refs() > 0 {
            return Ok(());
        }
        let Some(entry) = st.handles.remove(&id) else {
            return Ok(());
        };
        let index = self.pool_index(entry.location)?;
        match entry.backing {
            Backing::Pooled { offset } => st.pools[index].free(offset, entry.size),
            Backing::Own { fd, shadow, .. } => {
                drop(shadow);
                drop(fd);
                if entry.charged {
                    st.pools[index].uncharge(entry.size);
                }
                Ok(())
            }
        }
    }
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn device_count(&self) -> u32 {
        self.inner.device_count()
    }

    fn device_info(&self, device: u32) -> Result<DeviceInfo> {
        let d = self.inner.check_device(device)?;
        Ok(DeviceInfo {
            ordinal: device,
            name: format!("strata host device {device}"),
            total_memory: self.inner.config.devices[d],
            granularity: self.inner.config.granularity,
        })
    }

    fn granularity(&self, location: Location) -> Result<u64> {
        self.inner.pool_index(location)?;
        Ok(self.inner.config.granularity)
    }

    fn mem_info(&self, device: u32) -> Result<MemInfo> {
        let d = self.inner.check_device(device)?;
        let st = self.inner.state.lock();
        let pool = &st.pools[d];
        Ok(MemInfo {
            free: pool.available(),
            total: pool.capacity(),
        })
    }

    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.inner.latency.call(Call::Reserve);
        let g = self.inner.config.granularity;
        let alignment = VaTable::check_reserve(size, alignment, g)?;
        let ptr = os::reserve(size, alignment)?;
        let mut st = self.inner.state.lock();
        if let Err(e) = st.va.add_reservation(ptr, size) {
            // SAFETY: `ptr..ptr+size` was reserved just above and is known to nobody else.
            let _ = unsafe { os::release(ptr, size) };
            return Err(e);
        }
        Ok(ptr)
    }

    fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.inner.latency.call(Call::FreeVa);
        let mut st = self.inner.state.lock();
        st.va.check_free(ptr, size)?;
        // SAFETY: the table says `ptr..ptr+size` is exactly one of our reservations with nothing
        // mapped inside; after this call nothing refers to it (it leaves the table below).
        unsafe { os::release(ptr, size)? };
        st.va.remove_reservation(ptr, size)
    }

    fn create(&self, location: Location, size: u64, flags: CreateFlags) -> Result<PhysHandle> {
        self.inner.latency.call(Call::Create);
        self.inner.faults.check(FaultOp::Create)?;
        let g = self.inner.config.granularity;
        let index = self.inner.pool_index(location)?;
        if size == 0 {
            return Err(Error::InvalidArgument(
                "create size must not be zero".into(),
            ));
        }
        if size % g != 0 {
            return Err(Error::Misaligned {
                what: "create size",
                value: size,
                granularity: g,
            });
        }
        let mut st = self.inner.state.lock();
        let backing = if flags.contains(CreateFlags::EXPORTABLE) {
            st.pools[index].charge(size)?;
            let own = (|| {
                let fd = os::memfd(c"strata-host-exportable", size)?;
                let shadow = os::Region::shared(fd.as_fd(), size)?;
                let id = device::file_id(fd.as_fd())?;
                Ok::<_, Error>(Backing::Own { fd, shadow, id })
            })();
            match own {
                Ok(b) => b,
                Err(e) => {
                    st.pools[index].uncharge(size);
                    return Err(e);
                }
            }
        } else {
            Backing::Pooled {
                offset: st.pools[index].alloc(size)?,
            }
        };
        let id = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(
            id,
            HandleEntry {
                location,
                size,
                backing,
                created: true,
                maps: 0,
                pins: 0,
                charged: true,
                imported: false,
            },
        );
        Ok(PhysHandle(id))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.inner.latency.call(Call::Release);
        let mut st = self.inner.state.lock();
        match st.handles.get_mut(&handle.0) {
            Some(entry) if entry.created => entry.created = false,
            _ => return Err(invalid_handle("physical", handle.0)),
        }
        self.inner.maybe_free(&mut st, handle.0)
    }

    fn handle_size(&self, handle: PhysHandle) -> Result<u64> {
        let st = self.inner.state.lock();
        match st.handles.get(&handle.0) {
            Some(entry) if entry.created => Ok(entry.size),
            _ => Err(invalid_handle("physical", handle.0)),
        }
    }

    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        self.inner.latency.call(Call::Map);
        self.inner.faults.check(FaultOp::Map)?;
        let g = self.inner.config.granularity;
        let mut guard = self.inner.state.lock();
        let st = &mut *guard;
        let entry = match st.handles.get(&handle.0) {
            Some(entry) if entry.created => entry,
            _ => return Err(invalid_handle("physical", handle.0)),
        };
        if entry.imported && self.inner.refuse_imported_maps {
            return Err(Error::Unsupported(format!(
                "cuMemMap of imported handle {:#x}: CUDA_ERROR_NOT_SUPPORTED (801), as \
                 STRATA_HOST_IMPORTED_MAPS=refuse emulates",
                handle.0
            )));
        }
        st.va.check_map(va, size, offset, entry.size, g)?;
        let index = self.inner.pool_index(entry.location)?;
        let (fd, fd_offset) = match &entry.backing {
            Backing::Pooled { offset: base } => (
                st.pools[index].memfd().as_fd(),
                base.checked_add(offset)
                    .ok_or(Error::Overflow("memfd offset"))?,
            ),
            Backing::Own { fd, .. } => (fd.as_fd(), offset),
        };
        // SAFETY: `check_map` proved `va..va+size` lies inside one of our reservations and is
        // unmapped (PROT_NONE placeholder pages that nobody references).
        unsafe { os::map_fixed(va, size, fd, fd_offset)? };
        if let Err(e) = st
            .va
            .insert_mapping(va, size, handle, offset, entry.size, g)
        {
            // SAFETY: the same range as just mapped; put the placeholder back.
            let _ = unsafe { os::unmap_to_reserved(va, size) };
            return Err(e);
        }
        if let Some(entry) = st.handles.get_mut(&handle.0) {
            entry.maps += 1;
        }
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> Result<()> {
        self.inner.latency.call(Call::Unmap);
        self.inner.faults.check(FaultOp::Unmap)?;
        let g = self.inner.config.granularity;
        let mut st = self.inner.state.lock();
        st.va.check_unmap(va, size, g)?;
        // SAFETY: `check_unmap` proved `va..va+size` is exactly a run of our own mappings inside
        // one reservation; library code holds no references into device VA.
        unsafe { os::unmap_to_reserved(va, size)? };
        let removed = st.va.remove_mappings(va, size, g)?;
        let mut first_error = None;
        for m in removed {
            if let Some(entry) = st.handles.get_mut(&m.handle.0) {
                entry.maps = entry.maps.saturating_sub(1);
            }
            if let Err(e) = self.inner.maybe_free(&mut st, m.handle.0) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn set_access(&self, va: DevicePtr, size: u64, grants: &[(Location, Access)]) -> Result<()> {
        self.inner.latency.call(Call::SetAccess);
        self.inner.faults.check(FaultOp::SetAccess)?;
        for &(location, _) in grants {
            self.inner.pool_index(location)?;
        }
        let g = self.inner.config.granularity;
        let mut st = self.inner.state.lock();
        let st = &mut *st;
        st.va.check_set_access(va, size, grants, g)?;
        st.va.check_host_grants(va, size, grants, |h| {
            st.handles.get(&h.0).map(|e| e.location)
        })?;
        let runs = st.va.set_access(va, size, grants, g)?;
        if !self.inner.config.strict {
            for (start, len, access) in runs {
                // SAFETY: `set_access` proved the range is fully mapped inside our reservation;
                // only the CPU protection of our own mapping changes.
                unsafe { os::protect(start, len, access)? };
            }
        }
        Ok(())
    }

    fn export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.inner.latency.call(Call::Export);
        let st = self.inner.state.lock();
        match st.handles.get(&handle.0) {
            Some(HandleEntry {
                created: true,
                backing: Backing::Own { fd, .. },
                ..
            }) => os::dup_cloexec(fd.as_fd()),
            Some(HandleEntry { created: true, .. }) => Err(Error::InvalidArgument(format!(
                "handle {:#x} was not created with CreateFlags::EXPORTABLE",
                handle.0
            ))),
            _ => Err(invalid_handle("physical", handle.0)),
        }
    }

    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle> {
        self.inner.latency.call(Call::Import);
        let g = self.inner.config.granularity;
        let st_info = os::fstat(fd)?;
        if st_info.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::InvalidArgument(
                "import_fd needs a memory file descriptor".into(),
            ));
        }
        let size = u64::try_from(st_info.st_size).map_err(|_| Error::Overflow("file size"))?;
        if size == 0 {
            return Err(Error::InvalidArgument("imported file is empty".into()));
        }
        if size % g != 0 {
            return Err(Error::Misaligned {
                what: "imported size",
                value: size,
                granularity: g,
            });
        }
        let own = os::dup_cloexec(fd)?;
        let shadow = os::Region::shared(own.as_fd(), size)?;
        let id = (st_info.st_dev, st_info.st_ino);
        let mut st = self.inner.state.lock();
        let location = st
            .handles
            .values()
            .find_map(|h| match &h.backing {
                Backing::Own { id: other, .. } if *other == id => Some(h.location),
                _ => None,
            })
            .unwrap_or(Location::Host);
        let handle = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(
            handle,
            HandleEntry {
                location,
                size,
                backing: Backing::Own {
                    fd: own,
                    shadow,
                    id,
                },
                created: true,
                maps: 0,
                pins: 0,
                charged: false,
                imported: true,
            },
        );
        Ok(PhysHandle(handle))
    }

    fn stream_create(&self, device: u32) -> Result<StreamHandle> {
        self.inner.latency.call(Call::StreamCreate);
        self.inner.check_device(device)?;
        let id = self.inner.next_stream.fetch_add(1, Ordering::Relaxed);
        let shared = StreamShared::spawn(id, device)?;
        self.inner.streams.lock().insert(id, shared);
        Ok(StreamHandle(id))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.inner.latency.call(Call::StreamDestroy);
        let shared = self
            .inner
            .streams
            .lock()
            .remove(&stream.0)
            .ok_or(invalid_handle("stream", stream.0))?;
        shared.shutdown()
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        if stream == StreamHandle::DEFAULT {
            return Ok(());
        }
        self.stream(stream)?.synchronize()
    }

    fn event_create(&self) -> Result<EventHandle> {
        self.inner.latency.call(Call::EventCreate);
        let id = self.inner.next_event.fetch_add(1, Ordering::Relaxed);
        self.inner
            .events
            .lock()
            .insert(id, Arc::new(EventShared::default()));
        Ok(EventHandle(id))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.latency.call(Call::EventDestroy);
        self.inner
            .events
            .lock()
            .remove(&event.0)
            .map(|_| ())
            .ok_or(invalid_handle("event", event.0))
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.inner.latency.call(Call::EventRecord);
        let ev = self.event(event)?;
        if stream == StreamHandle::DEFAULT {
            // Work on the default stream has already run.
            let epoch = ev.begin_record();
            ev.complete(epoch);
            return Ok(());
        }
        self.stream(stream)?.record(&ev)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        Ok(self.event(event)?.is_complete())
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let ev = self.event(event)?;
        ev.wait_for(ev.latest());
        Ok(())
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.inner.latency.call(Call::StreamWaitEvent);
        let ev = self.event(event)?;
        if stream == StreamHandle::DEFAULT {
            ev.wait_for(ev.latest());
            return Ok(());
        }
        self.stream(stream)?.wait_event(&ev)
    }

    unsafe fn copy_async(&self, stream: StreamHandle, copies: &[CopyDesc]) -> Result<()> {
        self.inner.faults.check(FaultOp::Copy)?;
        for c in copies {
            c.src
                .checked_add(c.len)
                .zip(c.dst.checked_add(c.len))
                .ok_or(Error::Overflow("copy address + length"))?;
            usize::try_from(c.len).map_err(|_| Error::Overflow("copy length"))?;
        }
        let (accessor, worker) = self.accessor(stream)?;
        self.inner.validate_copies(accessor, copies)?;
        match worker {
            None => self.inner.run_copies(accessor, copies),
            Some(worker) => {
                let inner = Arc::clone(&self.inner);
                let copies = copies.to_vec();
                worker.submit(Box::new(move || inner.run_copies(accessor, &copies)))
            }
        }
    }

    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        self.inner.faults.check(FaultOp::Copy)?;
        dst.checked_add(len)
            .ok_or(Error::Overflow("memset address + length"))?;
        usize::try_from(len).map_err(|_| Error::Overflow("memset length"))?;
        let (accessor, worker) = self.accessor(stream)?;
        if len > 0 {
            let st = self.inner.state.lock();
            if !st.va.touches_reservation(dst, len) {
                return Err(Error::IllegalAccess {
                    va: dst,
                    size: len,
                    reason: "memset target is not device memory",
                });
            }
            st.va.translate(dst, len, accessor, Access::ReadWrite)?;
        }
        match worker {
            None => self.inner.run_memset(accessor, dst, value, len),
            Some(worker) => {
                let inner = Arc::clone(&self.inner);
                worker.submit(Box::new(move || {
                    inner.run_memset(accessor, dst, value, len)
                }))
            }
        }
    }

    fn host_alloc(&self, size: u64) -> Result<DevicePtr> {
        self.inner.latency.call(Call::HostAlloc);
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
        let ptr = os::anon(size)?;
        self.inner.host_allocs.lock().insert(ptr, size);
        Ok(ptr)
    }

    unsafe fn host_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.inner.latency.call(Call::HostFree);
        let mut allocs = self.inner.host_allocs.lock();
        match allocs.get(&ptr) {
            Some(&s) if s == size => {}
            _ => return Err(Error::UnknownPointer(ptr)),
        }
        allocs.remove(&ptr);
        drop(allocs);
        // SAFETY: the table proved `ptr/size` is one live `anon` mapping; the caller guarantees
        // nothing uses it any more.
        unsafe { os::unmap_anon(ptr, size) }
    }

    fn device_work(self: Arc<Self>) -> Option<Arc<dyn DeviceWork>> {
        Some(self)
    }

    fn live_counts(&self) -> LiveCounts {
        let (reservations, mappings, handles) = {
            let st = self.inner.state.lock();
            let handles = st.handles.values().filter(|h| h.created).count() as u64;
            (st.va.reservation_count(), st.va.mapping_count(), handles)
        };
        LiveCounts {
            reservations,
            handles,
            mappings,
            streams: self.inner.streams.lock().len() as u64,
            events: self.inner.events.lock().len() as u64,
        }
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        // Stop the workers first: their queued tasks hold `inner`.
        let streams: Vec<_> = self.inner.streams.lock().drain().map(|(_, s)| s).collect();
        for s in streams {
            let _ = s.shutdown();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        let reservations: Vec<_> = st.va.reservations().collect();
        for (ptr, size) in reservations {
            // SAFETY: the backend is going away: every reservation is ours and nothing can reach
            // it any more (workers are joined; callers held `&HostBackend` to use it).
            let _ = unsafe { os::release(ptr, size) };
        }
        // Handles (own memfds and shadows) and pools close and unmap when `st` drops.
    }
}
