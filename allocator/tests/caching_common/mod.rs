//! The set-up and checks shared by the caching allocator's tests (`caching.rs`,
//! `caching_unlocked.rs`, `caching_walk.rs`): one device of a given size behind a
//! [`FaultyBackend`] (fault injection, gates and slow streams over any backend), its pool and
//! one allocator.
#![allow(dead_code)] // each test file uses its own part

use std::sync::Arc;
use std::time::Duration;

use strata_allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata_kernels::pattern;
use strata_vmm::host::{Link, LinkModel};
use strata_vmm::{Backend, FaultyBackend, HostConfig, StreamHandle};

pub const MIB: u64 = 1 << 20;
pub const PAGE: u64 = 2 * MIB;
pub const S0: StreamHandle = StreamHandle::DEFAULT;

pub struct Env {
    pub backend: Arc<dyn Backend>,
    /// The same backend, for its test controls (faults, gates, slow streams).
    pub hooks: Arc<FaultyBackend>,
    pub pool: Arc<PagePool>,
    pub alloc: CachingAllocator,
}

/// A device of `device_bytes` with `config`: the strict host backend's device 0 of that size
/// (under `link`, if any), or with `STRATA_BACKEND=cuda` the driver's device 0 with the pool
/// limited to `device_bytes` where the device is larger, so that running out behaves the same
/// on a 141 GiB GPU (as the limit's [`Error::LimitExceeded`](strata_allocator::Error), which
/// `is_out_of_memory`).
pub fn env_with(device_bytes: u64, config: CachingConfig, link: Option<LinkModel>) -> Env {
    let inner = strata_vmm::host_or_cuda(HostConfig {
        devices: vec![device_bytes],
        granularity: PAGE,
        strict: true,
        link,
    })
    .expect("backend");
    let hooks = FaultyBackend::new(inner);
    let backend: Arc<dyn Backend> = hooks.clone();
    let total = backend.mem_info(0).expect("mem_info").total;
    let pool = PagePool::new(
        Arc::clone(&backend),
        0,
        PoolConfig {
            low_watermark: 0,
            high_watermark: 0,
            limit: (total > device_bytes).then_some(device_bytes),
            idle_trim_after: None,
            background: false,
        },
    )
    .expect("pool");
    let alloc = CachingAllocator::new(Arc::clone(&pool), config).expect("allocator");
    Env {
        backend,
        hooks,
        pool,
        alloc,
    }
}

/// A 1 GiB device with the default configuration.
pub fn env() -> Env {
    env_with(1 << 30, CachingConfig::default(), None)
}

pub fn free_mem(backend: &Arc<dyn Backend>) -> u64 {
    backend.mem_info(0).expect("mem_info").free
}

pub fn fill(backend: &Arc<dyn Backend>, ptr: u64, len: u64, seed: u64) {
    let mut buf = vec![0u8; len as usize];
    pattern::fill(&mut buf, seed, 0);
    backend.write(ptr, &buf).expect("write");
}

pub fn check(backend: &Arc<dyn Backend>, ptr: u64, len: u64, seed: u64) {
    let mut buf = vec![0u8; len as usize];
    backend.read(ptr, &mut buf).expect("read");
    assert_eq!(
        pattern::first_mismatch(&buf, seed, 0),
        None,
        "pattern {seed} at {ptr:#x}+{len}"
    );
}

pub fn read_all(backend: &Arc<dyn Backend>, ptr: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    backend.read(ptr, &mut buf).expect("read");
    buf
}

/// Checks the fill pattern of a live `(ptr, size, seed)` allocation and frees it.
pub fn check_and_free(
    a: &CachingAllocator,
    backend: &Arc<dyn Backend>,
    (ptr, size, seed): (u64, u64, u64),
) {
    check(backend, ptr, size, seed);
    a.deallocate(ptr, S0).unwrap();
}

pub fn ok(a: &CachingAllocator) {
    if let Err(e) = a.check_invariants() {
        panic!("invariant violated: {e}\n{}", a.report());
    }
}

/// A link model in which device-to-device copies take 300 ms (work really in flight on a stream;
/// the host backend only).
pub fn slow_device_copies() -> LinkModel {
    let fast = Link {
        bandwidth: f64::INFINITY,
        latency: Duration::ZERO,
    };
    LinkModel {
        host_to_device: fast,
        device_to_host: fast,
        device_to_device: Link {
            bandwidth: f64::INFINITY,
            latency: Duration::from_millis(300),
        },
    }
}
