use super::*;

/// Creates an event without timing in the current context.
pub fn create() -> Result<CUevent> {
    let mut event: CUevent = std::ptr::null_mut();
    // SAFETY: `event` is a valid out-pointer; the flag is a valid event flag.
    call("cuEventCreate", || unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    })?;
    Ok(event)
}

/// Destroys an event.
///
/// # Safety
///
/// 1. `event` is live, destroyed once and never used again.
pub unsafe fn destroy(event: CUevent) -> Result<()> {
    // SAFETY: the caller guarantees the event is live and destroyed once.
    call("cuEventDestroy_v2", || unsafe {
        sys::cuEventDestroy_v2(event)
    })
}

/// Records `event` at the current end of `stream`.
///
/// # Safety
///
/// 1. `event` is live; `stream` is null or live, in the same context as `event`.
pub unsafe fn record(event: CUevent, stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees both handles.
    call("cuEventRecord", || unsafe {
        sys::cuEventRecord(event, stream)
    })
}

/// True when the work before the last record of `event` completed.
///
/// # Safety
///
/// 1. `event` is live.
pub unsafe fn query(event: CUevent) -> Result<bool> {
    // SAFETY: the caller guarantees the event is live.
    match call("cuEventQuery", || unsafe { sys::cuEventQuery(event) }) {
        Ok(()) => Ok(true),
        Err(e) if is_code(&e, CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Blocks until `event` completed.
///
/// # Safety
///
/// 1. `event` is live.
pub unsafe fn synchronize(event: CUevent) -> Result<()> {
    // SAFETY: the caller guarantees the event is live.
    call("cuEventSynchronize", || unsafe {
        sys::cuEventSynchronize(event)
    })
}
