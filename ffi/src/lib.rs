//! The C ABI of strata: `libstrata.so`, declared by `include/strata.h`.
//!
//! - `strata_malloc` / `strata_free` have PyTorch's pluggable-allocator signatures exactly
//!   (`torch/csrc/cuda/CUDAPluggableAllocator.h`: four arguments on free), and the hooks PyTorch
//!   can take (`strata_init`, `strata_empty_cache`, `strata_set_memory_fraction`,
//!   `strata_record_stream`) have the signatures of its `set_*_fn` setters, so they return
//!   nothing: failures go to the thread's last error.
//! - Stats, tags (a per-thread stack of names), sleep/wake, version and the last error; small
//!   test-support calls (streams, copies) so C and Python can check contents without touching
//!   device memory from the CPU.
//!
//! Nothing has to be called first: the process's [`Runtime`](strata_runtime::Runtime) (the
//! backend, `strata_vmm::global()` from `STRATA_BACKEND`, and per device one `PagePool` that the
//! [`CachingAllocator`](strata_allocator::CachingAllocator) and Harvest share) is created on
//! first use. Every export runs behind a panic boundary
//! ([`boundary`]): errors become a status (or NULL) plus a readable thread-local last error, and
//! a panic never unwinds into C. Everything is thread-safe and there is no Python inside.
//!
//! `cudaStream_t` is an opaque pointer: its value is the backend's stream handle (NULL is the
//! default stream). Free is stream-ordered (the allocator's events), so a free while work is in
//! flight on other streams never hands the memory to them early.

mod boundary;
mod global;
mod handles;
mod harvest;
mod kv;
mod offload;
mod ops;
mod params;
mod pie;
mod sleep;
mod stats;
mod status;
mod streams;
mod tags;
#[cfg(test)]
mod tests;

use std::ffi::{c_char, c_double, c_int, c_void};

use strata_vmm::{DevicePtr, Error, Result, StreamHandle};

use global::global;
#[cfg(test)]
use sleep::{strata_sleep, strata_wake};
pub use status::Status;

/// `cudaStream_t`: an opaque pointer whose value is the backend's stream handle.
pub type CudaStream = *mut c_void;

#[inline]
fn stream_of(stream: CudaStream) -> StreamHandle {
    StreamHandle(stream as usize as u64)
}

// ---------------------------------------------------------------------------------------------
// Version and errors

/// The library version as a NUL-terminated string with static lifetime.
#[no_mangle]
pub extern "C" fn strata_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The calling thread's most recent failure as a readable message ("" if none). Successful
/// calls leave it unchanged (like `errno`). The pointer stays valid until the thread's next
/// strata call.
#[no_mangle]
pub extern "C" fn strata_last_error() -> *const c_char {
    boundary::value("strata_last_error", c"".as_ptr(), || {
        Ok(boundary::last_error_ptr())
    })
}

/// Clears the calling thread's last error.
#[no_mangle]
pub extern "C" fn strata_clear_error() {
    boundary::void("strata_clear_error", || {
        boundary::clear_last_error();
        Ok(())
    })
}

/// Number of devices of the backend; -1 (and the last error) when no backend opens.
#[no_mangle]
pub extern "C" fn strata_device_count() -> c_int {
    boundary::value("strata_device_count", -1, || {
        Ok(c_int::try_from(global()?.device_count()).unwrap_or(c_int::MAX))
    })
}

// ---------------------------------------------------------------------------------------------
// PyTorch's pluggable-allocator entry points

/// Allocates `size` bytes on `device` for use on `stream`, under the calling thread's current
/// tag. Returns a pointer aligned to at least 256 bytes, or NULL: on failure (out of memory
/// included; see `strata_last_error`) and for `size == 0` (not an error).
#[no_mangle]
pub extern "C" fn strata_malloc(size: usize, device: c_int, stream: CudaStream) -> *mut c_void {
    boundary::value("strata_malloc", std::ptr::null_mut(), || {
        let allocator = global::allocator(global()?, device)?;
        let tag = tags::current();
        let ptr = allocator
            .allocate_tagged(size as u64, stream_of(stream), tag)
            .map_err(|e| explain_tag(e, allocator, tag))?;
        Ok(ptr as usize as *mut c_void)
    })
}

/// Names the tag (the allocator only knows its id) when allocating under it was refused.
#[cold]
#[inline(never)]
fn explain_tag(
    e: Error,
    allocator: &strata_allocator::CachingAllocator,
    tag: strata_allocator::TagId,
) -> Error {
    match (&e, tags::name_of(tag)) {
        (Error::InvalidState(_), Some(name)) if allocator.is_asleep(tag) => Error::InvalidState(
            format!("tag {name:?} is asleep (strata_wake it before allocating under it)"),
        ),
        _ => e,
    }
}

/// Frees `ptr` (from `strata_malloc` on `device`) on `stream`: reusable at once on `stream`,
/// on other streams only after the work queued on `stream` completes. NULL is a no-op. Errors
/// (double free, foreign pointer, bad device) change nothing and go to the last error. `size`
/// is PyTorch's and is not needed: the allocator knows each allocation's size.
#[no_mangle]
pub extern "C" fn strata_free(ptr: *mut c_void, size: usize, device: c_int, stream: CudaStream) {
    boundary::void("strata_free", || free(ptr, size, device, stream))
}

/// `strata_free` returning its status.
#[no_mangle]
pub extern "C" fn strata_free_checked(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: CudaStream,
) -> c_int {
    boundary::status("strata_free_checked", || free(ptr, size, device, stream))
}

#[inline]
fn free(ptr: *mut c_void, _size: usize, device: c_int, stream: CudaStream) -> Result<()> {
    if ptr.is_null() {
        return Ok(());
    }
    let g = global()?;
    let d = g.ordinal(device)?;
    let ptr = ptr as usize as DevicePtr;
    let result = match g.existing(d) {
        Some(a) => a.deallocate(ptr, stream_of(stream)),
        None => Err(Error::UnknownPointer(ptr)),
    };
    result.map_err(|e| explain_foreign(g, e, ptr, d))
}

/// Adds where an unknown pointer really belongs to the error.
#[cold]
#[inline(never)]
fn explain_foreign(g: &strata_runtime::Runtime, e: Error, ptr: DevicePtr, device: usize) -> Error {
    match (&e, g.device_of(ptr)) {
        (Error::UnknownPointer(_), Some(owner)) if owner != device => Error::InvalidArgument(
            format!("pointer {ptr:#x} belongs to device {owner}, freed as device {device}"),
        ),
        _ => e,
    }
}

/// PyTorch's init hook: creates the allocators of devices `0..device_count` now (they are
/// otherwise created on first use).
#[no_mangle]
pub extern "C" fn strata_init(device_count: c_int) {
    boundary::hook("strata_init", || {
        let g = global()?;
        if device_count < 0 {
            return Err(Error::InvalidArgument(format!(
                "device_count {device_count} is negative"
            )));
        }
        for d in 0..device_count {
            global::allocator(g, d)?;
        }
        Ok(())
    })
}

/// PyTorch's reset hook (`torch.cuda.empty_cache`): unmaps every cached page of every device
/// and returns it, and the page pools' free pages (the host pools' of offloaded tags too), to
/// the driver. Live allocations stay. The pools refill again only once allocations ask for
/// pages.
#[no_mangle]
pub extern "C" fn strata_empty_cache() {
    boundary::hook("strata_empty_cache", || {
        let g = global()?;
        let mut first = None;
        for (_, a) in g.existing_all() {
            if let Err(e) = a.empty_cache() {
                first.get_or_insert(e);
            }
        }
        // Every pool, also those only KV spaces and parameters took pages from (no allocator).
        for pool in g.devices().iter().filter_map(|d| d.existing_pool()) {
            pool.trim(0);
        }
        for host in g.devices().iter().filter_map(|d| d.existing_host_pool()) {
            host.trim(0);
        }
        first.map_or(Ok(()), Err)
    })
}

/// PyTorch's memory-fraction hook: caps what strata holds of `device`'s own memory (pages
/// mapped for allocations and cache, and the page pool's free pages) at `fraction` of it
/// (0 ≤ fraction ≤ 1; 1 lifts the cap). Host memory and peer pages behind strata's addresses
/// (offload, overflow) do not count. Beyond the cap, `strata_malloc` returns NULL
/// (`STRATA_LIMIT_EXCEEDED`), except for a tag set to overflow, which goes on there.
#[no_mangle]
pub extern "C" fn strata_set_memory_fraction(fraction: c_double, device: c_int) {
    boundary::hook("strata_set_memory_fraction", || {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!(
                "memory fraction {fraction} outside [0, 1]"
            )));
        }
        let g = global()?;
        let a = global::allocator(g, device)?;
        let total = g.backend().device_info(device as u32)?.total_memory;
        let limit = (fraction < 1.0).then_some((total as f64 * fraction) as u64);
        strata_runtime::set_limit(a, limit)
    })
}

/// PyTorch's record-stream hook: `ptr` is also used on `stream`, so its memory is not reused
/// elsewhere until the work queued on `stream` before its free completes.
#[no_mangle]
pub extern "C" fn strata_record_stream(ptr: *mut c_void, stream: CudaStream) {
    boundary::hook("strata_record_stream", || {
        let ptr = ptr as usize as DevicePtr;
        let g = global()?;
        let d = g.device_of(ptr).ok_or(Error::UnknownPointer(ptr))?;
        g.existing(d)
            .ok_or(Error::UnknownPointer(ptr))?
            .record_stream(ptr, stream_of(stream))
    })
}

// ---------------------------------------------------------------------------------------------
// Tags (sleep and wake: `sleep.rs`)

/// Pushes tag `name` on the calling thread's tag stack: this thread's allocations get it until
/// the matching `strata_tag_pop`. Names are registered on first push (ids 1, 2, ...); with
/// 65,536 registered, names no longer in use are released (see `include/strata.h`).
///
/// # Safety
///
/// `name` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_tag_push(name: *const c_char) -> c_int {
    boundary::status("strata_tag_push", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag name", name) }?;
        tags::push(name)
    })
}

/// Pops the calling thread's tag stack (`STRATA_INVALID_STATE` when it is empty).
#[no_mangle]
pub extern "C" fn strata_tag_pop() -> c_int {
    boundary::status("strata_tag_pop", tags::pop)
}

/// Depth of the calling thread's tag stack.
#[no_mangle]
pub extern "C" fn strata_tag_depth() -> c_int {
    boundary::value("strata_tag_depth", 0, || {
        Ok(c_int::try_from(tags::depth()).unwrap_or(c_int::MAX))
    })
}
