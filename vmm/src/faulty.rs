//! [`FaultyBackend`]: the host backend's test hooks over any backend. Fault injection, gates
//! and slow streams wrap a backend (the host emulation, the emulated driver, a GPU), so the
//! tests that need them run on real hardware too instead of skipping there.

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::Result;
use crate::host::fault::FaultPlan;
use crate::host::{FaultOp, OpGate};
use crate::types::{
    Access, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, EventHandle, LiveCounts,
    Location, MemInfo, PhysHandle, StreamHandle,
};
use crate::work::{DeviceWork, GemmF32};

/// A [`Backend`] that forwards every call to `inner`, with three test controls:
///
/// - **faults**: [`FaultyBackend::inject_fault`] fails the nth later call of an operation with
///   [`Error::InjectedFault`](crate::Error::InjectedFault) before it reaches `inner` (so it
///   changes nothing), as [`HostBackend::inject_fault`](crate::HostBackend::inject_fault) does;
/// - **gates**: [`FaultyBackend::set_op_gate`] runs a hook on the calling thread before an
///   operation reaches `inner` (to hold a driver call while a test checks what other threads
///   can do), as [`HostBackend::set_op_gate`](crate::HostBackend::set_op_gate) does;
/// - **slow streams**: [`FaultyBackend::set_stream_latency`] makes each piece of work queued on
///   a stream take at least that long, as far as events and synchronization report: an event
///   recorded behind it queries incomplete and synchronization waits until then. The work
///   itself runs at `inner`'s speed (finishing early is always safe), so this models work in
///   flight for the caller's ordering logic, on any device, like the host backend's link model.
///
/// Operations map to [`FaultOp`] as on the host backend: `create`, `map`, `set_access`, `unmap`,
/// and `Copy` for `copy_async`, `memset_async` and the block-copy kernel. Device work is
/// forwarded when `inner` has it. [`Backend::as_any`] is this wrapper; [`FaultyBackend::inner`]
/// reaches the backend below.
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    work: Option<Arc<dyn DeviceWork>>,
    faults: FaultPlan,
    slow: Mutex<SlowStreams>,
}

/// The completion times the wrapper reports, per stream and event.
#[derive(Default)]
struct SlowStreams {
    /// Extra time each piece of work queued on a stream takes.
    latency: HashMap<StreamHandle, Duration>,
    /// When the work queued so far on a stream is reported complete.
    busy_until: HashMap<StreamHandle, Instant>,
    /// When an event is reported complete (its stream's `busy_until` at the record).
    events: HashMap<EventHandle, Instant>,
}

impl SlowStreams {
    /// Queues one piece of work on `stream`: it completes `latency` after the stream's previous
    /// work (or now, if that is done).
    fn queue(&mut self, stream: StreamHandle) {
        let Some(&latency) = self.latency.get(&stream) else {
            return;
        };
        let now = Instant::now();
        let start = self.busy_until.get(&stream).map_or(now, |&t| t.max(now));
        self.busy_until.insert(stream, start + latency);
    }
}

fn sleep_until(deadline: Option<Instant>) {
    if let Some(wait) = deadline.and_then(|t| t.checked_duration_since(Instant::now())) {
        std::thread::sleep(wait);
    }
}

impl FaultyBackend {
    /// Wraps `inner`; nothing is injected, gated or slowed until asked.
    pub fn new(inner: Arc<dyn Backend>) -> Arc<FaultyBackend> {
        let work = Arc::clone(&inner).device_work();
        Arc::new(FaultyBackend {
            inner,
            work,
            faults: FaultPlan::default(),
            slow: Mutex::default(),
        })
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// Makes the `nth` subsequent call of `op` (1: the next one) fail with
    /// [`Error::InjectedFault`](crate::Error::InjectedFault) before it reaches the wrapped
    /// backend. One-shot; replaces an earlier plan for the same operation.
    pub fn inject_fault(&self, op: FaultOp, nth: u64) {
        self.faults.arm(op, nth);
    }

    /// Disarms every injected fault.
    pub fn clear_faults(&self) {
        self.faults.clear();
    }

    /// Runs `gate` at the start of every call of `op` (`None`: no more), on the calling thread,
    /// before the call reaches the wrapped backend (and before an injected fault of that call).
    pub fn set_op_gate(&self, op: FaultOp, gate: Option<OpGate>) {
        self.faults.set_gate(op, gate);
    }

    /// Makes every piece of work queued on `stream` from now on (copies, fills, kernels) take at
    /// least `latency` more, in stream order, as events and synchronization report it (`None`:
    /// back to the wrapped backend's own speed for later work).
    pub fn set_stream_latency(&self, stream: StreamHandle, latency: Option<Duration>) {
        let mut slow = self.slow.lock();
        match latency {
            Some(l) => slow.latency.insert(stream, l),
            None => slow.latency.remove(&stream),
        };
    }

    /// When the work queued on `stream` so far is reported complete (`None`: no delay).
    fn stream_deadline(&self, stream: StreamHandle) -> Option<Instant> {
        self.slow.lock().busy_until.get(&stream).copied()
    }

    fn event_deadline(&self, event: EventHandle) -> Option<Instant> {
        self.slow.lock().events.get(&event).copied()
    }
}

impl Backend for FaultyBackend {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn device_count(&self) -> u32 {
        self.inner.device_count()
    }
    fn device_info(&self, device: u32) -> Result<DeviceInfo> {
        self.inner.device_info(device)
    }
    fn granularity(&self, location: Location) -> Result<u64> {
        self.inner.granularity(location)
    }
    fn mem_info(&self, device: u32) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }
    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.inner.reserve(size, alignment)
    }
    fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.inner.free_va(ptr, size)
    }
    fn create(&self, location: Location, size: u64, flags: CreateFlags) -> Result<PhysHandle> {
        self.faults.check(FaultOp::Create)?;
        self.inner.create(location, size, flags)
    }
    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.inner.release(handle)
    }
    fn handle_size(&self, handle: PhysHandle) -> Result<u64> {
        self.inner.handle_size(handle)
    }
    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        self.faults.check(FaultOp::Map)?;
        self.inner.map(va, size, handle, offset)
    }
    fn unmap(&self, va: DevicePtr, size: u64) -> Result<()> {
        self.faults.check(FaultOp::Unmap)?;
        self.inner.unmap(va, size)
    }
    fn set_access(&self, va: DevicePtr, size: u64, grants: &[(Location, Access)]) -> Result<()> {
        self.faults.check(FaultOp::SetAccess)?;
        self.inner.set_access(va, size, grants)
    }
    fn export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.inner.export_fd(handle)
    }
    fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle> {
        self.inner.import_fd(fd)
    }
    fn stream_create(&self, device: u32) -> Result<StreamHandle> {
        self.inner.stream_create(device)
    }
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        let mut slow = self.slow.lock();
        slow.latency.remove(&stream);
        slow.busy_until.remove(&stream);
        drop(slow);
        self.inner.stream_destroy(stream)
    }
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        sleep_until(self.stream_deadline(stream));
        self.inner.stream_synchronize(stream)
    }
    fn event_create(&self) -> Result<EventHandle> {
        self.inner.event_create()
    }
    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.slow.lock().events.remove(&event);
        self.inner.event_destroy(event)
    }
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.inner.event_record(event, stream)?;
        let mut slow = self.slow.lock();
        match slow.busy_until.get(&stream).copied() {
            Some(t) => slow.events.insert(event, t),
            None => slow.events.remove(&event),
        };
        Ok(())
    }
    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let done = self.inner.event_query(event)?;
        Ok(done
            && self
                .event_deadline(event)
                .is_none_or(|t| Instant::now() >= t))
    }
    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        sleep_until(self.event_deadline(event));
        self.inner.event_synchronize(event)
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.inner.stream_wait_event(stream, event)?;
        let mut slow = self.slow.lock();
        if let Some(t) = slow.events.get(&event).copied() {
            let later = slow.busy_until.get(&stream).map_or(t, |&b| b.max(t));
            slow.busy_until.insert(stream, later);
        }
        Ok(())
    }
    unsafe fn copy_async(&self, stream: StreamHandle, copies: &[CopyDesc]) -> Result<()> {
        self.faults.check(FaultOp::Copy)?;
        // SAFETY: the caller upholds this method's `# Safety` list, which is the callee's.
        unsafe { self.inner.copy_async(stream, copies)? };
        self.slow.lock().queue(stream);
        Ok(())
    }
    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        self.faults.check(FaultOp::Copy)?;
        self.inner.memset_async(stream, dst, value, len)?;
        self.slow.lock().queue(stream);
        Ok(())
    }
    fn host_alloc(&self, size: u64) -> Result<DevicePtr> {
        self.inner.host_alloc(size)
    }
    unsafe fn host_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        // SAFETY: the caller upholds this method's `# Safety` list, which is the callee's.
        unsafe { self.inner.host_free(ptr, size) }
    }
    fn device_work(self: Arc<Self>) -> Option<Arc<dyn DeviceWork>> {
        self.work.is_some().then_some(self as Arc<dyn DeviceWork>)
    }
    fn live_counts(&self) -> LiveCounts {
        self.inner.live_counts()
    }
}

impl DeviceWork for FaultyBackend {
    unsafe fn copy_blocks_async(
        &self,
        stream: StreamHandle,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<()> {
        self.faults.check(FaultOp::Copy)?;
        let work = self
            .work
            .as_ref()
            .expect("device work is handed out only when present");
        // SAFETY: the caller upholds this method's `# Safety` list, which is the callee's.
        unsafe { work.copy_blocks_async(stream, len, pairs)? };
        self.slow.lock().queue(stream);
        Ok(())
    }

    fn gemm_f32_async(&self, stream: StreamHandle, gemm: &GemmF32) -> Result<()> {
        let work = self
            .work
            .as_ref()
            .expect("device work is handed out only when present");
        work.gemm_f32_async(stream, gemm)?;
        self.slow.lock().queue(stream);
        Ok(())
    }
}
