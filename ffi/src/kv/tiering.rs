//! Tiering: spills, the step clock and lookahead hints, making requests resident, and revocations
//! with their lost blocks.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use strata_tiers::{Durability, RequestId};
use strata_vmm::{Error, Result};

use crate::boundary;
use crate::{stream_of, CudaStream};

use super::{out_ptr, slice, space, tier_of, KvEntry, LostCallback, LostFn};

/// Spills a request's resident blocks to host memory or disk.
#[no_mangle]
pub extern "C" fn strata_kv_spill(kv: u64, request: u64, tier: c_int) -> c_int {
    boundary::status("strata_kv_spill", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        s.manager.pause(r, tier_of(tier)?)
    })
}

/// Spills every request idle for more than `idle_steps` steps.
///
/// # Safety
///
/// `blocks` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_spill_idle(
    kv: u64,
    idle_steps: u64,
    tier: c_int,
    blocks: *mut u64,
) -> c_int {
    boundary::status("strata_kv_spill_idle", || {
        let s = space(kv)?;
        let n = s.manager.spill_idle(idle_steps, tier_of(tier)?)?;
        if !blocks.is_null() {
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { blocks.write(n as u64) };
        }
        Ok(())
    })
}

/// Moves the scheduler's step clock forward.
#[no_mangle]
pub extern "C" fn strata_kv_advance(kv: u64, step: u64) -> c_int {
    boundary::status("strata_kv_advance", || {
        space(kv)?.manager.advance(step);
        Ok(())
    })
}

/// The waiting queue beyond the hinted window, in the order the requests will run.
///
/// # Safety
///
/// `waiting` is NULL with `count == 0`, or readable for `count` handles.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_queue(kv: u64, waiting: *const u64, count: usize) -> c_int {
    boundary::status("strata_kv_queue", || {
        let s = space(kv)?;
        s.manager.queue(&s.requests(waiting, count)?)
    })
}

/// Lookahead: the batches of the next `steps` steps (`step_counts[i]` handles each, one after
/// another in `requests`). Prefetches what fits the compute window, ordered on `stream`.
///
/// # Safety
///
/// `step_counts` is readable for `steps` entries (or NULL with 0) and `requests` for their sum.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_hint(
    kv: u64,
    requests: *const u64,
    step_counts: *const u32,
    steps: usize,
    stream: CudaStream,
) -> c_int {
    boundary::status("strata_kv_hint", || {
        let s = space(kv)?;
        // SAFETY: this function's contract.
        let counts = unsafe { slice("step_counts", step_counts, steps) }?;
        let total = counts
            .iter()
            .try_fold(0usize, |a, &n| a.checked_add(n as usize))
            .ok_or(Error::Overflow("sum of step_counts"))?;
        let all = s.requests(requests, total)?;
        let mut next = all.into_iter();
        let plan: Vec<Vec<RequestId>> = counts
            .iter()
            .map(|&n| next.by_ref().take(n as usize).collect())
            .collect();
        if let Some(ev) = s.manager.hint(&plan)? {
            s.manager
                .store()
                .backend()
                .stream_wait_event(stream_of(stream), ev.handle())?;
        }
        Ok(())
    })
}

/// Makes every block of `batch` resident; `stream` waits for the copies (no host sync).
///
/// # Safety
///
/// `batch` is NULL with `count == 0`, or readable for `count` handles.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_make_resident(
    kv: u64,
    batch: *const u64,
    count: usize,
    stream: CudaStream,
) -> c_int {
    boundary::status("strata_kv_make_resident", || {
        let s = space(kv)?;
        let batch = s.requests(batch, count)?;
        let ev = s.manager.make_resident(&batch)?;
        s.manager
            .store()
            .backend()
            .stream_wait_event(stream_of(stream), ev.handle())
    })
}

/// Moves the disk-resident spilled blocks of `batch` up to host memory ahead of a
/// `strata_kv_make_resident` (the first hop of the two-hop path); `*objects` (if not NULL)
/// receives the store objects moved.
///
/// # Safety
///
/// `batch` is NULL with `count == 0`, or readable for `count` handles; `objects` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_stage(
    kv: u64,
    batch: *const u64,
    count: usize,
    objects: *mut u64,
) -> c_int {
    boundary::status("strata_kv_stage", || {
        let s = space(kv)?;
        let batch = s.requests(batch, count)?;
        let n = s.manager.stage(&batch)?;
        if !objects.is_null() {
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { objects.write(n as u64) };
        }
        Ok(())
    })
}

/// Blocks of a request lost to revocations since the last report, each reported once.
///
/// # Safety
///
/// `blocks` is NULL with `capacity == 0`, or writable for `capacity` entries; `count` is NULL
/// (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_take_lost(
    kv: u64,
    request: u64,
    blocks: *mut u32,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    boundary::status("strata_kv_take_lost", || {
        let s = space(kv)?;
        let r = s.request(request)?;
        let count = out_ptr("count", count)?;
        // Lost blocks are among the request's blocks: room for all of them means no report is
        // ever cut short (and lost).
        let n = s.manager.blocks(r)?.len();
        if capacity < n {
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { count.write(n) };
            return Err(Error::InvalidArgument(format!(
                "capacity {capacity} < the request's {n} blocks: nothing taken"
            )));
        }
        let lost = s.manager.take_lost(r)?;
        if !lost.is_empty() {
            let blocks = out_ptr("blocks", blocks)?;
            for (i, &p) in lost.iter().enumerate() {
                // SAFETY: `i < lost.len() <= n <= capacity`, writable by the contract.
                unsafe { blocks.add(i).write(p as u32) };
            }
        }
        // SAFETY: as above.
        unsafe { count.write(lost.len()) };
        Ok(())
    })
}

/// Registers (or, with NULL, clears) the space's lost-block callback.
#[no_mangle]
pub extern "C" fn strata_kv_on_lost(kv: u64, callback: LostFn, user_data: *mut c_void) -> c_int {
    boundary::status("strata_kv_on_lost", || {
        let s = space(kv)?;
        *s.on_lost.lock() = callback.map(|f| LostCallback {
            f,
            user_data: user_data as usize,
        });
        Ok(())
    })
}

/// Takes `pages` pool pages from the space back to the device's pool.
///
/// # Safety
///
/// `lost_blocks` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_revoke(kv: u64, pages: u64, lost_blocks: *mut u64) -> c_int {
    boundary::status("strata_kv_revoke", || {
        let s = space(kv)?;
        let pages = usize::try_from(pages).map_err(|_| Error::Overflow("pages"))?;
        let pool = Arc::clone(s.manager.store().pool());
        let (lost, result) = match s.durability {
            Durability::Backed => (
                Vec::new(),
                s.manager.revoke_spilling(pages).map(|p| pool.give(p)),
            ),
            Durability::Lossy => {
                // Blocks lost before the pool ran dry stay lost: reported all the same.
                let (rev, result) = s.manager.revoke_reporting(pages);
                pool.give(rev.pages);
                (rev.lost, result)
            }
        };
        if !lost_blocks.is_null() {
            let n: usize = lost.iter().map(|(_, b)| b.len()).sum();
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { lost_blocks.write(n as u64) };
        }
        let delivered = deliver_lost(kv, &s, &lost);
        result.and(delivered)
    })
}

/// Reports lost blocks to the space's callback, if one is registered (each block once: those
/// a concurrent `strata_kv_take_lost` took first are its to report). No strata lock is held
/// while the callback runs.
fn deliver_lost(kv: u64, s: &KvEntry, lost: &[(RequestId, Vec<usize>)]) -> Result<()> {
    if lost.is_empty() {
        return Ok(());
    }
    let Some(cb) = *s.on_lost.lock() else {
        return Ok(());
    };
    for &(r, _) in lost {
        let blocks = match s.manager.take_lost(r) {
            Ok(b) => b,
            // Released meanwhile: nothing left to report.
            Err(Error::StaleId { .. }) => continue,
            Err(e) => return Err(e),
        };
        for p in blocks {
            // SAFETY: the caller registered `f` with this signature and `user_data` for it
            // (`strata_kv_on_lost`'s contract); no strata lock is held here.
            unsafe { (cb.f)(kv, s.handle_of(r), p as u32, cb.user_data as *mut c_void) };
        }
    }
    Ok(())
}
