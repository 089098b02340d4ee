//! A space's counters and invariant check.

use std::ffi::c_int;

use strata_ops::{KvFigures, TierBytes};

use crate::boundary;

use super::{out_ptr, space, SPACES};

/// `strata_kv_stats_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_kv_stats_t {
    pub page_size: u64,
    pub tokens_per_block: u64,
    pub block_bytes: u64,
    pub requests_admitted: u64,
    pub blocks: u64,
    pub blocks_resident: u64,
    pub blocks_spilled: u64,
    pub blocks_clean: u64,
    pub blocks_lost: u64,
    pub pool_free_pages: u64,
    pub pool_in_use_pages: u64,
    pub pool_created_pages: u64,
    pub pool_adopted_pages: u64,
    pub host_used_bytes: u64,
    pub host_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_capacity_bytes: u64,
    pub bytes_to_device: u64,
    pub bytes_from_device: u64,
    pub disk_read_bytes: u64,
    pub disk_write_bytes: u64,
    pub spills: u64,
    pub clean_spills: u64,
    pub clean_revocations: u64,
    pub restores: u64,
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    pub stalls: u64,
    pub evictions: u64,
    pub lost_blocks: u64,
    pub pages_revoked: u64,
    pub staged_objects: u64,
    pub staged_evicted: u64,
    pub pages_ahead: u64,
    pub pages_from_ahead: u64,
    pub spare: [u64; 4],
}

/// The space's figures.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_stats(kv: u64, out: *mut strata_kv_stats_t) -> c_int {
    boundary::status("strata_kv_stats", || {
        let s = space(kv)?;
        let out = out_ptr("out", out)?;
        let m = &s.manager;
        let k = m.stats();
        let st = m.store().stats();
        let pool = m.store().pool().stats();
        let space = m.space_stats();
        let b = st.block_size;
        let stats = strata_kv_stats_t {
            page_size: pool.page_size,
            tokens_per_block: u64::from(m.tokens_per_block()),
            block_bytes: m.block_bytes(),
            requests_admitted: k.requests,
            blocks: k.blocks,
            blocks_resident: k.blocks_resident,
            blocks_spilled: k.blocks_spilled,
            blocks_clean: k.blocks_clean,
            blocks_lost: k
                .blocks
                .saturating_sub(k.blocks_resident + k.blocks_spilled),
            pool_free_pages: pool.free as u64,
            pool_in_use_pages: pool.in_use as u64,
            pool_created_pages: pool.created_total,
            pool_adopted_pages: pool.adopted_total,
            host_used_bytes: st.host_used * b,
            host_capacity_bytes: st.host_slots * b,
            disk_used_bytes: st.disk_used * b,
            disk_capacity_bytes: st.disk_slots * b,
            bytes_to_device: st.transfers.bytes_h2d,
            bytes_from_device: st.transfers.bytes_d2h,
            disk_read_bytes: st.disk_read_bytes,
            disk_write_bytes: st.disk_write_bytes,
            spills: k.spills,
            clean_spills: k.clean_spills,
            clean_revocations: k.clean_revocations,
            restores: k.restores,
            prefetch_hits: k.hinted_prefetches,
            prefetch_misses: k.demand_restores,
            stalls: k.stalls,
            evictions: k.evictions,
            lost_blocks: k.lost_blocks,
            pages_revoked: k.pages_revoked,
            staged_objects: st.staged,
            staged_evicted: st.staged_evicted,
            pages_ahead: space.pages_ahead,
            pages_from_ahead: space.pages_from_ahead,
            spare: [0; 4],
        };
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(stats) };
        Ok(())
    })
}

/// Checks the space's invariants (tests).
#[no_mangle]
pub extern "C" fn strata_kv_check(kv: u64) -> c_int {
    boundary::status("strata_kv_check", || space(kv)?.manager.check_invariants())
}

/// The figures of every KV space on `device`, for `strata ps` (`ops.rs`).
pub fn figures_on(device: u32) -> Vec<KvFigures> {
    SPACES
        .values()
        .iter()
        .filter(|s| s.device == device)
        .map(|s| {
            let m = &s.manager;
            let k = m.stats();
            let st = m.store().stats();
            KvFigures {
                id: s.serial,
                tokens: k.tokens,
                requests: k.live_requests,
                bytes: TierBytes {
                    device: k.blocks_resident * m.block_bytes(),
                    peer: 0,
                    host: st.host_used * st.block_size,
                    disk: st.disk_used * st.block_size,
                },
                prefetch_hits: k.hinted_prefetches,
                prefetch_misses: k.demand_restores,
                moved_bytes: st.transfers.bytes_h2d + st.transfers.bytes_d2h,
            }
        })
        .collect()
}
