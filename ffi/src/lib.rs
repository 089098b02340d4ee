//! The C ABI of strata. The foundation exports only the version; the framework-integration issue
//! adds the allocator entry points, hooks, stats, tags and sleep/wake behind the same boundary.

use std::ffi::c_char;

/// The library version as a NUL-terminated string with static lifetime.
#[no_mangle]
pub extern "C" fn strata_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
