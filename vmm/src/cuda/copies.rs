//! Copies, fills and pinned host memory of the CUDA backend: the bodies of
//! [`Backend`](crate::Backend)'s `copy_async`, `memset_async`, `host_alloc` and `host_free`, and
//! the copy plan (checked against the VA table, coalesced, submitted in one batch when the driver
//! has `cuMemcpyBatchAsync`) that [`DeviceWork`](crate::DeviceWork) shares.

use super::result::{self, CUresult, CUstream};
use super::{CudaBackend, State};
use crate::error::{Error, Result};
use crate::types::{Access, CopyDesc, DevicePtr, Location, StreamHandle};
use crate::vatable::{Accessor, Translation, VaTable};

impl CudaBackend {
    /// Validates every copy for `accessor` and returns the coalesced `(dst, src, len)` list.
    pub(super) fn plan_copies(
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

    /// The device that runs work on `stream` and what `check` returns for it: a created
    /// stream's own device; for the default stream, the first device for which `check` passes
    /// (else the error device 0 gets).
    pub(super) fn device_for_work<T>(
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
    pub(super) unsafe fn submit(&self, plan: &[(u64, u64, u64)], raw: CUstream) -> Result<()> {
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

    /// [`Backend::copy_async`](crate::Backend::copy_async).
    ///
    /// # Safety
    ///
    /// 1. The caller upholds [`Backend::copy_async`](crate::Backend::copy_async)'s `# Safety` list.
    pub(super) unsafe fn queue_copies(
        &self,
        stream: StreamHandle,
        copies: &[CopyDesc],
    ) -> Result<()> {
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

    /// [`Backend::memset_async`](crate::Backend::memset_async).
    pub(super) fn queue_memset(
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

    /// [`Backend::host_alloc`](crate::Backend::host_alloc).
    pub(super) fn alloc_pinned(&self, size: u64) -> Result<DevicePtr> {
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

    /// [`Backend::host_free`](crate::Backend::host_free).
    ///
    /// # Safety
    ///
    /// 1. The caller upholds [`Backend::host_free`](crate::Backend::host_free)'s `# Safety` list.
    pub(super) unsafe fn free_pinned(&self, ptr: DevicePtr, size: u64) -> Result<()> {
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
}
