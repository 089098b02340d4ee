//! Owning handles: one owner per driver object, one exact undo each.
//!
//! A [`Mapping`] keeps its [`Reservation`] and [`PhysicalMemory`] alive, so teardown order falls
//! out of ownership: unmap, then release, then address-free. Errors a destructor cannot return
//! are recorded and surfaced by the next fallible constructor here ([`check_deferred`]); once the
//! process is exiting, destructors make no backend calls at all (they leak instead).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};

use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{
    Access, CreateFlags, DevicePtr, EventHandle, Location, PhysHandle, StreamHandle,
};

static EXITING: AtomicBool = AtomicBool::new(false);
static ATEXIT: Once = Once::new();
static DEFERRED: Mutex<Option<Error>> = Mutex::new(None);

extern "C" fn mark_exiting() {
    EXITING.store(true, Ordering::SeqCst);
}

/// Registers the exit hook once; called by every backend constructor.
pub(crate) fn install_exit_hook() {
    ATEXIT.call_once(|| {
        // SAFETY: `mark_exiting` is a plain `extern "C" fn()` that only stores an atomic; it is
        // valid for the whole process lifetime, which is all `atexit` requires.
        unsafe {
            libc::atexit(mark_exiting);
        }
    });
}

/// True once `exit` began: destructors must not call the driver any more.
pub fn process_is_exiting() -> bool {
    EXITING.load(Ordering::Relaxed)
}

/// Records an error a destructor could not return (the first one wins until taken).
pub fn record_deferred(error: Error) {
    let mut slot = DEFERRED.lock();
    if slot.is_none() {
        *slot = Some(error);
    }
}

/// Returns (and clears) the error a destructor recorded, as [`Error::Deferred`].
pub fn check_deferred() -> Result<()> {
    match DEFERRED.lock().take() {
        Some(e) => Err(Error::Deferred(Box::new(e))),
        None => Ok(()),
    }
}

fn undo(op: impl FnOnce() -> Result<()>) {
    if process_is_exiting() {
        return;
    }
    if let Err(e) = op() {
        record_deferred(e);
    }
}

/// A reserved virtual address range; frees exactly `(ptr, size)` on drop.
pub struct Reservation {
    backend: Arc<dyn Backend>,
    ptr: DevicePtr,
    size: u64,
}

impl Reservation {
    /// Reserves `size` bytes aligned to `alignment` (0: the granularity).
    pub fn new(backend: &Arc<dyn Backend>, size: u64, alignment: u64) -> Result<Self> {
        check_deferred()?;
        let ptr = backend.reserve(size, alignment)?;
        Ok(Reservation {
            backend: Arc::clone(backend),
            ptr,
            size,
        })
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// True when `va..va+size` lies inside this reservation.
    pub fn contains(&self, va: DevicePtr, size: u64) -> bool {
        va >= self.ptr
            && va
                .checked_add(size)
                .is_some_and(|end| end <= self.ptr + self.size)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        undo(|| self.backend.free_va(self.ptr, self.size));
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reservation({:#x}+{:#x})", self.ptr, self.size)
    }
}

/// Physical memory; releases its creation reference on drop.
pub struct PhysicalMemory {
    backend: Arc<dyn Backend>,
    handle: PhysHandle,
    location: Location,
    size: u64,
}

impl PhysicalMemory {
    /// Creates `size` bytes of physical memory at `location`.
    pub fn create(
        backend: &Arc<dyn Backend>,
        location: Location,
        size: u64,
        flags: CreateFlags,
    ) -> Result<Self> {
        check_deferred()?;
        let handle = backend.create(location, size, flags)?;
        Ok(PhysicalMemory {
            backend: Arc::clone(backend),
            handle,
            location,
            size,
        })
    }

    /// Takes ownership of a handle obtained from `import_fd`.
    pub fn from_imported(
        backend: &Arc<dyn Backend>,
        handle: PhysHandle,
        location: Location,
    ) -> Result<Self> {
        let size = backend.handle_size(handle)?;
        Ok(PhysicalMemory {
            backend: Arc::clone(backend),
            handle,
            location,
            size,
        })
    }

    pub fn handle(&self) -> PhysHandle {
        self.handle
    }

    pub fn location(&self) -> Location {
        self.location
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for PhysicalMemory {
    fn drop(&mut self) {
        undo(|| self.backend.release(self.handle));
    }
}

impl std::fmt::Debug for PhysicalMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PhysicalMemory({:?} {} {:#x})",
            self.handle, self.location, self.size
        )
    }
}

/// The first `size` bytes of `phys` mapped at `va` inside `reservation`; unmaps on drop.
/// `phys_offset` must be 0 ([`Backend::map`]'s precondition 3: the driver maps handles from
/// offset 0 only); any other value is [`Error::Unsupported`].
pub struct Mapping {
    reservation: Arc<Reservation>,
    phys: Arc<PhysicalMemory>,
    va: DevicePtr,
    size: u64,
}

impl Mapping {
    /// Maps and, when `grants` is non-empty, sets access over the new mapping.
    pub fn new(
        reservation: &Arc<Reservation>,
        va: DevicePtr,
        phys: Arc<PhysicalMemory>,
        phys_offset: u64,
        size: u64,
        grants: &[(Location, Access)],
    ) -> Result<Self> {
        check_deferred()?;
        if !reservation.contains(va, size) {
            return Err(Error::NotReserved { va, size });
        }
        let backend = reservation.backend();
        backend.map(va, size, phys.handle(), phys_offset)?;
        let mapping = Mapping {
            reservation: Arc::clone(reservation),
            phys,
            va,
            size,
        };
        if !grants.is_empty() {
            // On failure `mapping` drops here and unmaps: nothing leaks.
            backend.set_access(va, size, grants)?;
        }
        Ok(mapping)
    }

    pub fn va(&self) -> DevicePtr {
        self.va
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn phys(&self) -> &Arc<PhysicalMemory> {
        &self.phys
    }

    pub fn reservation(&self) -> &Arc<Reservation> {
        &self.reservation
    }

    /// Unmaps now and hands back the physical memory (for reuse by a pool).
    pub fn unmap(self) -> Result<Arc<PhysicalMemory>> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again after these reads; each field is moved
        // out exactly once, so no double drop happens.
        let (reservation, phys) = unsafe {
            (
                std::ptr::read(&this.reservation),
                std::ptr::read(&this.phys),
            )
        };
        reservation.backend().unmap(this.va, this.size)?;
        Ok(phys)
    }
}

impl Mapping {
    /// Unmaps now and hands back the physical memory; when the driver refuses, hands back the
    /// mapping itself (still mapped, still owned) with the error, so the caller can undo
    /// around it.
    pub fn try_unmap(self) -> std::result::Result<Arc<PhysicalMemory>, (Mapping, Error)> {
        if let Err(e) = self.reservation.backend().unmap(self.va, self.size) {
            return Err((self, e));
        }
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again after these reads; each field is moved
        // out exactly once, so no double drop happens.
        let (reservation, phys) = unsafe {
            (
                std::ptr::read(&this.reservation),
                std::ptr::read(&this.phys),
            )
        };
        drop(reservation);
        Ok(phys)
    }
}

impl Mapping {
    /// Lets the mapping go without unmapping it: someone else took over its address range
    /// (unmapped it already, or owns the unmap from now on). Only the handles it held drop.
    pub fn disown(self) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again after these reads; each field is moved
        // out exactly once and dropped here, so no double drop happens.
        let (reservation, phys) = unsafe {
            (
                std::ptr::read(&this.reservation),
                std::ptr::read(&this.phys),
            )
        };
        drop((reservation, phys));
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        undo(|| self.reservation.backend().unmap(self.va, self.size));
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Mapping({:#x}+{:#x} -> {:?})",
            self.va, self.size, self.phys
        )
    }
}

/// An owned stream; destroyed on drop.
pub struct Stream {
    backend: Arc<dyn Backend>,
    handle: StreamHandle,
}

impl Stream {
    pub fn new(backend: &Arc<dyn Backend>, device: u32) -> Result<Self> {
        check_deferred()?;
        let handle = backend.stream_create(device)?;
        Ok(Stream {
            backend: Arc::clone(backend),
            handle,
        })
    }

    pub fn handle(&self) -> StreamHandle {
        self.handle
    }

    pub fn synchronize(&self) -> Result<()> {
        self.backend.stream_synchronize(self.handle)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        undo(|| self.backend.stream_destroy(self.handle));
    }
}

/// An owned event; destroyed on drop.
pub struct Event {
    backend: Arc<dyn Backend>,
    handle: EventHandle,
}

impl Event {
    pub fn new(backend: &Arc<dyn Backend>) -> Result<Self> {
        check_deferred()?;
        let handle = backend.event_create()?;
        Ok(Event {
            backend: Arc::clone(backend),
            handle,
        })
    }

    pub fn handle(&self) -> EventHandle {
        self.handle
    }

    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        self.backend.event_record(self.handle, stream)
    }

    pub fn query(&self) -> Result<bool> {
        self.backend.event_query(self.handle)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.backend.event_synchronize(self.handle)
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({:#x})", self.handle.0)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        undo(|| self.backend.event_destroy(self.handle));
    }
}
