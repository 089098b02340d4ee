//! Shared helpers for the tiers tests: a strict host backend, a pool, stores with all tiers.
#![allow(dead_code)]

pub mod kv;
pub mod kvpr;

use std::sync::Arc;
use std::time::Duration;

use strata_allocator::{PagePool, PoolConfig};
use strata_tiers::{DiskConfig, StoreConfig, TierSpec, TierStore};
use strata_vmm::{Backend, HostConfig};

pub const BLOCK: u64 = 64 << 10;

pub fn backend(link: Option<strata_vmm::host::LinkModel>) -> Arc<dyn Backend> {
    strata_vmm::host_or_cuda(HostConfig {
        devices: vec![64 << 20],
        granularity: 2 << 20,
        strict: true,
        link,
    })
    .expect("host backend")
}

pub fn pool(backend: &Arc<dyn Backend>) -> Arc<PagePool> {
    PagePool::new(
        Arc::clone(backend),
        0,
        PoolConfig {
            background: false,
            ..PoolConfig::default()
        },
    )
    .expect("pool")
}

pub fn disk(dir: &std::path::Path, blocks: u64) -> DiskConfig {
    DiskConfig {
        dir: dir.to_path_buf(),
        spec: TierSpec {
            capacity: blocks * BLOCK,
            bandwidth: 7e9,
            latency: Duration::from_micros(80),
        },
        io_threads: 2,
        direct: true,
    }
}

/// HBM: `hbm_pages` pages of 2 MiB (32 blocks each); host: `host_blocks`; disk: `disk_blocks`.
pub fn store(
    backend: &Arc<dyn Backend>,
    dir: &std::path::Path,
    hbm_pages: u64,
    host_blocks: u64,
    disk_blocks: u64,
) -> TierStore {
    let mut c = StoreConfig::new(BLOCK, hbm_pages * (2 << 20), host_blocks * BLOCK);
    c.disk = Some(disk(dir, disk_blocks));
    c.staging_blocks = 8;
    TierStore::new(pool(backend), c).expect("store")
}

pub fn block(seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK as usize];
    strata_kernels::pattern::fill(&mut v, seed, 0);
    v
}

pub fn check(store: &TierStore, id: strata_tiers::ObjectId, seed: u64) -> strata_tiers::Tier {
    let mut buf = vec![0u8; BLOCK as usize];
    let tier = store.read(id, &mut buf).expect("read");
    assert_eq!(
        strata_kernels::pattern::first_mismatch(&buf, seed, 0),
        None,
        "{id} (seed {seed}) read from {tier:?} has wrong contents"
    );
    tier
}
