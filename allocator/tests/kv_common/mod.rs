//! The set-up and checks shared by the KV space tests (`kv_space*.rs`, `kv_ahead.rs`,
//! `kv_unmap_faults.rs`): a small fake backend and the strict host backend at a granularity, each
//! with a pool of its device 0, the space's layout, and the fill patterns of its slots.
#![allow(dead_code)] // each test file uses its own part

pub mod fake;

use std::sync::Arc;

use strata_allocator::{Kind, KvConfig, KvSpace, PagePool, PoolConfig, SlotId};
use strata_kernels::pattern::{fill, first_mismatch};
use strata_vmm::{Backend, DevicePtr, Error, HostConfig};

/// Small pages keep the fill-pattern traffic of debug-build tests small; the host backend runs
/// both at a small granularity and at the 2 MiB of current GPUs.
pub const FAKE_PAGE: u64 = 4 << 10;
pub const HOST_SMALL_PAGE: u64 = 64 << 10;
pub const HOST_GPU_PAGE: u64 = 2 << 20;

/// A backend and a pool of its device 0 (no background thread, so counts are deterministic).
pub struct Rig {
    pub name: &'static str,
    pub backend: Arc<dyn Backend>,
    pub pool: Arc<PagePool>,
    pub page: u64,
}

pub fn pool_config(limit_pages: Option<u64>, page: u64) -> PoolConfig {
    PoolConfig {
        low_watermark: 0,
        high_watermark: 1 << 20,
        limit: limit_pages.map(|n| n * page),
        idle_trim_after: None,
        background: false,
    }
}

pub fn fake_rig(limit_pages: Option<u64>) -> (Rig, Arc<fake::Fake>) {
    let fake = Arc::new(fake::Fake::new(FAKE_PAGE, 1024 * FAKE_PAGE));
    let backend: Arc<dyn Backend> = fake.clone();
    let pool = PagePool::new(Arc::clone(&backend), 0, pool_config(limit_pages, FAKE_PAGE))
        .expect("fake pool");
    let rig = Rig {
        name: "fake",
        backend,
        pool,
        page: FAKE_PAGE,
    };
    (rig, fake)
}

/// The host backend, when it is built; `None` while it reports `Unsupported`.
pub fn host_rig(limit_pages: Option<u64>, granularity: u64) -> Option<Rig> {
    let config = HostConfig {
        devices: vec![256 << 20],
        granularity,
        strict: true,
        link: None,
    };
    let backend = match strata_vmm::host_or_cuda(config) {
        Ok(b) => b,
        Err(Error::Unsupported(why)) => {
            eprintln!("host backend unavailable ({why}); its runs are skipped");
            return None;
        }
        Err(e) => panic!("host backend failed to open: {e}"),
    };
    let page = backend
        .granularity(strata_vmm::Location::Device(0))
        .expect("granularity");
    let pool =
        PagePool::new(Arc::clone(&backend), 0, pool_config(limit_pages, page)).expect("host pool");
    Some(Rig {
        name: "host",
        backend,
        pool,
        page,
    })
}

/// The fake and the small-page host backend (for tests that move many bytes).
pub fn rigs(limit_pages: Option<u64>) -> Vec<Rig> {
    let mut rigs = vec![fake_rig(limit_pages).0];
    rigs.extend(host_rig(limit_pages, HOST_SMALL_PAGE));
    rigs
}

/// [`rigs`] plus the host backend at the GPU granularity.
pub fn all_rigs(limit_pages: Option<u64>) -> Vec<Rig> {
    let mut rigs = rigs(limit_pages);
    rigs.extend(host_rig(limit_pages, HOST_GPU_PAGE));
    rigs
}

/// 2 layers, 4 slots, 3/8 of a page per token (tokens straddle pages), 20 tokens = 7.5 pages
/// per slot → 8 pages per slot per tensor.
pub fn config(page: u64, zero_page: bool) -> KvConfig {
    KvConfig {
        layers: 2,
        max_slots: 4,
        max_tokens: 20,
        bytes_per_token: 3 * page / 8,
        zero_page,
    }
}

pub fn kinds() -> [Kind; 2] {
    [Kind::K, Kind::V]
}

pub fn seed_of(slot: SlotId, layer: u32, kind: Kind) -> u64 {
    (u64::from(slot.index()) << 40)
        ^ (u64::from(slot.generation()) << 16)
        ^ (u64::from(layer) << 2)
        ^ kind as u64
}

/// Writes the slot's pattern over tokens `from..to` of every tensor.
pub fn write_tokens(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, from: u32, to: u32) {
    if to <= from {
        return;
    }
    let bpt = space.config().bytes_per_token;
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            let offset = u64::from(from) * bpt;
            let mut buf = vec![0u8; (u64::from(to - from) * bpt) as usize];
            fill(&mut buf, seed_of(slot, layer, kind), offset);
            backend.write(base + offset, &buf).expect("write tokens");
        }
    }
}

/// Checks tokens `0..tokens` of every tensor of `slot` against its pattern.
pub fn check_tokens(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, tokens: u32) {
    let bpt = space.config().bytes_per_token;
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            let mut buf = vec![0u8; (u64::from(tokens) * bpt) as usize];
            backend.read(base, &mut buf).expect("read tokens");
            if let Some(at) = first_mismatch(&buf, seed_of(slot, layer, kind), 0) {
                panic!("slot {slot:?} layer {layer} {kind:?}: mismatch at byte {at}");
            }
        }
    }
}

pub fn read_bytes(backend: &Arc<dyn Backend>, va: DevicePtr, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    backend.read(va, &mut buf).expect("read");
    buf
}

pub fn ok(space: &KvSpace) {
    if let Err(e) = space.check_invariants() {
        panic!("invariant broken: {e}");
    }
}
