use super::*;

/// Retains the primary context of `dev` (creating it on first retain).
pub fn retain_primary(dev: CUdevice) -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer; `dev` is validated by the driver.
    call("cuDevicePrimaryCtxRetain", || unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    Ok(ctx)
}

/// Releases one reference to the primary context of `dev`.
///
/// # Safety
///
/// 1. Each call matches exactly one earlier successful [`retain_primary`] of `dev` by the
///    caller.
/// 2. After the caller's last release, the caller uses no object (stream, event, memory) of
///    that context any more and does not make it current again.
pub unsafe fn release_primary(dev: CUdevice) -> Result<()> {
    // SAFETY: the caller guarantees the release balances one of its own retains.
    call("cuDevicePrimaryCtxRelease_v2", || unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(dev)
    })
}

/// Makes `ctx` current on the calling thread.
///
/// # Safety
///
/// 1. `ctx` is null or a context that is alive (for a primary context: retained by the caller
///    for the whole time it stays current through this call).
pub unsafe fn set_current(ctx: CUcontext) -> Result<()> {
    // SAFETY: the caller guarantees `ctx` is alive.
    call("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(ctx) })
}
