//! A space's requests: admit, append, release, their residency and host-side reads and writes.

use std::ffi::{c_int, c_void};

use strata_tiers::Tier;
use strata_vmm::Error;

use crate::boundary;

use super::{fits_one_object, kind_of, out_ptr, slice, space};

/// `strata_kv_request_info_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_kv_request_info_t {
    pub slot: u32,
    pub tokens: u32,
    pub blocks: u32,
    pub resident: u32,
    pub host: u32,
    pub disk: u32,
    pub lost: u32,
    pub reserved: u32,
}

/// Admits a request with no tokens.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_admit(kv: u64, out: *mut u64) -> c_int {
    boundary::status("strata_kv_admit", || {
        let s = space(kv)?;
        let out = out_ptr("out", out)?;
        let r = s.manager.admit()?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(s.handle_of(r)) };
        Ok(())
    })
}

/// Appends `tokens` tokens to a request, mapping the pages they need.
#[no_mangle]
pub extern "C" fn strata_kv_append(kv: u64, request: u64, tokens: u32) -> c_int {
    boundary::status("strata_kv_append", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        s.manager.append(r, tokens)
    })
}

/// Truncates a request to its first `tokens` tokens, unmapping the pages past them.
#[no_mangle]
pub extern "C" fn strata_kv_truncate(kv: u64, request: u64, tokens: u32) -> c_int {
    boundary::status("strata_kv_truncate", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        s.manager.truncate(r, tokens)
    })
}

/// Releases a request (its handle becomes stale).
#[no_mangle]
pub extern "C" fn strata_kv_release(kv: u64, request: u64) -> c_int {
    boundary::status("strata_kv_release", || {
        let s = space(kv)?;
        s.manager.release(s.request(request)?)
    })
}

/// A request's slot, tokens and block residency counts.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_request_info(
    kv: u64,
    request: u64,
    out: *mut strata_kv_request_info_t,
) -> c_int {
    boundary::status("strata_kv_request_info", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        let out = out_ptr("out", out)?;
        let mut info = strata_kv_request_info_t {
            slot: s.manager.slot_index(r)?,
            tokens: s.manager.tokens(r)?,
            ..Default::default()
        };
        for b in s.manager.blocks(r)? {
            info.blocks += 1;
            match b {
                Some(Tier::Hbm) => info.resident += 1,
                Some(Tier::Host) => info.host += 1,
                Some(Tier::Disk) => info.disk += 1,
                None => info.lost += 1,
            }
        }
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(info) };
        Ok(())
    })
}

/// Where each block of a request is (`STRATA_KV_RESIDENT`, `_HOST`, `_DISK`, `_LOST`).
///
/// # Safety
///
/// `out` is NULL with `capacity == 0`, or writable for `capacity` bytes; `count` is NULL (an
/// error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_residency(
    kv: u64,
    request: u64,
    out: *mut u8,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    boundary::status("strata_kv_residency", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        let count = out_ptr("count", count)?;
        let blocks = s.manager.blocks(r)?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { count.write(blocks.len()) };
        if blocks.len() > capacity {
            return Err(Error::InvalidArgument(format!(
                "{} blocks do not fit in capacity {capacity}",
                blocks.len()
            )));
        }
        let out = out_ptr("out", out)?;
        for (i, b) in blocks.iter().enumerate() {
            let code = match b {
                Some(Tier::Hbm) => 0,
                Some(Tier::Host) => 1,
                Some(Tier::Disk) => 2,
                None => 3,
            };
            // SAFETY: `i < blocks.len() <= capacity`, writable by this function's contract.
            unsafe { out.add(i).write(code) };
        }
        Ok(())
    })
}

/// Writes whole tokens of host bytes into a request's K or V tensor of `layer` (a backend copy).
///
/// # Safety
///
/// `src` is NULL with `len == 0`, or readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_write(
    kv: u64,
    request: u64,
    layer: u32,
    kind: c_int,
    first_token: u32,
    src: *const c_void,
    len: usize,
) -> c_int {
    boundary::status("strata_kv_write", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        let kind = kind_of(kind)?;
        // SAFETY: this function's contract.
        let data = unsafe { slice("src", src.cast::<u8>(), len) }?;
        s.manager.write_kv(r, layer, kind, first_token, data)
    })
}

/// Reads whole tokens of a request's K or V tensor of `layer` into host memory, from wherever
/// the blocks are. `*tier` (if not NULL) receives the slowest tier read.
///
/// # Safety
///
/// `dst` is NULL with `len == 0`, or writable for `len` bytes and not touched by anyone else
/// during the call; `tier` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_read(
    kv: u64,
    request: u64,
    layer: u32,
    kind: c_int,
    first_token: u32,
    dst: *mut c_void,
    len: usize,
    tier: *mut c_int,
) -> c_int {
    boundary::status("strata_kv_read", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        let kind = kind_of(kind)?;
        if len > 0 && dst.is_null() {
            return Err(Error::InvalidArgument("dst is NULL".into()));
        }
        fits_one_object("dst", len, 1)?;
        let out: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: non-NULL, writable for `len` bytes and ours for the call (contract).
            unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) }
        };
        let read = s.manager.read_kv(r, layer, kind, first_token, out)?;
        if !tier.is_null() {
            let code = match read {
                Tier::Hbm => 0,
                Tier::Host => 1,
                Tier::Disk => 2,
            };
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { tier.write(code) };
        }
        Ok(())
    })
}
