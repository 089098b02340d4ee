//! The KV-space calls of the C ABI (`strata_kv_*`): an engine's KV cache as per-layer K and V
//! virtual tensors at fixed addresses ([`KvBlockManager`] over a `KvSpace`), whose requests
//! grow page by page, spill to host memory or disk, come back with copies ordered on the
//! caller's stream, and lose blocks to revocations (reported once).
//!
//! A space takes its pages from the device's one page pool, the one `strata_malloc` maps from,
//! so the caching allocator and every KV space share one budget. Spaces and requests are
//! opaque `uint64_t` handles: spaces live in a generation-checked [`HandleTable`]; a request
//! handle is `space serial << 40 | request id` (ids are never reused), so a request of another
//! space, or of a destroyed one, is an error, never someone else's KV.
//!
//! Callbacks (`strata_kv_on_lost`) run on the thread of the call that lost the blocks, after
//! that call released every strata lock, so they may call back into the library.

use std::ffi::{c_int, c_void};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::Mutex;
use strata_allocator::{Kind, PagePool};
use strata_tiers::{Durability, KvBlockManager, RequestId, Tier};
use strata_vmm::{BackendKind, Error, Result};

use crate::global::global;
use crate::handles::HandleTable;

mod copy;
mod create;
mod requests;
mod stats;
mod tiering;

pub use stats::figures_on;

/// Request ids take the low 40 bits of a request handle; the space's serial the rest.
const SERIAL_SHIFT: u32 = 40;
/// Most KV spaces created in one process (serials are never reused).
const MAX_SERIAL: u64 = (1 << (64 - SERIAL_SHIFT)) - 1;
/// The store's copy unit, at most (it must divide the page size).
const MAX_STORE_BLOCK: u64 = 256 << 10;

/// `strata_kv_lost_fn`.
pub type LostFn = Option<unsafe extern "C" fn(u64, u64, u32, *mut c_void)>;

#[derive(Clone, Copy)]
struct LostCallback {
    f: unsafe extern "C" fn(u64, u64, u32, *mut c_void),
    /// The caller's `user_data`, passed back untouched (an address, so the entry stays `Send`).
    user_data: usize,
}

/// One KV space behind a handle.
pub struct KvEntry {
    manager: KvBlockManager,
    serial: u64,
    device: u32,
    heads: u32,
    head_dim: u32,
    elem_size: u32,
    durability: Durability,
    dlpack_device_type: i32,
    on_lost: Mutex<Option<LostCallback>>,
}

static SPACES: HandleTable<KvEntry> = HandleTable::new("kv space");
static SERIALS: AtomicU64 = AtomicU64::new(1);

/// `device`'s ordinal and page pool: the device runtime's one pool, which its caching
/// allocator maps from and Harvest lends from, so KV and `strata_malloc` share one budget.
fn device_pool(device: i32) -> Result<(u32, Arc<PagePool>)> {
    let d = global()?.device(device)?;
    Ok((d.device(), Arc::clone(d.pool()?)))
}

/// DLPack's device type for this process's KV addresses.
fn dlpack_device_type() -> Result<i32> {
    Ok(match global()?.backend().kind() {
        BackendKind::Cuda => 2,
        BackendKind::Host => match std::env::var("STRATA_HOST_STRICT").as_deref() {
            Ok("1") => 0,
            _ => 1,
        },
    })
}

fn space(kv: u64) -> Result<Arc<KvEntry>> {
    SPACES.get(kv)
}

impl KvEntry {
    /// The request id of `handle`, which must belong to this space.
    fn request(&self, handle: u64) -> Result<RequestId> {
        if handle >> SERIAL_SHIFT != self.serial {
            return Err(Error::InvalidArgument(format!(
                "request {handle:#x} does not belong to this KV space (a request of another or a destroyed space, or not a request)"
            )));
        }
        Ok(RequestId(handle & ((1 << SERIAL_SHIFT) - 1)))
    }

    fn handle_of(&self, r: RequestId) -> u64 {
        self.serial << SERIAL_SHIFT | r.0
    }

    fn requests(&self, handles: *const u64, n: usize) -> Result<Vec<RequestId>> {
        // SAFETY: forwarded from the exports' contracts (`n` readable handles, or NULL with 0).
        unsafe { slice("requests", handles, n) }?
            .iter()
            .map(|&h| self.request(h))
            .collect()
    }
}

/// Borrows a C array; NULL is allowed only with `n == 0`, and no array spans more than
/// `isize::MAX` bytes (no object can).
///
/// # Safety
///
/// `ptr` is NULL or valid for reading `n` elements for the returned lifetime.
unsafe fn slice<'a, T>(what: &str, ptr: *const T, n: usize) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::InvalidArgument(format!(
            "{what} is NULL with {n} entries"
        )));
    }
    fits_one_object(what, n, std::mem::size_of::<T>())?;
    // SAFETY: non-NULL and valid for `n` reads by this function's contract; at most
    // `isize::MAX` bytes (checked).
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// `n` elements of `size` bytes fit in one object (at most `isize::MAX` bytes), as a Rust slice
/// requires: more is a length no caller's memory can have.
fn fits_one_object(what: &str, n: usize, size: usize) -> Result<()> {
    if n.checked_mul(size).is_none_or(|b| b > isize::MAX as usize) {
        return Err(Error::InvalidArgument(format!(
            "{what}: {n} entries of {size} bytes are more than any memory holds"
        )));
    }
    Ok(())
}

fn kind_of(kind: c_int) -> Result<Kind> {
    match kind {
        0 => Ok(Kind::K),
        1 => Ok(Kind::V),
        k => Err(Error::InvalidArgument(format!(
            "kind {k} (STRATA_KV_K = 0 or STRATA_KV_V = 1)"
        ))),
    }
}

fn tier_of(tier: c_int) -> Result<Tier> {
    match tier {
        1 => Ok(Tier::Host),
        2 => Ok(Tier::Disk),
        t => Err(Error::InvalidArgument(format!(
            "tier {t} (STRATA_TIER_HOST = 1 or STRATA_TIER_DISK = 2)"
        ))),
    }
}

fn out_ptr<T>(what: &str, out: *mut T) -> Result<*mut T> {
    if out.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    Ok(out)
}

fn positive(what: &str, v: u32) -> Result<u32> {
    if v == 0 {
        return Err(Error::InvalidArgument(format!("{what} is 0")));
    }
    Ok(v)
}
