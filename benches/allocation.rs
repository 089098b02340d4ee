//! Allocation latency: a cached `allocate` + `deallocate` pair on the caching allocator's fast
//! path, per size, against the non-caching `DirectResource` (reserve + create + map per call,
//! as vLLM's CuMemAllocator and torch_memory_saver do).
//!
//! Run: `cargo bench --bench allocation` (STRATA_BACKEND=cuda on a GPU machine).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use strata::allocator::{
    CachingAllocator, CachingConfig, DirectResource, MemoryResource, PagePool, PoolConfig,
};
use strata::vmm::{self, StreamHandle};

const S: StreamHandle = StreamHandle::DEFAULT;

fn bench(c: &mut Criterion) {
    let backend = vmm::from_env().expect("backend");
    let pool = PagePool::new(Arc::clone(&backend), 0, PoolConfig::default()).expect("pool");
    let caching = CachingAllocator::new(pool, CachingConfig::default()).expect("allocator");
    let direct = DirectResource::new(Arc::clone(&backend), 0).expect("direct");

    let mut group = c.benchmark_group(format!("alloc_free_pair/{}", backend.kind()));
    group.measurement_time(Duration::from_secs(3));
    for (label, size) in [
        ("256B", 256u64),
        ("4KiB", 4 << 10),
        ("64KiB", 64 << 10),
        ("2MiB", 2 << 20),
        ("8MiB", 8 << 20),
    ] {
        // Warm: the first pair maps; every measured pair is served from the cache.
        let p = caching.allocate(size, S).expect("warm");
        caching.deallocate(p, S).expect("warm");
        group.bench_function(BenchmarkId::new("caching", label), |b| {
            b.iter(|| {
                let p = caching.allocate(black_box(size), S).expect("allocate");
                caching.deallocate(black_box(p), S).expect("deallocate");
            })
        });
    }
    group.bench_function(BenchmarkId::new("direct", "2MiB"), |b| {
        b.iter(|| {
            let p = direct.allocate(black_box(2 << 20), S).expect("allocate");
            direct.deallocate(black_box(p), S).expect("deallocate");
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
