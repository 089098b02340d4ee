//! Per-device and per-tag statistics: `strata_stats` and `strata_tag_stats` and their C structs.

use std::ffi::{c_char, c_int};

use strata_allocator::{AllocatorStats, TagStats};
use strata_runtime::DeviceStats;
use strata_vmm::{Error, Location};

use crate::boundary;
use crate::global::global;
use crate::tags;

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
    /// Cap on the device's own memory held (`strata_set_memory_fraction`; host and peer
    /// pages in `reserved_bytes` do not count); 0 when none (see `limit_set`).
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
