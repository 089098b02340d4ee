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
mod params;
mod sleep;
mod sleeping;
mod status;
mod tags;
#[cfg(test)]
mod tests;

use std::ffi::{c_char, c_double, c_int, c_void};

use strata_allocator::{AllocatorStats, TagStats};
use strata_runtime::DeviceStats;
use strata_vmm::{CopyDesc, DevicePtr, Error, Location, Result, StreamHandle};

use global::global;
pub use status::Status;

/// `cudaStream_t`: an opaque pointer whose value is the backend's stream handle.
pub type CudaStream = *mut c_void;

#[inline]
fn stream_of(stream: CudaStream) -> StreamHandle {
    StreamHandle(stream as usize as u64)
}

/// Per-device statistics (`strata_stats_t`). Byte figures are exact; counts are since the
/// device's allocator was created.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_stats_t {
    /// The device these figures are for.
    pub device: i32,
    /// 1 when the device's allocator exists (it is created on first use), else 0 and every
    /// figure below except `total_bytes` is 0.
    pub initialized: i32,
    /// Physical memory of the device.
    pub total_bytes: u64,
    /// Mapping granularity (page size).
    pub page_size: u64,
    /// Requested bytes of live allocations.
    pub allocated_bytes: u64,
    /// Bytes of the blocks holding live allocations (size classes, or 512-byte multiples).
    pub allocated_block_bytes: u64,
    /// Bytes of pages the allocator holds mapped (live blocks, small segments, cache).
    pub reserved_bytes: u64,
    /// Pages held mapped (`reserved_bytes / page_size`).
    pub mapped_pages: u64,
    /// Bytes of freed large blocks kept mapped for reuse.
    pub cached_large_bytes: u64,
    /// Bytes of free physical pages in the device's page pool (created, not mapped).
    pub pool_free_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Live allocations.
    pub live_allocations: u64,
    /// Freed blocks waiting for work on other streams before reuse.
    pub pending_blocks: u64,
    /// Cap on reserved bytes (`strata_set_memory_fraction`); 0 when none (see `limit_set`).
    pub limit_bytes: u64,
    pub allocs: u64,
    pub frees: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Out-of-memory and limit failures.
    pub ooms: u64,
    pub sleeps: u64,
    pub wakes: u64,
    /// Bytes of the device's pool pages in use (by the allocator, lent to peers, KV spaces).
    pub pool_in_use_bytes: u64,
    /// Of `pool_in_use_bytes`, bytes lent to peers (Harvest placements on this device).
    pub lent_bytes: u64,
    /// Bytes of peers' pages this device borrowed (its Harvest placements elsewhere).
    pub borrowed_bytes: u64,
    /// 1 when a cap is set (`limit_bytes` is then the cap, possibly 0), else 0.
    pub limit_set: u64,
    /// Zero; room to grow without changing the struct's size.
    pub spare: [u64; 4],
}

/// Per-tag statistics on one device (`strata_tag_stats_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_tag_stats_t {
    /// The tag's numeric id (1, 2, ...: in order of first `strata_tag_push`; the id of a
    /// released name is reused).
    pub tag_id: u32,
    /// 1 while the tag sleeps on this device.
    pub asleep: i32,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub live_allocations: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Bytes held in host copies while asleep.
    pub host_copy_bytes: u64,
    /// Zero; room to grow.
    pub spare: [u64; 4],
}

impl strata_stats_t {
    /// The figures of `device`: its allocator's, if created, and its pool's, if created.
    fn of(device: i32, total: u64, page_size: u64, stats: &DeviceStats) -> Self {
        let mut out = match &stats.allocator {
            Some(a) => Self::from_allocator(device, total, a),
            None => strata_stats_t {
                device,
                total_bytes: total,
                page_size,
                ..Default::default()
            },
        };
        if let Some(pool) = &stats.pool {
            let bytes = |pages: usize| pages as u64 * pool.page_size;
            out.pool_free_bytes = bytes(pool.free);
            out.pool_in_use_bytes = bytes(pool.in_use);
            out.lent_bytes = bytes(pool.lent);
            out.borrowed_bytes = bytes(pool.borrowed);
        }
        out
    }

    fn from_allocator(device: i32, total: u64, s: &AllocatorStats) -> Self {
        strata_stats_t {
            device,
            initialized: 1,
            total_bytes: total,
            page_size: s.page_size,
            allocated_bytes: s.allocated_bytes,
            allocated_block_bytes: s.allocated_block_bytes,
            reserved_bytes: s.reserved_bytes,
            mapped_pages: s.mapped_pages,
            cached_large_bytes: s.cached_large_bytes,
            pool_free_bytes: 0,
            peak_allocated_bytes: s.peak_allocated_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
            live_allocations: s.live_allocations,
            pending_blocks: s.pending_blocks,
            limit_bytes: s.limit.unwrap_or(0),
            allocs: s.counts.allocs,
            frees: s.counts.frees,
            cache_hits: s.counts.cache_hits,
            cache_misses: s.counts.cache_misses,
            ooms: s.counts.ooms,
            sleeps: s.counts.sleeps,
            wakes: s.counts.wakes,
            pool_in_use_bytes: 0,
            lent_bytes: 0,
            borrowed_bytes: 0,
            limit_set: u64::from(s.limit.is_some()),
            spare: [0; 4],
        }
    }
}

impl strata_tag_stats_t {
    fn from_stats(tag_id: u32, t: Option<&TagStats>) -> Self {
        let Some(t) = t else {
            return strata_tag_stats_t {
                tag_id,
                ..Default::default()
            };
        };
        strata_tag_stats_t {
            tag_id,
            asleep: t.asleep as i32,
            allocated_bytes: t.allocated_bytes,
            reserved_bytes: t.reserved_bytes,
            peak_allocated_bytes: t.peak_allocated_bytes,
            live_allocations: t.live_allocations,
            allocs: t.allocs,
            frees: t.frees,
            host_copy_bytes: t.host_copy_bytes,
            spare: [0; 4],
        }
    }
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
    boundary::void("strata_init", || {
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
/// and returns it, and the page pools' free pages, to the driver. Live allocations stay. The
/// pools refill again only once allocations ask for pages.
#[no_mangle]
pub extern "C" fn strata_empty_cache() {
    boundary::void("strata_empty_cache", || {
        let g = global()?;
        let mut first = None;
        for (_, a) in g.existing_all() {
            if let Err(e) = a.empty_cache() {
                first.get_or_insert(e);
            }
            a.pool().trim(0);
        }
        first.map_or(Ok(()), Err)
    })
}

/// PyTorch's memory-fraction hook: caps what strata holds on `device` (pages mapped for
/// allocations and cache, and the page pool's free pages) at `fraction` of the device's memory
/// (0 ≤ fraction ≤ 1; 1 lifts the cap). Beyond the cap, `strata_malloc` returns NULL
/// (`STRATA_LIMIT_EXCEEDED`).
#[no_mangle]
pub extern "C" fn strata_set_memory_fraction(fraction: c_double, device: c_int) {
    boundary::void("strata_set_memory_fraction", || {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!(
                "memory fraction {fraction} outside [0, 1]"
            )));
        }
        let g = global()?;
        let a = global::allocator(g, device)?;
        let total = g.backend().device_info(device as u32)?.total_memory;
        let limit = (fraction < 1.0).then_some((total as f64 * fraction) as u64);
        a.set_limit(limit)?;
        // The cap covers the pool's free pages too: all that strata holds on the device.
        a.pool().set_limit(limit);
        Ok(())
    })
}

/// PyTorch's record-stream hook: `ptr` is also used on `stream`, so its memory is not reused
/// elsewhere until the work queued on `stream` before its free completes.
#[no_mangle]
pub extern "C" fn strata_record_stream(ptr: *mut c_void, stream: CudaStream) {
    boundary::void("strata_record_stream", || {
        let ptr = ptr as usize as DevicePtr;
        let g = global()?;
        let d = g.device_of(ptr).ok_or(Error::UnknownPointer(ptr))?;
        g.existing(d)
            .ok_or(Error::UnknownPointer(ptr))?
            .record_stream(ptr, stream_of(stream))
    })
}

// ---------------------------------------------------------------------------------------------
// Stats

/// Fills `*out` with `device`'s figures. A device whose allocator does not exist yet reports
/// zeros (and `initialized == 0`).
///
/// # Safety
///
/// `out` is NULL (an error) or valid for writing one `strata_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_stats(device: c_int, out: *mut strata_stats_t) -> c_int {
    boundary::status("strata_stats", || {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let g = global()?;
        let d = g.ordinal(device)?;
        let total = g.backend().device_info(d as u32)?.total_memory;
        let page_size = g.backend().granularity(Location::Device(d as u32))?;
        let stats = strata_stats_t::of(device, total, page_size, &g.devices()[d].stats());
        // SAFETY: `out` is non-NULL and valid for one write by this function's contract.
        unsafe { out.write(stats) };
        Ok(())
    })
}

/// Fills `*out` with the figures of tag `tag` on `device` (zeros where it was never used).
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string; `out` is NULL (an error) or valid for
/// writing one `strata_tag_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_tag_stats(
    tag: *const c_char,
    device: c_int,
    out: *mut strata_tag_stats_t,
) -> c_int {
    boundary::status("strata_tag_stats", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let lease = tags::lease(name)?;
        let id = lease.id();
        let g = global()?;
        let d = g.ordinal(device)?;
        let stats = match g.existing(d) {
            Some(a) => strata_tag_stats_t::from_stats(id, a.stats().tag(id)),
            None => strata_tag_stats_t::from_stats(id, None),
        };
        // SAFETY: `out` is non-NULL and valid for one write by this function's contract.
        unsafe { out.write(stats) };
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Tags, sleep and wake

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

/// Puts tag `tag` to sleep on every device: waits for the streams using its memory, copies its
/// live allocations to host memory when `keep_host_copy` is non-zero, then unmaps and releases
/// its pages; pointers keep their addresses. Allocating under a sleeping tag fails
/// (`STRATA_INVALID_STATE`); freeing its pointers works. A device first used while the tag
/// sleeps starts with it asleep. All or nothing: a tag already asleep on some device is
/// refused before anything changes, and if one device fails, those already put to sleep by
/// this call are woken again; should that wake fail too, the status is
/// `STRATA_INVALID_STATE` and the message names the devices left asleep (`strata_wake` wakes
/// them).
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_sleep(tag: *const c_char, keep_host_copy: c_int) -> c_int {
    boundary::status("strata_sleep", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        sleep_tag(name, |a, id| a.sleep(id, keep_host_copy != 0))
    })
}

/// Puts tag `name` to sleep on every device with `put` (host copies, none, or a file), all or
/// nothing: a tag already asleep anywhere is refused before anything changes, and a device's
/// failure wakes the devices this call put to sleep (see [`roll_back_sleep`]).
pub(crate) fn sleep_tag(
    name: &str,
    put: impl Fn(&strata_allocator::CachingAllocator, strata_allocator::TagId) -> Result<()>,
) -> Result<()> {
    let lease = tags::lease(name)?;
    let id = lease.id();
    let g = global()?;
    let mut sleeping = sleeping::lock();
    let asleep_on: Vec<String> = g
        .existing_all()
        .filter(|(_, a)| a.is_asleep(id))
        .map(|(d, _)| d.to_string())
        .collect();
    if sleeping.contains(&id) || !asleep_on.is_empty() {
        let place = match asleep_on.len() {
            0 => String::new(),
            1 => format!(" on device {}", asleep_on[0]),
            _ => format!(" on devices {}", asleep_on.join(", ")),
        };
        return Err(Error::InvalidState(format!(
            "tag {name:?} is already asleep{place}"
        )));
    }
    let mut slept: Vec<(usize, &strata_allocator::CachingAllocator)> = Vec::new();
    for (d, a) in g.existing_all() {
        if let Err(e) = put(a, id) {
            return Err(roll_back_sleep(name, id, d, e, &slept));
        }
        slept.push((d, a));
    }
    sleeping.insert(id);
    Ok(())
}

/// Wakes the devices a failed `strata_sleep` already put to sleep. The sleep's error is what
/// the caller sees, unless a wake fails too: then the state no longer matches that error, and
/// the caller is told which devices stay asleep.
#[cold]
#[inline(never)]
fn roll_back_sleep(
    name: &str,
    id: strata_allocator::TagId,
    failed_on: usize,
    error: Error,
    slept: &[(usize, &strata_allocator::CachingAllocator)],
) -> Error {
    let stuck: Vec<String> = slept
        .iter()
        .filter_map(|(d, a)| a.wake(id).err().map(|e| format!("device {d} ({e})")))
        .collect();
    if stuck.is_empty() {
        return error;
    }
    Error::InvalidState(format!(
        "putting tag {name:?} to sleep failed on device {failed_on} ({error}), and waking it \
         back failed on {}: the tag stays asleep there; strata_wake wakes it",
        stuck.join(", ")
    ))
}

/// Wakes tag `tag` on every device where it sleeps: maps fresh pages at the same addresses and
/// restores the host copies (or zeros). A tag asleep nowhere is `STRATA_INVALID_STATE`. On
/// failure (out of memory included) the devices not yet woken stay asleep; call again.
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_wake(tag: *const c_char) -> c_int {
    boundary::status("strata_wake", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        let lease = tags::lease(name)?;
        let id = lease.id();
        let g = global()?;
        let mut sleeping = sleeping::lock();
        let mut woke = sleeping.contains(&id);
        for (_, a) in g.existing_all() {
            if a.is_asleep(id) {
                a.wake(id)?;
                woke = true;
            }
        }
        if !woke {
            return Err(Error::InvalidState(format!("tag {name:?} is not asleep")));
        }
        sleeping.remove(&id);
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Test support: streams and copies, so callers check contents without CPU access to device
// memory (the host backend's strict mode forbids it, as a GPU does).

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
