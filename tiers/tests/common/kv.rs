//! A [`KvBlockManager`] over a strict host backend with host and disk tiers, and patterned KV
//! for the KV tests (`kv_blocks`, `kv_stage`, `kv_walk`).

use std::sync::Arc;
use std::time::Duration;

use strata_allocator::{Kind, PagePool, PoolConfig};
use strata_tiers::policy::Links;
use strata_tiers::{
    DiskConfig, KvBlockManager, KvBlocksConfig, PolicyKind, RequestId, StoreConfig, Tier, TierSpec,
    TierStore,
};
use strata_vmm::Error;

use super::backend;

pub const PAGE: u64 = 2 << 20;
pub const LAYERS: u32 = 2;
/// Bytes per token per tensor: 512 tokens per block.
pub const BPT: u64 = 4096;
pub const TPB: u32 = (PAGE / BPT) as u32;
/// The store's copy unit: 4 per tensor page.
pub const CHUNK: u64 = 512 << 10;

/// A manager whose pool holds at most `pool_pages` pages (4 per block), with host and disk
/// tiers of `host_chunks` and `disk_chunks` store blocks.
pub fn manager(
    pool_pages: u64,
    host_chunks: u64,
    disk_chunks: u64,
    dir: &std::path::Path,
) -> KvBlockManager {
    manager_ahead(pool_pages, host_chunks, disk_chunks, dir, None, true)
}

/// [`manager`], with the background mapper on (`ahead`: its budget in pages) and a zero page or
/// not ([`manager`]'s space has one).
pub fn manager_ahead(
    pool_pages: u64,
    host_chunks: u64,
    disk_chunks: u64,
    dir: &std::path::Path,
    ahead: Option<usize>,
    zero_page: bool,
) -> KvBlockManager {
    let b = backend(None);
    let pool = PagePool::new(
        Arc::clone(&b),
        0,
        PoolConfig {
            background: false,
            limit: Some(pool_pages * PAGE),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let m = build(pool, host_chunks, disk_chunks, dir, zero_page);
    if let Some(budget) = ahead {
        m.start_map_ahead(budget).unwrap();
    }
    m
}

/// A manager over `pool`, with host and disk tiers of `host_chunks` and `disk_chunks` store
/// blocks.
pub fn manager_on(
    pool: Arc<PagePool>,
    host_chunks: u64,
    disk_chunks: u64,
    dir: &std::path::Path,
) -> KvBlockManager {
    build(pool, host_chunks, disk_chunks, dir, true)
}

fn build(
    pool: Arc<PagePool>,
    host_chunks: u64,
    disk_chunks: u64,
    dir: &std::path::Path,
    zero_page: bool,
) -> KvBlockManager {
    let mut c = StoreConfig::new(CHUNK, 0, host_chunks * CHUNK);
    // As strata_kv_create: the host tier sends the blocks of the request running last to disk.
    c.host_policy = PolicyKind::Lookahead;
    c.disk = Some(DiskConfig {
        dir: dir.to_path_buf(),
        spec: TierSpec {
            capacity: disk_chunks * CHUNK,
            bandwidth: 7e9,
            latency: Duration::from_micros(80),
        },
        io_threads: 2,
        direct: true,
    });
    c.staging_blocks = 8;
    let store = Arc::new(TierStore::new(pool, c).unwrap());
    KvBlockManager::new(
        store,
        KvBlocksConfig {
            layers: LAYERS,
            max_requests: 16,
            max_tokens: 4 * TPB,
            bytes_per_token: BPT,
            t_iter: Duration::from_millis(20),
            delta_sched: Duration::ZERO,
            links: Links {
                host_to_hbm: (Duration::from_micros(5), 50e9),
                disk_to_host: (Duration::from_micros(80), 7e9),
            },
            zero_page,
        },
    )
    .unwrap()
}

pub fn tensors() -> impl Iterator<Item = (usize, u32, Kind)> {
    (0..LAYERS)
        .flat_map(|l| [(l, Kind::K), (l, Kind::V)])
        .enumerate()
        .map(|(t, (l, k))| (t, l, k))
}

pub fn pattern(seed: u64, t: usize, from: u32, n: u32) -> Vec<u8> {
    let mut v = vec![0u8; (u64::from(n) * BPT) as usize];
    strata_kernels::pattern::fill(&mut v, seed * 64 + t as u64, u64::from(from) * BPT);
    v
}

/// Writes the pattern of `seed` into tokens `from..from + n` of every tensor of `r`.
pub fn fill(m: &KvBlockManager, r: RequestId, seed: u64, from: u32, n: u32) -> Result<(), Error> {
    for (t, l, k) in tensors() {
        m.write_kv(r, l, k, from, &pattern(seed, t, from, n))?;
    }
    Ok(())
}

/// Appends `n` tokens to `r` and writes them.
pub fn grow(m: &KvBlockManager, r: RequestId, seed: u64, n: u32) -> Result<(), Error> {
    let have = m.tokens(r)?;
    m.append(r, n)?;
    fill(m, r, seed, have, n)
}

/// Reads every token of `r` in every tensor and checks it; returns the slowest tier read and
/// the blocks checked.
pub fn verify(m: &KvBlockManager, r: RequestId, seed: u64) -> Result<(Tier, usize), Error> {
    let total = m.tokens(r)?;
    let mut slowest = Tier::Hbm;
    for (t, l, k) in tensors() {
        let mut buf = vec![0u8; (u64::from(total) * BPT) as usize];
        slowest = slowest.max(m.read_kv(r, l, k, 0, &mut buf)?);
        assert_eq!(
            strata_kernels::pattern::first_mismatch(&buf, seed * 64 + t as u64, 0),
            None,
            "request {r:?} tensor {t}"
        );
    }
    Ok((slowest, total.div_ceil(TPB) as usize))
}

pub fn ptrs(m: &KvBlockManager, r: RequestId) -> Vec<u64> {
    tensors()
        .map(|(_, l, k)| m.kv_ptr(r, l, k).unwrap())
        .collect()
}

/// Bytes copied down from the device, ever.
pub fn bytes_down(m: &KvBlockManager) -> u64 {
    m.store().stats().transfers.bytes_d2h
}
