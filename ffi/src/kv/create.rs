//! Creating and destroying a KV space, and the descriptors of its tensors.

use std::ffi::{c_char, c_int};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_tiers::policy::Links;
use strata_tiers::{
    DiskConfig, Durability, KvBlockManager, KvBlocksConfig, PolicyKind, StoreConfig, TierSpec,
    TierStore,
};
use strata_vmm::{Error, Result};

use crate::boundary;

use super::{
    device_pool, dlpack_device_type, kind_of, out_ptr, positive, space, KvEntry, MAX_SERIAL,
    MAX_STORE_BLOCK, SERIALS, SERIAL_SHIFT, SPACES,
};

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

/// Validates a config and builds the space.
///
/// # Safety
///
/// `c.disk_dir` is NULL or a NUL-terminated string.
unsafe fn create(c: &strata_kv_config_t) -> Result<KvEntry> {
    if c.reserved != 0 || c.spare.iter().any(|&x| x != 0) {
        return Err(Error::InvalidArgument(
            "strata_kv_config_t.reserved and .spare must be zero".into(),
        ));
    }
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
    // A full host tier moves to disk the blocks whose request runs furthest away (TierKV §3.4:
    // strata_kv_hint and strata_kv_queue give the order); with neither, least recently used.
    store.host_policy = PolicyKind::Lookahead;
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
    boundary::status("strata_kv_destroy", || {
        SPACES.remove(kv).map(release_when_last)
    })
}

/// How long [`strata_kv_destroy`] waits for other holders of the space to let go.
const LAST_HOLDER_WAIT: Duration = Duration::from_millis(200);

/// Drops the space once nothing else holds it, so that its pages are back in the pool when
/// `strata_kv_destroy` returns. Other holders are calls running on it and the figures
/// snapshot of `strata ps` (`ops.rs`), each brief; the handle is already stale, so no new one
/// comes. The wait is bounded: a callback of a call on this very space that destroys it would
/// otherwise wait for itself; past the bound the last holder releases the space.
fn release_when_last(mut space: Arc<KvEntry>) {
    let deadline = std::time::Instant::now() + LAST_HOLDER_WAIT;
    loop {
        match Arc::try_unwrap(space) {
            Ok(only) => return drop(only),
            Err(shared) if std::time::Instant::now() < deadline => {
                space = shared;
                std::thread::sleep(Duration::from_micros(50));
            }
            Err(shared) => return drop(shared),
        }
    }
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
