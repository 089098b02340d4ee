use super::*;

/// `(free, total)` bytes of the device whose context is current on this thread.
pub fn get_info() -> Result<(u64, u64)> {
    let mut free: usize = 0;
    let mut total: usize = 0;
    // SAFETY: both are valid out-pointers; without a current context the driver reports an
    // error.
    call("cuMemGetInfo_v2", || unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}
