//! The set-up and checks shared by the offload, overflow and limit tests: two 64 MiB devices on
//! the strict host backend under a link model, their pools, a host pool and one allocator.
#![allow(dead_code)] // each test file uses its own part

use std::sync::Arc;
use std::time::Duration;

use strata_allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata_kernels::pattern;
use strata_vmm::host::{HostBackend, Link, LinkModel};
use strata_vmm::{Backend, HostConfig, StreamHandle};

pub const MIB: u64 = 1 << 20;
pub const PAGE: u64 = 2 * MIB;
pub const S0: StreamHandle = StreamHandle::DEFAULT;

pub struct Env {
    pub backend: Arc<dyn Backend>,
    pub device: Arc<PagePool>,
    pub host: Arc<PagePool>,
    /// Device 1's pool: a lender for overflow and revocation.
    pub peer: Arc<PagePool>,
    pub alloc: CachingAllocator,
}

pub fn manual() -> PoolConfig {
    PoolConfig {
        low_watermark: 0,
        high_watermark: 0,
        limit: None,
        idle_trim_after: None,
        background: false,
    }
}

/// Two 64 MiB devices whose links run at 20 GB/s with 5 µs latency (what `STRATA_HOST_LINK`
/// sets), so copies are really in flight on the stream while a migration waits.
pub fn env() -> Env {
    env_with(CachingConfig::default())
}

/// [`env`] with the allocator configured by `config`.
pub fn env_with(config: CachingConfig) -> Env {
    let link = Link {
        bandwidth: 20e9,
        latency: Duration::from_micros(5),
    };
    let backend = strata_vmm::host::open(HostConfig {
        devices: vec![32 * PAGE, 32 * PAGE],
        granularity: PAGE,
        strict: true,
        link: Some(LinkModel {
            host_to_device: link,
            device_to_host: link,
            device_to_device: link,
        }),
    })
    .expect("host backend");
    let device = PagePool::new(Arc::clone(&backend), 0, manual()).expect("pool");
    let host = PagePool::new_host(Arc::clone(&backend), 0, manual()).expect("host pool");
    let peer = PagePool::new(Arc::clone(&backend), 1, manual()).expect("peer pool");
    let alloc = CachingAllocator::new(Arc::clone(&device), config).expect("allocator");
    Env {
        backend,
        device,
        host,
        peer,
        alloc,
    }
}

pub fn injector(b: &Arc<dyn Backend>) -> &HostBackend {
    b.as_any().downcast_ref::<HostBackend>().unwrap()
}

pub fn fill(b: &Arc<dyn Backend>, ptr: u64, len: u64, seed: u64) {
    let mut buf = vec![0u8; len as usize];
    pattern::fill(&mut buf, seed, 0);
    b.write(ptr, &buf).expect("write");
}

pub fn check(b: &Arc<dyn Backend>, ptr: u64, len: u64, seed: u64, when: &str) {
    let mut buf = vec![0u8; len as usize];
    b.read(ptr, &mut buf).expect("read");
    assert_eq!(
        pattern::first_mismatch(&buf, seed, 0),
        None,
        "{when}: pattern {seed} at {ptr:#x}+{len}"
    );
}

/// Invariants, and the pools' counters agreeing with where the allocator's pages are: every
/// mapped page is counted in use by exactly the pool it came from.
pub fn consistent(e: &Env, when: &str) {
    if let Err(err) = e.alloc.check_invariants() {
        panic!("{when}: invariant violated: {err}\n{}", e.alloc.report());
    }
    let all = e.alloc.spill_stats(None).tiers;
    let stats = e.alloc.stats();
    assert_eq!(
        all.local + all.host + all.peer,
        stats.reserved_bytes,
        "{when}"
    );
    assert_eq!(e.device.stats().in_use as u64 * PAGE, all.local, "{when}");
    assert_eq!(e.host.stats().in_use as u64 * PAGE, all.host, "{when}");
    assert_eq!(e.peer.stats().in_use as u64 * PAGE, all.peer, "{when}");
    for t in &stats.tags {
        let s = e.alloc.spill_stats(Some(t.tag)).tiers;
        assert_eq!(
            s.local + s.host + s.peer,
            t.reserved_bytes,
            "{when}: tag {}",
            t.tag
        );
    }
}
