//! The conformance suite over every allocator.

use std::sync::Arc;

use strata_allocator::{
    CachingAllocator, CachingConfig, DirectResource, MemoryResource, PagePool, PoolConfig,
};
use strata_tests::{backend, conformance_suite};

const DEVICE: u64 = 4 << 30;

conformance_suite!(direct, || -> Arc<dyn MemoryResource> {
    Arc::new(DirectResource::new(backend(&[DEVICE]), 0).unwrap())
});

conformance_suite!(caching, || -> Arc<dyn MemoryResource> {
    let pool = PagePool::new(backend(&[DEVICE]), 0, PoolConfig::default()).unwrap();
    Arc::new(CachingAllocator::new(pool, CachingConfig::default()).unwrap())
});

conformance_suite!(caching_limited, || -> Arc<dyn MemoryResource> {
    let pool = PagePool::new(backend(&[DEVICE]), 0, PoolConfig::default()).unwrap();
    let config = CachingConfig {
        limit: Some(3 << 30),
        small_threshold: 256 << 10,
        ..CachingConfig::default()
    };
    Arc::new(CachingAllocator::new(pool, config).unwrap())
});
