//! Sleep to a tier: `strata_sleep_to_disk` keeps a sleeping tag's contents in a file instead of
//! host memory (torch_memory_saver's disk backup); `strata_wake` restores them with the file
//! reads and the device writes pipelined.

use std::ffi::{c_char, c_int};
use std::path::Path;

use crate::boundary;

/// Puts tag `tag` to sleep on every device in use, its live allocations copied into an unlinked
/// file in directory `dir`. All or nothing across devices. See `include/strata.h`.
///
/// # Safety
///
/// `tag` and `dir` are NULL (an error) or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn strata_sleep_to_disk(tag: *const c_char, dir: *const c_char) -> c_int {
    boundary::status("strata_sleep_to_disk", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        // SAFETY: as above.
        let dir = Path::new(unsafe { boundary::c_str("dir", dir) }?);
        crate::sleep_tag(name, |a, id| a.sleep_to_disk(id, dir))
    })
}
