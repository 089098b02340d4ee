//! Test support: streams and copies, so callers check contents without CPU access to device
//! memory (the host backend's strict mode forbids it, as a GPU does).

use std::ffi::{c_int, c_void};

use strata_vmm::{CopyDesc, DevicePtr, Error, Result, StreamHandle};

use crate::boundary;
use crate::global::global;
use crate::{stream_of, CudaStream};

/// Creates a stream on `device` (a real `CUstream` on CUDA) and stores it in `*out`.
///
/// # Safety
///
/// `out` is NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn strata_stream_create(device: c_int, out: *mut CudaStream) -> c_int {
    boundary::status("strata_stream_create", || {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let g = global()?;
        let d = g.ordinal(device)?;
        let s = g.backend().stream_create(d as u32)?;
        let ptr = usize::try_from(s.0).map_err(|_| Error::Overflow("stream handle"))?;
        // SAFETY: `out` is non-NULL and valid for one write by this function's contract.
        unsafe { out.write(ptr as CudaStream) };
        Ok(())
    })
}

/// Destroys a stream from `strata_stream_create` once its work completes.
#[no_mangle]
pub extern "C" fn strata_stream_destroy(stream: CudaStream) -> c_int {
    boundary::status("strata_stream_destroy", || {
        if stream.is_null() {
            return Err(Error::InvalidArgument(
                "cannot destroy the default stream".into(),
            ));
        }
        global()?.backend().stream_destroy(stream_of(stream))
    })
}

/// Blocks until the work queued on `stream` completed (NULL: the default stream).
#[no_mangle]
pub extern "C" fn strata_stream_synchronize(stream: CudaStream) -> c_int {
    boundary::status("strata_stream_synchronize", || {
        global()?.backend().stream_synchronize(stream_of(stream))
    })
}

/// A copy that touched memory that is not mapped and accessible is the caller's mistake (freed,
/// out of range, asleep), not a broken mapping rule inside strata.
#[cold]
#[inline(never)]
fn explain_copy(e: Error, va: DevicePtr, len: usize) -> Error {
    match e {
        Error::NotMapped { .. } | Error::IllegalAccess { .. } | Error::NotReserved { .. } => {
            Error::InvalidArgument(format!(
                "{va:#x}+{len:#x} is not inside live, awake memory from strata_malloc (freed, \
                 out of range, or its tag asleep): {e}"
            ))
        }
        e => e,
    }
}

/// Checks that `ptr..ptr+len` starts inside memory strata hands out (the backend then checks
/// the rest: mapped, accessible).
fn device_range(g: &strata_runtime::Runtime, ptr: *const c_void, len: usize) -> Result<DevicePtr> {
    let va = ptr as usize as DevicePtr;
    if g.device_of(va).is_none() {
        return Err(Error::InvalidArgument(format!(
            "{va:#x} is not device memory from strata_malloc"
        )));
    }
    va.checked_add(len as u64)
        .ok_or(Error::Overflow("copy range"))?;
    Ok(va)
}

/// Copies `len` bytes from host memory `src` to device memory `dst` (from `strata_malloc`)
/// and waits for the copy.
///
/// # Safety
///
/// `src` is valid for reading `len` bytes for the duration of the call.
#[no_mangle]
pub unsafe extern "C" fn strata_memcpy_htod(
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
) -> c_int {
    boundary::status("strata_memcpy_htod", || {
        if len == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(Error::InvalidArgument("src is NULL".into()));
        }
        let g = global()?;
        let dst = device_range(g, dst, len)?;
        let copy = CopyDesc {
            dst,
            src: src as usize as DevicePtr,
            len: len as u64,
        };
        // SAFETY: `src` is valid for `len` bytes for the whole call (this function's contract)
        // and the stream is synchronized before returning.
        unsafe { g.backend().copy_async(StreamHandle::DEFAULT, &[copy]) }
            .and_then(|()| g.backend().stream_synchronize(StreamHandle::DEFAULT))
            .map_err(|e| explain_copy(e, dst, len))
    })
}

/// Copies `len` bytes from device memory `src` (from `strata_malloc`) to host memory `dst` and
/// waits for the copy.
///
/// # Safety
///
/// `dst` is valid for writing `len` bytes, and nobody else touches it, for the duration of the
/// call.
#[no_mangle]
pub unsafe extern "C" fn strata_memcpy_dtoh(
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
) -> c_int {
    boundary::status("strata_memcpy_dtoh", || {
        if len == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(Error::InvalidArgument("dst is NULL".into()));
        }
        let g = global()?;
        let src = device_range(g, src, len)?;
        let copy = CopyDesc {
            dst: dst as usize as DevicePtr,
            src,
            len: len as u64,
        };
        // SAFETY: `dst` is valid and exclusively ours for `len` bytes for the whole call (this
        // function's contract) and the stream is synchronized before returning.
        unsafe { g.backend().copy_async(StreamHandle::DEFAULT, &[copy]) }
            .and_then(|()| g.backend().stream_synchronize(StreamHandle::DEFAULT))
            .map_err(|e| explain_copy(e, src, len))
    })
}
