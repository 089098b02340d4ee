//! The VMM contract every backend implements.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::types::{
    Access, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, EventHandle, LiveCounts,
    Location, MemInfo, PhysHandle, StreamHandle,
};
use crate::work::DeviceWork;

/// The CUDA virtual-memory API plus streams, events and copies, as one contract. Kernels and
/// library calls (block copy, GEMM) are [`DeviceWork`], a separate trait.
///
/// # Preconditions (checked by every backend and reported as errors, never undefined behaviour)
///
/// 1. **Granularity.** `reserve` sizes and alignments, `create` sizes, and the `va`, `size` and
///    `offset` of `map`, `unmap` and `set_access` are multiples of [`Backend::granularity`] for
///    the location involved; otherwise [`Error::Misaligned`](crate::Error::Misaligned). Zero sizes
///    are [`Error::InvalidArgument`](crate::Error::InvalidArgument).
/// 2. **Reservations.** `free_va` takes the exact `(ptr, size)` that `reserve` returned, and only
///    once nothing is mapped inside it ([`Error::StillMapped`](crate::Error::StillMapped)).
///    Every mapped range lies inside one reservation.
/// 3. **Mapping.** `map` needs an unmapped target range ([`Error::AlreadyMapped`](crate::Error::AlreadyMapped))
///    and `size <= handle size`. `offset` must be 0 ([`Error::Unsupported`](crate::Error::Unsupported)
///    otherwise, as the real driver answers `CUDA_ERROR_NOT_SUPPORTED`): map whole handles, or a
///    prefix of one. A fresh mapping has no access: nothing may touch it
///    until `set_access`. One handle may be mapped at several VAs; all show the same bytes.
/// 4. **Unmapping.** `unmap` covers whole mappings exactly; a range that splits a mapping is
///    [`Error::PartialUnmap`](crate::Error::PartialUnmap), one with holes is
///    [`Error::NotMapped`](crate::Error::NotMapped). Unmap does not wait for in-flight work:
///    callers synchronize the streams that may touch the range first.
/// 5. **Access.** `set_access` needs a fully mapped range. After unmap, a new mapping at the same
///    VA starts again with no access.
/// 6. **Release.** `release` drops the creation reference. The memory returns to the device once
///    every mapping of it is unmapped and every exported/imported reference is gone.
///    Usual teardown order: unmap, release, `free_va`.
/// 7. **Export/import.** Only handles created with [`CreateFlags::EXPORTABLE`] export; the file
///    descriptor is a real one that can cross processes (SCM_RIGHTS). `import_fd` does not take
///    ownership of the descriptor and returns a new handle that must be released.
/// 8. **Copies.** Every byte of a copy is either host memory outside every reservation, or device
///    VA mapped with `Read` (source) or `ReadWrite` (destination) access for the device the stream
///    belongs to; otherwise [`Error::IllegalAccess`](crate::Error::IllegalAccess). Copies on one
///    stream run in order; across streams, only events order them.
/// 9. **Capacity.** `create` beyond a device's free physical memory is
///    [`Error::OutOfMemory`](crate::Error::OutOfMemory): a normal outcome that leaves nothing behind.
///
/// Implementations are thread-safe. Library code never dereferences device memory on the CPU:
/// bytes move through `copy_async` / `memset_async` and [`DeviceWork`] only.
pub trait Backend: Send + Sync + 'static {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;
    /// The concrete backend, for backend-specific controls (fault injection, resident bytes).
    fn as_any(&self) -> &dyn std::any::Any;
    /// Number of devices (GPUs or emulated GPUs).
    fn device_count(&self) -> u32;
    /// Name, memory and granularity of a device.
    fn device_info(&self, device: u32) -> Result<DeviceInfo>;
    /// Minimum mapping granularity for physical memory at `location`.
    fn granularity(&self, location: Location) -> Result<u64>;
    /// Free and total physical memory of a device.
    fn mem_info(&self, device: u32) -> Result<MemInfo>;

    /// Reserves `size` bytes of virtual address space aligned to `alignment` (0: granularity).
    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr>;
    /// Frees a whole reservation (precondition 2).
    fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()>;

    /// Creates `size` bytes of physical memory at `location`.
    fn create(&self, location: Location, size: u64, flags: CreateFlags) -> Result<PhysHandle>;
    /// Drops the creation reference of a handle (precondition 6).
    fn release(&self, handle: PhysHandle) -> Result<()>;
    /// Size in bytes of a live handle.
    fn handle_size(&self, handle: PhysHandle) -> Result<u64>;

    /// Maps the first `size` bytes of `handle` to `va`; `offset` must be 0 (precondition 3).
    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()>;
    /// Unmaps whole mappings covering exactly `va..va+size` (precondition 4).
    fn unmap(&self, va: DevicePtr, size: u64) -> Result<()>;
    /// Sets access for each `(location, access)` pair over a fully mapped range (precondition 5).
    fn set_access(&self, va: DevicePtr, size: u64, grants: &[(Location, Access)]) -> Result<()>;

    /// Exports a handle as a POSIX file descriptor (precondition 7).
    fn export_fd(&self, handle: PhysHandle) -> Result<OwnedFd>;
    /// Imports a handle from a file descriptor another process (or this one) exported.
    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle>;

    /// Creates a non-blocking stream on `device`.
    fn stream_create(&self, device: u32) -> Result<StreamHandle>;
    /// Destroys a stream after the work queued on it completes.
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()>;
    /// Blocks until all work queued on `stream` completed; reports asynchronous failures.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()>;
    /// Creates an event (not yet recorded: querying it reports complete).
    fn event_create(&self) -> Result<EventHandle>;
    /// Destroys an event.
    fn event_destroy(&self, event: EventHandle) -> Result<()>;
    /// Records `event` at the current end of `stream`.
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;
    /// True when the work before the last record of `event` completed.
    fn event_query(&self, event: EventHandle) -> Result<bool>;
    /// Blocks until `event` completed.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;
    /// Makes future work on `stream` wait for `event` (no host blocking).
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;

    /// Queues the copies on `stream`, in order, as one batch (CUDA: `cuMemcpyBatchAsync` where
    /// available, else one `cuMemcpyAsync` each). Device ranges are validated at submission.
    ///
    /// # Safety
    ///
    /// 1. Every host (non-device) range in `copies` must be valid for reads (source) or writes
    ///    (destination) of `len` bytes until the copy completes (synchronize the stream or an
    ///    event recorded after it).
    /// 2. No host destination range may be read or written by anyone else until then.
    unsafe fn copy_async(&self, stream: StreamHandle, copies: &[CopyDesc]) -> Result<()>;

    /// Queues a fill of `len` bytes of device VA at `dst` with `value` on `stream`.
    fn memset_async(&self, stream: StreamHandle, dst: DevicePtr, value: u8, len: u64)
        -> Result<()>;

    /// Allocates `size` bytes (at most [`MAX_HOST_CHUNK`](crate::MAX_HOST_CHUNK)) of host
    /// memory that copies to and from every device use at full speed: CUDA pins it
    /// (`cuMemHostAlloc`, portable); the host backend maps page-aligned anonymous memory. The
    /// memory lies outside every reservation (a "host" range in copies), page-aligned, zeroed.
    /// Prefer the owning [`HostBuffer`](crate::HostBuffer). Both strata backends implement it;
    /// the default (for test fakes) is [`Error::Unsupported`](crate::Error::Unsupported).
    fn host_alloc(&self, size: u64) -> Result<DevicePtr> {
        Err(crate::Error::Unsupported(format!(
            "host_alloc of {size} bytes on the {} backend",
            self.kind()
        )))
    }

    /// Frees memory from [`Backend::host_alloc`].
    ///
    /// # Safety
    ///
    /// 1. `ptr` and `size` are exactly what one `host_alloc` of this backend returned and took,
    ///    and it was not freed before.
    /// 2. No copy that touches the range is still in flight and nobody uses it afterwards.
    unsafe fn host_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let _ = size;
        Err(crate::Error::UnknownPointer(ptr))
    }

    /// The kernels and library calls this backend runs on its streams
    /// ([`DeviceWork`](crate::DeviceWork): the block-copy kernel, the FP32 GEMM), or `None`
    /// (the default, for test fakes). Both strata backends return themselves.
    fn device_work(self: Arc<Self>) -> Option<Arc<dyn DeviceWork>> {
        None
    }

    /// Live driver objects created through this backend (leak checks).
    fn live_counts(&self) -> LiveCounts;

    /// Copies `src` into device VA `dst` and waits for it.
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let copy = CopyDesc {
            dst,
            src: src.as_ptr() as DevicePtr,
            len: src.len() as u64,
        };
        // SAFETY: `src` is borrowed for the whole call and the stream is synchronized before
        // returning, so the host range stays valid until the copy completes.
        unsafe { self.copy_async(StreamHandle::DEFAULT, &[copy])? };
        self.stream_synchronize(StreamHandle::DEFAULT)
    }

    /// Copies device VA `src` into `dst` and waits for it.
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let copy = CopyDesc {
            dst: dst.as_mut_ptr() as DevicePtr,
            src,
            len: dst.len() as u64,
        };
        // SAFETY: `dst` is exclusively borrowed for the whole call and the stream is
        // synchronized before returning, so nobody else touches it while the copy runs.
        unsafe { self.copy_async(StreamHandle::DEFAULT, &[copy])? };
        self.stream_synchronize(StreamHandle::DEFAULT)
    }
}

/// The device work of `backend`; [`Error::Unsupported`] for a backend without one.
pub fn device_work(backend: &Arc<dyn Backend>) -> Result<Arc<dyn DeviceWork>> {
    let kind = backend.kind();
    Arc::clone(backend)
        .device_work()
        .ok_or_else(|| Error::Unsupported(format!("no device work on the {kind} backend")))
}
