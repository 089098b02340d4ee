use super::*;

/// Creates a non-blocking stream in the current context.
pub fn create() -> Result<CUstream> {
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: `stream` is a valid out-pointer; the flag is a valid stream flag.
    call("cuStreamCreate", || unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    })?;
    Ok(stream)
}

/// Destroys a stream (queued work still completes).
///
/// # Safety
///
/// 1. `stream` is a live stream created by [`create`], destroyed once and never used again.
pub unsafe fn destroy(stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees the stream is live and destroyed once.
    call("cuStreamDestroy_v2", || unsafe {
        sys::cuStreamDestroy_v2(stream)
    })
}

/// Waits for all work queued on `stream`.
///
/// # Safety
///
/// 1. `stream` is null (the legacy default stream of the current context) or live.
pub unsafe fn synchronize(stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees the stream is null or live.
    call("cuStreamSynchronize", || unsafe {
        sys::cuStreamSynchronize(stream)
    })
}

/// Makes future work on `stream` wait for `event`.
///
/// # Safety
///
/// 1. `stream` is null or live; `event` is live.
pub unsafe fn wait_event(stream: CUstream, event: CUevent) -> Result<()> {
    // SAFETY: the caller guarantees both handles; flags 0 is the default wait.
    call("cuStreamWaitEvent", || unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    })
}
