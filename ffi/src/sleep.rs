//! Sleep to a tier: `strata_sleep_to_disk` keeps a sleeping tag's contents in a file instead of
//! host memory (torch_memory_saver's disk backup); `strata_wake` restores them with the file
//! reads and the device writes pipelined.

use std::ffi::{c_char, c_int};
use std::path::Path;

use strata_allocator::CachingAllocator;

use crate::boundary;
use crate::global::{self, global};

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
        let id = global::tag_id(name)?;
        let mut slept: Vec<&CachingAllocator> = Vec::new();
        for (_, a) in global()?.existing_all() {
            if let Err(e) = a.sleep_to_disk(id, dir) {
                for b in &slept {
                    // The wake error is secondary: the sleep error is what the caller sees.
                    let _ = b.wake(id);
                }
                return Err(e);
            }
            slept.push(a);
        }
        Ok(())
    })
}
