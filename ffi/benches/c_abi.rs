//! Cost of a `strata_malloc` + `strata_free` pair through the C ABI on the fast path (a cached
//! block of the same size, same stream), per size. The library is loaded with dlopen and the
//! two symbols looked up with dlsym, as PyTorch's `CUDAPluggableAllocator` does.
//!
//! Side by side, in the same run: the same pair on a `CachingAllocator` called directly from
//! Rust (no C boundary, no lazy-init lookups, no tag stack), to show what the ABI layer costs.
//!
//! Run: `cargo bench -p strata-ffi --bench c_abi` (host backend unless `STRATA_BACKEND=cuda`).

use std::ffi::{c_int, c_void};
use std::hint::black_box;
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use strata_allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata_vmm::StreamHandle;

#[path = "../tests/support/mod.rs"]
mod support;

type Malloc = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type Free = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);

fn bench(c: &mut Criterion) {
    let path = support::library();
    // SAFETY: loading our own library runs no initializers with preconditions.
    let lib = unsafe { libloading::Library::new(&path) }
        .unwrap_or_else(|e| panic!("dlopen {}: {e}", path.display()));
    // SAFETY: the symbols have these exact signatures (include/strata.h).
    let (malloc, free) = unsafe {
        (
            *lib.get::<Malloc>(b"strata_malloc\0")
                .expect("strata_malloc"),
            *lib.get::<Free>(b"strata_free\0").expect("strata_free"),
        )
    };
    let backend = strata_vmm::from_env().expect("backend");
    let pool = PagePool::new(Arc::clone(&backend), 0, PoolConfig::default()).expect("pool");
    let direct = CachingAllocator::new(pool, CachingConfig::default()).expect("allocator");
    let s = StreamHandle::DEFAULT;

    let mut group = c.benchmark_group(format!("malloc_free_pair/{}", backend.kind()));
    group.measurement_time(Duration::from_secs(3));
    for (label, size) in [
        ("256B", 256usize),
        ("4KiB", 4 << 10),
        ("64KiB", 64 << 10),
        ("2MiB", 2 << 20),
        ("8MiB", 8 << 20),
    ] {
        // Warm: the first pair maps; every measured pair is served from the cache.
        // SAFETY: valid arguments; the pointer is freed once.
        unsafe {
            let p = malloc(size, 0, null_mut());
            assert!(!p.is_null(), "warm-up allocation of {size} failed");
            free(p, size, 0, null_mut());
        }
        group.bench_function(BenchmarkId::new("c_abi", label), |b| {
            b.iter(|| {
                // SAFETY: as above.
                unsafe {
                    let p = malloc(black_box(size), 0, null_mut());
                    free(black_box(p), size, 0, null_mut());
                }
            })
        });
        let p = direct.allocate(size as u64, s).expect("warm");
        direct.deallocate(p, s).expect("warm");
        group.bench_function(BenchmarkId::new("rust_direct", label), |b| {
            b.iter(|| {
                let p = direct
                    .allocate(black_box(size as u64), s)
                    .expect("allocate");
                direct.deallocate(black_box(p), s).expect("deallocate");
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
