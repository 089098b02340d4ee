//! The Harvest calls of the C ABI: opportunistic allocations in peer HBM, revocation
//! callbacks, and the owner's reclaim. The runtime's [`HarvestController`] lends pages of the
//! same per-device pools `strata_malloc` draws on; it is created on first use (on a single
//! device, the device lends to itself).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use strata_tiers::harvest::{Endpoint, HarvestController, HarvestHandle, HarvestHints};
use strata_tiers::Durability;
use strata_vmm::{Error, HostBuffer, Result};

use crate::boundary;
use crate::global::global;

/// `strata_harvest_handle_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_harvest_handle_t {
    pub device: i32,
    pub reserved: i32,
    pub ptr: u64,
    pub size: u64,
    pub id: u64,
}

/// `strata_harvest_hints_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct strata_harvest_hints_t {
    pub requester: i32,
    /// `STRATA_HARVEST_BACKED` (0) or `STRATA_HARVEST_LOSSY` (1).
    pub durability: i32,
    pub direct_only: i32,
    pub preferred_count: i32,
    pub preferred: *const i32,
}

/// `strata_revoke_fn`.
pub type RevokeFn =
    Option<unsafe extern "C" fn(*const strata_harvest_handle_t, c_int, *mut c_void)>;

/// The runtime's Harvest controller (over the same pools as `strata_malloc`).
fn controller() -> Result<&'static Arc<HarvestController>> {
    global()?.harvest()
}

fn to_c(h: &HarvestHandle) -> strata_harvest_handle_t {
    strata_harvest_handle_t {
        device: h.device as i32,
        reserved: 0,
        ptr: h.ptr,
        size: h.size,
        id: h.id,
    }
}

/// # Safety
///
/// `handle` is NULL or points at a readable `strata_harvest_handle_t`.
unsafe fn from_c(handle: *const strata_harvest_handle_t) -> Result<HarvestHandle> {
    // SAFETY: the caller's contract; NULL is refused by `as_ref`.
    let h = unsafe { handle.as_ref() }.ok_or(Error::InvalidArgument("handle is NULL".into()))?;
    if h.reserved != 0 {
        return Err(Error::InvalidArgument(format!(
            "handle's reserved field is {} (must be zero: not a handle from strata_harvest_alloc?)",
            h.reserved
        )));
    }
    let device = u32::try_from(h.device)
        .map_err(|_| Error::InvalidArgument(format!("device {}", h.device)))?;
    Ok(HarvestHandle {
        device,
        ptr: h.ptr,
        size: h.size,
        id: h.id,
    })
}

/// Allocates `size` bytes of harvested peer memory. See `include/strata.h`.
///
/// # Safety
///
/// `hints` points at a readable hints struct whose `preferred` holds `preferred_count`
/// readable ints (or is NULL with a count of 0); `out` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn strata_harvest_alloc(
    size: usize,
    hints: *const strata_harvest_hints_t,
    out: *mut strata_harvest_handle_t,
) -> c_int {
    boundary::status("strata_harvest_alloc", || {
        // SAFETY: the caller's contract; NULL is refused.
        let h = unsafe { hints.as_ref() }.ok_or(Error::InvalidArgument("hints is NULL".into()))?;
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let requester =
            u32::try_from(h.requester).map_err(|_| Error::NoDevice(h.requester.into()))?;
        let durability = match h.durability {
            0 => Durability::Backed,
            1 => Durability::Lossy,
            d => return Err(Error::InvalidArgument(format!("durability {d}"))),
        };
        let count = usize::try_from(h.preferred_count)
            .map_err(|_| Error::InvalidArgument("negative preferred_count".into()))?;
        let preferred: Vec<u32> = if count == 0 {
            Vec::new()
        } else if h.preferred.is_null() {
            return Err(Error::InvalidArgument("preferred is NULL".into()));
        } else {
            // SAFETY: `preferred` holds `preferred_count` readable ints (the caller's contract).
            let p = unsafe { std::slice::from_raw_parts(h.preferred, count) };
            p.iter().filter_map(|&d| u32::try_from(d).ok()).collect()
        };
        let hints = HarvestHints {
            requester,
            preferred,
            direct_only: h.direct_only != 0,
            durability,
        };
        let handle = controller()?.harvest_alloc(size as u64, &hints)?;
        // SAFETY: `out` is non-NULL and writable (the caller's contract).
        unsafe { out.write(to_c(&handle)) };
        Ok(())
    })
}

/// Frees a harvested allocation. See `include/strata.h`.
///
/// # Safety
///
/// `handle` is NULL or points at a readable handle.
#[no_mangle]
pub unsafe extern "C" fn strata_harvest_free(handle: *const strata_harvest_handle_t) -> c_int {
    boundary::status("strata_harvest_free", || {
        // SAFETY: forwarded contract.
        let h = unsafe { from_c(handle) }?;
        controller()?.harvest_free(&h)
    })
}

/// The C callback and its user data, moved to whichever thread revokes.
struct CCallback {
    f: unsafe extern "C" fn(*const strata_harvest_handle_t, c_int, *mut c_void),
    user_data: *mut c_void,
}

// SAFETY: `strata_harvest_on_revoke`'s contract (in the header) makes the caller promise that
// the callback and `user_data` may be used from any thread; strata only passes the pointer on.
unsafe impl Send for CCallback {}

/// Registers a revocation callback. See `include/strata.h` for when and where it runs.
///
/// # Safety
///
/// `handle` is NULL or readable; `callback` may be called once, from any thread, with
/// `user_data`, until the handle is freed or revoked.
#[no_mangle]
pub unsafe extern "C" fn strata_harvest_on_revoke(
    handle: *const strata_harvest_handle_t,
    callback: RevokeFn,
    user_data: *mut c_void,
) -> c_int {
    boundary::status("strata_harvest_on_revoke", || {
        // SAFETY: forwarded contract.
        let h = unsafe { from_c(handle) }?;
        let f = callback.ok_or(Error::InvalidArgument("callback is NULL".into()))?;
        let cb = CCallback { f, user_data };
        controller()?.harvest_on_revoke(
            &h,
            Box::new(move |r| {
                let cb = cb;
                let c = to_c(&r.handle);
                // SAFETY: the registrant's contract: `f` accepts these arguments from any
                // thread; `c` lives for the call.
                unsafe { (cb.f)(&c, c_int::from(r.lost()), cb.user_data) };
            }),
        )
    })
}

/// The owner of `peer` takes at least `bytes` back. See `include/strata.h`.
///
/// # Safety
///
/// `revoked_bytes` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_harvest_reclaim(
    peer: c_int,
    bytes: u64,
    revoked_bytes: *mut u64,
) -> c_int {
    boundary::status("strata_harvest_reclaim", || {
        let peer = u32::try_from(peer).map_err(|_| Error::NoDevice(peer.into()))?;
        let report = controller()?.reclaim(peer, bytes)?;
        if !revoked_bytes.is_null() {
            // SAFETY: non-NULL and writable (the caller's contract).
            unsafe { revoked_bytes.write(report.bytes) };
        }
        Ok(())
    })
}

/// Most bytes of host staging one Harvest read or write holds at once: longer transfers go in
/// chunks, so the staging never grows with the caller's length.
const STAGING_CHUNK: u64 = 8 << 20;

/// Runs `step(controller, staging, at, n)` over `offset..offset+len` of the allocation in
/// pieces of at most [`STAGING_CHUNK`] bytes (`at`: the piece's start, relative to `offset`),
/// with one staging buffer. The range is checked against the handle before anything is
/// allocated (the controller checks the handle itself on each copy).
fn in_chunks(
    h: &HarvestHandle,
    offset: u64,
    len: usize,
    mut step: impl FnMut(&HarvestController, &HostBuffer, usize, usize) -> Result<()>,
) -> Result<()> {
    let total = len as u64;
    if offset.checked_add(total).is_none_or(|end| end > h.size) {
        return Err(Error::InvalidArgument(format!(
            "range {offset:#x}+{total:#x} beyond the allocation's {:#x} bytes",
            h.size
        )));
    }
    let c = controller()?;
    let staging = HostBuffer::new(c.backend(), total.min(STAGING_CHUNK))?;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(STAGING_CHUNK as usize);
        step(c, &staging, at, n)?;
        at += n;
    }
    Ok(())
}

fn host(staging: &HostBuffer) -> Endpoint<'_> {
    Endpoint::Host {
        buffer: staging,
        offset: 0,
    }
}

/// Copies `len` host bytes at `src` into the allocation at `offset` and waits.
///
/// # Safety
///
/// `handle` is NULL or readable; `src` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_harvest_write(
    handle: *const strata_harvest_handle_t,
    offset: u64,
    src: *const c_void,
    len: usize,
) -> c_int {
    boundary::status("strata_harvest_write", || {
        // SAFETY: forwarded contract.
        let h = unsafe { from_c(handle) }?;
        if src.is_null() || len == 0 {
            return Err(Error::InvalidArgument("NULL src or zero length".into()));
        }
        in_chunks(&h, offset, len, |c, staging, at, n| {
            // SAFETY: `src` is readable for `len` bytes (the caller's contract), and
            // `at + n <= len`.
            staging.write_at(0, unsafe {
                std::slice::from_raw_parts(src.cast::<u8>().add(at), n)
            })?;
            c.copy_in(&h, offset + at as u64, host(staging), n as u64)?
                .synchronize()
        })
    })
}

/// Copies `len` bytes of the allocation at `offset` into host memory `dst` and waits.
///
/// # Safety
///
/// `handle` is NULL or readable; `dst` is writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_harvest_read(
    handle: *const strata_harvest_handle_t,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> c_int {
    boundary::status("strata_harvest_read", || {
        // SAFETY: forwarded contract.
        let h = unsafe { from_c(handle) }?;
        if dst.is_null() || len == 0 {
            return Err(Error::InvalidArgument("NULL dst or zero length".into()));
        }
        in_chunks(&h, offset, len, |c, staging, at, n| {
            c.copy_out(&h, offset + at as u64, host(staging), n as u64)?
                .synchronize()?;
            // SAFETY: `dst` is writable for `len` bytes (the caller's contract), and
            // `at + n <= len`.
            staging.read_at(0, unsafe {
                std::slice::from_raw_parts_mut(dst.cast::<u8>().add(at), n)
            })
        })
    })
}
