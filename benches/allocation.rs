//! Allocation latency: a cached `allocate` + `deallocate` pair on the caching allocator's fast
//! path, per size, against the non-caching `DirectResource` (reserve + create + map per call,
//! as vLLM's CuMemAllocator and torch_memory_saver do); and the same small pair while another
//! thread keeps growing and emptying the cache (`while_growing`: on the host backend each page
//! creation is made to take 200 µs, as `cuMemCreate` of 2 MiB does on an A100).
//!
//! Run: `cargo bench --bench allocation` (STRATA_BACKEND=cuda on a GPU machine).

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use strata::allocator::{
    CachingAllocator, CachingConfig, DirectResource, MemoryResource, PagePool, PoolConfig,
};
use strata::vmm::host::FaultOp;
use strata::vmm::{self, HostBackend, StreamHandle};

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

/// Simulated cost of creating one page on the host backend.
const CREATE_COST: Duration = Duration::from_micros(200);

fn bench_while_growing(c: &mut Criterion) {
    let backend = vmm::from_env().expect("backend");
    if let Some(host) = backend.as_any().downcast_ref::<HostBackend>() {
        host.set_op_gate(
            FaultOp::Create,
            Some(Arc::new(|_| std::thread::sleep(CREATE_COST))),
        );
    }
    // No free pages kept: every growth creates its pages.
    let pool_config = PoolConfig {
        low_watermark: 0,
        high_watermark: 0,
        background: false,
        ..PoolConfig::default()
    };
    let pool = PagePool::new(Arc::clone(&backend), 0, pool_config).expect("pool");
    let caching = CachingAllocator::new(pool, CachingConfig::default()).expect("allocator");
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let p = caching.allocate(16 << 20, S).expect("grow");
                caching.deallocate(p, S).expect("free");
                caching.empty_cache().expect("empty_cache");
            }
        });
        let mut group = c.benchmark_group(format!("alloc_free_pair/{}", backend.kind()));
        group.measurement_time(Duration::from_secs(3));
        let p = caching.allocate(256, S).expect("warm");
        let keep = caching.allocate(256, S).expect("warm");
        caching.deallocate(p, S).expect("warm");
        group.bench_function(BenchmarkId::new("caching_while_growing", "256B"), |b| {
            b.iter(|| {
                let p = caching.allocate(black_box(256), S).expect("allocate");
                caching.deallocate(black_box(p), S).expect("deallocate");
            })
        });
        group.finish();
        caching.deallocate(keep, S).expect("free");
        stop.store(true, Ordering::Relaxed);
    });
    if let Some(host) = backend.as_any().downcast_ref::<HostBackend>() {
        host.set_op_gate(FaultOp::Create, None);
    }
}

criterion_group!(benches, bench, bench_while_growing);
criterion_main!(benches);
