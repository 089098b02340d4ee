//! Offload and onload of a tag: `strata_offload` moves its live allocations to host memory
//! (still device-accessible, at the link's speed) or to disk (sleep: not accessible until
//! onload), `strata_onload` brings them back; pointers never change.

use std::ffi::{c_char, c_int};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use strata_vmm::{Error, Result};

use crate::tags::{self, set_overflow, Overflow};
use crate::{boundary, global::global, sleep, stream_of, CudaStream};

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
                sleep::sleep_tag(name, |a, id| a.sleep_to_disk(id, &dir))
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
        if tags::sleeping().contains(&lease.id()) {
            return sleep::wake_tag(name);
        }
        let g = global()?;
        for (_, a) in g.existing_all() {
            a.onload(lease.id(), stream_of(stream))?;
        }
        Ok(())
    })
}

/// Lets allocations of tag `tag` overflow onto host memory when a device is out of memory
/// (`tier` STRATA_TIER_HOST), or stops it (`tier` 0). See `include/strata.h`.
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_set_overflow(tag: *const c_char, tier: c_int) -> c_int {
    boundary::status("strata_set_overflow", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        let on = match tier {
            0 => false,
            TIER_HOST => true,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "overflow tier {tier} (0: off, STRATA_TIER_HOST = {TIER_HOST})"
                )))
            }
        };
        // Held for the call: the id stays this name's while its setting changes.
        let lease = tags::lease(name)?;
        let id = lease.id();
        let g = global()?;
        if on {
            // Devices first used later get the setting too, on creation: a backend that
            // cannot map host memory at all (CUDA before 12.2) refuses it here instead.
            g.backend().granularity(strata_vmm::Location::Host)?;
        }
        let mut set = tags::overflowing();
        for device in g.devices() {
            if let Some(a) = device.existing_allocator() {
                set_overflow(device, a, id, on)?;
            }
        }
        if on {
            set.insert(id, Overflow::Host);
        } else {
            set.remove(&id);
        }
        Ok(())
    })
}

fn offload_to_host(name: &str, stream: CudaStream) -> Result<()> {
    let lease = tags::lease(name)?;
    let g = global()?;
    let _no_sleep_meanwhile = tags::sleeping();
    for device in g.devices() {
        if let Some(a) = device.existing_allocator() {
            a.offload(lease.id(), device.host_pool()?, stream_of(stream))?;
        }
    }
    Ok(())
}

/// Where a tag's (or a device's) pages are and what moved them (`strata_spill_stats_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_spill_stats_t {
    /// Bytes of mapped pages in the device's own memory, borrowed from a peer, in host memory.
    pub local_bytes: u64,
    pub peer_bytes: u64,
    pub host_bytes: u64,
    /// Segments migrated to host memory / back to the device, and their bytes.
    pub migrations_to_host: u64,
    pub migrations_to_device: u64,
    pub bytes_to_host: u64,
    pub bytes_to_device: u64,
    /// Nanoseconds callers waited on migrations.
    pub stalled_ns: u64,
    /// Zero; room to grow.
    pub spare: [u64; 4],
}

impl From<strata_allocator::SpillStats> for strata_spill_stats_t {
    fn from(s: strata_allocator::SpillStats) -> Self {
        strata_spill_stats_t {
            local_bytes: s.tiers.local,
            peer_bytes: s.tiers.peer,
            host_bytes: s.tiers.host,
            migrations_to_host: s.counts.to_host,
            migrations_to_device: s.counts.to_device,
            bytes_to_host: s.counts.bytes_to_host,
            bytes_to_device: s.counts.bytes_to_device,
            stalled_ns: s.counts.stalled_ns,
            spare: [0; 4],
        }
    }
}

/// Fills `*out` with the tier bytes and migrations of tag `tag` on `device`, or of the whole
/// device when `tag` is NULL (zeros where nothing was allocated).
///
/// # Safety
///
/// `tag` is NULL or a NUL-terminated string; `out` is NULL (an error) or valid for writing one
/// `strata_spill_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_spill_stats(
    tag: *const c_char,
    device: c_int,
    out: *mut strata_spill_stats_t,
) -> c_int {
    boundary::status("strata_spill_stats", || {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let lease = if tag.is_null() {
            None
        } else {
            // SAFETY: forwarded from this function's contract.
            let name = unsafe { boundary::c_str("tag", tag) }?;
            Some(tags::lease(name)?)
        };
        let g = global()?;
        let d = g.ordinal(device)?;
        let stats = g
            .existing(d)
            .map(|a| a.spill_stats(lease.as_ref().map(|l| l.id())))
            .unwrap_or_default();
        // SAFETY: `out` is non-NULL and valid for one write by this function's contract.
        unsafe { out.write(stats.into()) };
        Ok(())
    })
}

/// Lets allocations of tag `tag` on every device but `lender` overflow onto `lender`'s pages
/// when their device is out of memory (borrowed memory `strata_revoke_peer` takes back).
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_set_overflow_peer(tag: *const c_char, lender: c_int) -> c_int {
    boundary::status("strata_set_overflow_peer", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        let lease = tags::lease(name)?;
        let id = lease.id();
        let g = global()?;
        let peer = g.ordinal(lender)?;
        let pool = g.devices()[peer].pool()?;
        let mut set = tags::overflowing();
        for (d, a) in g.existing_all() {
            if d != peer {
                a.set_overflow(id, Some(Arc::clone(pool)))?;
            }
        }
        set.insert(id, Overflow::Peer(peer));
        Ok(())
    })
}

/// One move of a revocation (`strata_revoked_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_revoked_t {
    /// The device whose allocation moved, and the lender it moved off.
    pub device: i32,
    pub lender: i32,
    /// 1: onto the device's own memory; 0: onto host memory.
    pub to_device: i32,
    /// The tag's id (as in `strata_tag_stats_t`).
    pub tag_id: u32,
    /// First byte of the moved segment (unchanged) and its length.
    pub ptr: u64,
    pub bytes: u64,
}

fn revoked_queue() -> &'static Mutex<std::collections::VecDeque<strata_revoked_t>> {
    static QUEUE: OnceLock<Mutex<std::collections::VecDeque<strata_revoked_t>>> = OnceLock::new();
    QUEUE.get_or_init(Mutex::default)
}

/// Takes back every page of device `lender` behind other devices' allocations: each segment on
/// them moves to its device's own memory, or host memory when that is full, at the same
/// addresses (copies ordered on `stream`); the notices queue for `strata_take_revoked`.
#[no_mangle]
pub extern "C" fn strata_revoke_peer(lender: c_int, stream: CudaStream) -> c_int {
    boundary::status("strata_revoke_peer", || {
        let g = global()?;
        let peer = g.ordinal(lender)?;
        let Some(pool) = g.devices()[peer].existing_pool() else {
            return Ok(());
        };
        // The allocators stop every tag overflowing onto the lender: so does the set.
        let mut set = tags::overflowing();
        set.retain(|_, to| *to != Overflow::Peer(peer));
        let mut first = None;
        for device in g.devices() {
            let Some(a) = device.existing_allocator() else {
                continue;
            };
            if device.device() as usize == peer {
                continue;
            }
            let got = device
                .host_pool()
                .and_then(|host| a.revoke(pool, host, stream_of(stream)));
            let mut queue = revoked_queue().lock();
            for r in a.take_revoked() {
                queue.push_back(strata_revoked_t {
                    device: device.device() as i32,
                    lender: peer as i32,
                    to_device: i32::from(r.to == strata_vmm::Location::Device(device.device())),
                    tag_id: r.tag,
                    ptr: r.va,
                    bytes: r.bytes,
                });
            }
            if let Err(e) = got {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    })
}

/// Moves up to `capacity` revocation notices, oldest first, into `out[0..*count)`; each notice
/// is handed out once.
///
/// # Safety
///
/// `out` is valid for writing `capacity` notices (or NULL with `capacity` 0); `count` is NULL
/// (an error) or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn strata_take_revoked(
    out: *mut strata_revoked_t,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    boundary::status("strata_take_revoked", || {
        if count.is_null() || (out.is_null() && capacity > 0) {
            return Err(Error::InvalidArgument("out or count is NULL".into()));
        }
        let mut queue = revoked_queue().lock();
        let n = capacity.min(queue.len());
        for (i, r) in queue.drain(..n).enumerate() {
            // SAFETY: `i < capacity`, and `out` is valid for `capacity` writes by contract.
            unsafe { out.add(i).write(r) };
        }
        // SAFETY: `count` is non-NULL and valid for one write by this function's contract.
        unsafe { count.write(n) };
        Ok(())
    })
}
