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

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_allocator::{Kind, PagePool};
use strata_tiers::policy::Links;
use strata_tiers::{
    DiskConfig, Durability, KvBlockManager, KvBlocksConfig, RequestId, StoreConfig, Tier, TierSpec,
    TierStore,
};
use strata_vmm::{BackendKind, Error, Result};

use crate::boundary;
use crate::global::global;
use crate::handles::HandleTable;
use crate::{stream_of, CudaStream};

/// Request ids take the low 40 bits of a request handle; the space's serial the rest.
const SERIAL_SHIFT: u32 = 40;
/// Most KV spaces created in one process (serials are never reused).
const MAX_SERIAL: u64 = (1 << (64 - SERIAL_SHIFT)) - 1;
/// The store's copy unit, at most (it must divide the page size).
const MAX_STORE_BLOCK: u64 = 256 << 10;

/// `strata_kv_config_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
pub struct strata_kv_config_t {
    pub device: i32,
    /// `STRATA_KV_BACKED` (0) or `STRATA_KV_LOSSY` (1).
    pub durability: i32,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub elem_size: u32,
    pub max_requests: u32,
    pub max_tokens: u32,
    pub zero_page: i32,
    pub reserved: i32,
    pub host_bytes: u64,
    pub disk_bytes: u64,
    pub disk_dir: *const c_char,
    pub step_time_ns: u64,
    pub spare: [u64; 4],
}

/// `strata_kv_tensor_t`: one (layer, K/V) tensor, `[max_requests, max_tokens, kv_heads,
/// head_dim]` with byte strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_kv_tensor_t {
    pub data: u64,
    pub device: i32,
    /// DLPack `DLDeviceType`: 2 (CUDA), 1 (CPU: the host backend outside strict mode), 0 (the
    /// addresses are not CPU-accessible: strict host backend).
    pub dlpack_device_type: i32,
    pub ndim: i32,
    pub elem_size: u32,
    pub shape: [i64; 4],
    pub strides: [i64; 4],
}

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
    pub spare: [u64; 8],
}

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

/// Borrows a C array; NULL is allowed only with `n == 0`.
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
    // SAFETY: non-NULL and valid for `n` reads by this function's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
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

/// Validates a config and builds the space.
///
/// # Safety
///
/// `c.disk_dir` is NULL or a NUL-terminated string.
unsafe fn create(c: &strata_kv_config_t) -> Result<KvEntry> {
    let durability = match c.durability {
        0 => Durability::Backed,
        1 => Durability::Lossy,
        d => {
            return Err(Error::InvalidArgument(format!(
                "durability {d} (STRATA_KV_BACKED = 0 or STRATA_KV_LOSSY = 1)"
            )))
        }
    };
    let layers = positive("layers", c.layers)?;
    let heads = positive("kv_heads", c.kv_heads)?;
    let head_dim = positive("head_dim", c.head_dim)?;
    let elem_size = c.elem_size;
    if !matches!(elem_size, 1 | 2 | 4 | 8) {
        return Err(Error::InvalidArgument(format!(
            "elem_size {elem_size} (1, 2, 4 or 8)"
        )));
    }
    let max_requests = positive("max_requests", c.max_requests)?;
    let max_tokens = positive("max_tokens", c.max_tokens)?;
    if (max_tokens as u64) >= 1 << SERIAL_SHIFT {
        return Err(Error::InvalidArgument(format!("max_tokens {max_tokens}")));
    }
    let bytes_per_token = u64::from(heads)
        .checked_mul(u64::from(head_dim))
        .and_then(|b| b.checked_mul(u64::from(elem_size)))
        .ok_or(Error::Overflow("kv_heads × head_dim × elem_size"))?;
    let disk = if c.disk_dir.is_null() {
        if c.disk_bytes > 0 {
            return Err(Error::InvalidArgument(
                "disk_bytes > 0 needs disk_dir".into(),
            ));
        }
        None
    } else {
        // SAFETY: this function's contract.
        let dir = unsafe { boundary::c_str("disk_dir", c.disk_dir) }?;
        if c.disk_bytes == 0 {
            return Err(Error::InvalidArgument("disk_dir with disk_bytes 0".into()));
        }
        Some(PathBuf::from(dir))
    };
    let (device, pool) = device_pool(c.device)?;
    let block = pool.page_size().min(MAX_STORE_BLOCK);
    let mut store = StoreConfig::new(block, 0, c.host_bytes);
    store.device = device;
    let host_link = (store.host.latency, store.host.bandwidth);
    let disk_spec = TierSpec {
        capacity: c.disk_bytes,
        bandwidth: 7e9,
        latency: Duration::from_micros(80),
    };
    store.disk = disk.map(|dir| DiskConfig {
        dir,
        spec: disk_spec,
        io_threads: 2,
        direct: true,
    });
    let store = Arc::new(TierStore::new(pool, store)?);
    let step = match c.step_time_ns {
        0 => Duration::from_millis(20),
        ns => Duration::from_nanos(ns),
    };
    let manager = KvBlockManager::new(
        store,
        KvBlocksConfig {
            layers,
            max_requests,
            max_tokens,
            bytes_per_token,
            t_iter: step,
            delta_sched: Duration::from_micros(100),
            links: Links {
                host_to_hbm: host_link,
                disk_to_host: (disk_spec.latency, disk_spec.bandwidth),
            },
            zero_page: c.zero_page != 0,
        },
    )?;
    let serial = SERIALS.fetch_add(1, Ordering::Relaxed);
    if serial > MAX_SERIAL {
        return Err(Error::InvalidState(format!(
            "more than {MAX_SERIAL} KV spaces created in this process"
        )));
    }
    Ok(KvEntry {
        manager,
        serial,
        device,
        heads,
        head_dim,
        elem_size,
        durability,
        dlpack_device_type: dlpack_device_type()?,
        on_lost: Mutex::new(None),
    })
}

/// Creates a KV space. See `include/strata.h`.
///
/// # Safety
///
/// `config` is NULL (an error) or a readable config whose `disk_dir` is NULL or a
/// NUL-terminated string; `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_create(
    config: *const strata_kv_config_t,
    out: *mut u64,
) -> c_int {
    boundary::status("strata_kv_create", || {
        // SAFETY: the caller's contract; NULL is refused.
        let c = unsafe { config.as_ref() }
            .ok_or_else(|| Error::InvalidArgument("config is NULL".into()))?;
        let out = out_ptr("out", out)?;
        // SAFETY: `c.disk_dir` as this function's contract says.
        let entry = unsafe { create(c) }?;
        let handle = SPACES.insert(Arc::new(entry))?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(handle) };
        Ok(())
    })
}

/// Destroys a KV space: waits for its copies, releases its requests' pages and spilled
/// copies. The handle (and its requests) are stale afterwards.
#[no_mangle]
pub extern "C" fn strata_kv_destroy(kv: u64) -> c_int {
    boundary::status("strata_kv_destroy", || SPACES.remove(kv).map(drop))
}

/// Describes the `kind` tensor of `layer`.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_kv_tensor(
    kv: u64,
    layer: u32,
    kind: c_int,
    out: *mut strata_kv_tensor_t,
) -> c_int {
    boundary::status("strata_kv_tensor", || {
        let s = space(kv)?;
        let out = out_ptr("out", out)?;
        let kind = kind_of(kind)?;
        let data = s.manager.tensor_ptr(layer, kind)?;
        let cfg = s.manager.config();
        let elem = i64::from(s.elem_size);
        let desc = strata_kv_tensor_t {
            data,
            device: s.device as i32,
            dlpack_device_type: s.dlpack_device_type,
            ndim: 4,
            elem_size: s.elem_size,
            shape: [
                i64::from(cfg.max_requests),
                i64::from(cfg.max_tokens),
                i64::from(s.heads),
                i64::from(s.head_dim),
            ],
            strides: [
                i64::try_from(s.manager.slot_stride()).map_err(|_| Error::Overflow("stride"))?,
                cfg.bytes_per_token as i64,
                i64::from(s.head_dim) * elem,
                elem,
            ],
        };
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(desc) };
        Ok(())
    })
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
        s.manager.queue(&s.requests(waiting, count)?);
        Ok(())
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
        let lost = match s.durability {
            Durability::Backed => {
                pool.give(s.manager.revoke_spilling(pages)?);
                Vec::new()
            }
            Durability::Lossy => match s.manager.revoke(pages) {
                Ok(rev) => {
                    pool.give(rev.pages);
                    rev.lost
                }
                Err(e) => {
                    // Blocks lost before the pool ran dry stay lost: report them all the same.
                    let lost: Vec<_> = s
                        .manager
                        .requests_with_lost()
                        .into_iter()
                        .map(|r| (r, Vec::new()))
                        .collect();
                    deliver_lost(kv, &s, &lost)?;
                    return Err(e);
                }
            },
        };
        if !lost_blocks.is_null() {
            let n: usize = lost.iter().map(|(_, b)| b.len()).sum();
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { lost_blocks.write(n as u64) };
        }
        deliver_lost(kv, &s, &lost)
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
            spare: [0; 8],
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
