//! Page map + access + unmap on the selected backend (host emulation without a GPU):
//! - `per_page`: map, set access, unmap one page at a time (what a naive allocator does);
//! - `batched_access`: map a run of pages one by one, set access once over the run, unmap;
//! - `plain_loop` (per page, raw `Backend` calls) vs `raii` (the `Mapping` owner), to show the
//!   owner adds nothing measurable over the plain driver loop.
//!
//! Run: `cargo bench --bench vmm_map` (STRATA_BACKEND=cuda on a GPU machine).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use strata::vmm::{
    self, Access, Backend, CreateFlags, Location, Mapping, PhysicalMemory, Reservation,
};

const RUN: u64 = 32;

fn setup() -> (
    Arc<dyn Backend>,
    u64,
    Arc<Reservation>,
    Vec<Arc<PhysicalMemory>>,
) {
    let backend = vmm::from_env().expect("backend");
    let page = backend
        .granularity(Location::Device(0))
        .expect("granularity");
    let reservation = Arc::new(Reservation::new(&backend, RUN * page, 0).expect("reserve"));
    let pages = (0..RUN)
        .map(|_| {
            Arc::new(
                PhysicalMemory::create(&backend, Location::Device(0), page, CreateFlags::empty())
                    .expect("create"),
            )
        })
        .collect();
    (backend, page, reservation, pages)
}

fn bench(c: &mut Criterion) {
    let (backend, page, reservation, pages) = setup();
    let base = reservation.ptr();
    let rw = [(Location::Device(0), Access::ReadWrite)];
    let mut group = c.benchmark_group(format!("map_access_unmap/{}", backend.kind()));
    group.throughput(Throughput::Elements(RUN));
    group.measurement_time(Duration::from_secs(3));

    group.bench_function(BenchmarkId::new("plain_loop", "per_page"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                for (i, p) in pages.iter().enumerate() {
                    let va = base + i as u64 * page;
                    backend.map(va, page, p.handle(), 0).expect("map");
                    backend.set_access(va, page, &rw).expect("access");
                    backend.unmap(va, page).expect("unmap");
                }
            }
            start.elapsed()
        })
    });
    group.bench_function(BenchmarkId::new("raii", "per_page"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                for (i, p) in pages.iter().enumerate() {
                    let va = base + i as u64 * page;
                    let m =
                        Mapping::new(&reservation, va, Arc::clone(p), 0, page, &rw).expect("map");
                    m.unmap().expect("unmap");
                }
            }
            start.elapsed()
        })
    });
    group.bench_function(BenchmarkId::new("plain_loop", "batched_access"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                for (i, p) in pages.iter().enumerate() {
                    backend
                        .map(base + i as u64 * page, page, p.handle(), 0)
                        .expect("map");
                }
                backend.set_access(base, RUN * page, &rw).expect("access");
                for i in 0..RUN {
                    backend.unmap(base + i * page, page).expect("unmap");
                }
            }
            start.elapsed()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
