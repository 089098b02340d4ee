//! Offload and onload of a tag: `strata_offload` moves its live allocations to host memory
//! (still device-accessible, at the link's speed) or to disk (sleep: not accessible until
//! onload), `strata_onload` brings them back; pointers never change.

use std::ffi::{c_char, c_int};

use strata_vmm::{Error, Result};

use crate::{boundary, global::global, sleeping, stream_of, tags, CudaStream};

/// `STRATA_TIER_HOST`: host memory mapped for the device at the same addresses.
pub const TIER_HOST: c_int = 1;
/// `STRATA_TIER_DISK`: an unlinked file in the temporary directory (`TMPDIR`), like
/// `strata_sleep_to_disk`.
pub const TIER_DISK: c_int = 2;

/// Moves tag `tag`'s live allocations on every device to `tier` at the same addresses, the
/// copies ordered on `stream`. See `include/strata.h`.
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_offload(
    tag: *const c_char,
    tier: c_int,
    stream: CudaStream,
) -> c_int {
    boundary::status("strata_offload", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        match tier {
            TIER_HOST => offload_to_host(name, stream),
            TIER_DISK => {
                let dir = std::env::temp_dir();
                crate::sleep_tag(name, |a, id| a.sleep_to_disk(id, &dir))
            }
            _ => Err(Error::InvalidArgument(format!(
                "tier {tier} (STRATA_TIER_HOST = {TIER_HOST}, STRATA_TIER_DISK = {TIER_DISK})"
            ))),
        }
    })
}

/// Brings tag `tag`'s allocations back onto the devices' own memory at the same addresses:
/// from host memory (copies ordered on `stream`) or from disk (a wake). See
/// `include/strata.h`.
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_onload(tag: *const c_char, stream: CudaStream) -> c_int {
    boundary::status("strata_onload", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        let lease = tags::lease(name)?;
        if sleeping::lock().contains(&lease.id()) {
            return crate::wake_tag(name);
        }
        let g = global()?;
        for (_, a) in g.existing_all() {
            a.onload(lease.id(), stream_of(stream))?;
        }
        Ok(())
    })
}

fn offload_to_host(name: &str, stream: CudaStream) -> Result<()> {
    let lease = tags::lease(name)?;
    let g = global()?;
    let _no_sleep_meanwhile = sleeping::lock();
    for device in g.devices() {
        if let Some(a) = device.existing_allocator() {
            a.offload(lease.id(), device.host_pool()?, stream_of(stream))?;
        }
    }
    Ok(())
}
