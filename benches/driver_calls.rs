//! The median cost of each driver call strata makes, on whatever backend the environment
//! selects (`STRATA_BACKEND`; the host backend charges `STRATA_HOST_LATENCY`'s profile, the
//! emulated driver too): per 2 MiB page (granule) and per run of 32 pages for create, reserve,
//! map, set_access, unmap, release and free; streams and events; pinned host memory.
//!
//! Run: `cargo bench --bench driver_calls` (options: `-- --ops N`, samples per call, default
//! 200, at most 2000; `--quick`: 50). On a GPU machine `.ci/gpu-run bench` runs it from the
//! bundle (every bench executable is in it; plain benches get `--quick` there).

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata::vmm::{self, Access, Backend, CreateFlags, Location, PhysHandle, StreamHandle};

const RUN: u64 = 32;
const D0: Location = Location::Device(0);

/// Timings of one call, in the order taken.
#[derive(Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.0.push(start.elapsed());
        out
    }

    fn quantile(&self, q: f64) -> f64 {
        let mut v = self.0.clone();
        v.sort();
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        v[i].as_secs_f64() * 1e6
    }
}

struct Table(Vec<(String, String, Samples)>);

impl Table {
    fn row(&mut self, call: &str, unit: &str, samples: Samples) {
        self.0.push((call.into(), unit.into(), samples));
    }

    fn print(&self) {
        println!("| call | unit | median µs | p90 µs | samples |");
        println!("|---|---|---|---|---|");
        for (call, unit, s) in &self.0 {
            println!(
                "| {call} | {unit} | {:.2} | {:.2} | {} |",
                s.quantile(0.5),
                s.quantile(0.9),
                s.0.len()
            );
        }
    }
}

fn main() {
    let mut samples = 200usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ops" => samples = args.next().and_then(|v| v.parse().ok()).expect("--ops N"),
            "--quick" => samples = 50,
            _ => {} // cargo bench passes --bench
        }
    }
    let samples = samples.clamp(5, 2000);
    let backend = vmm::from_env().expect("backend");
    let g = backend.granularity(D0).expect("granularity");
    let profile = match backend.as_any().downcast_ref::<vmm::HostBackend>() {
        Some(host) => format!(", latency profile {}", host.latency().name),
        None => String::new(),
    };
    println!(
        "backend {}{profile}; page (granule) {} KiB; run {RUN} pages; {samples} samples per call",
        backend.kind(),
        g >> 10
    );
    let mut table = Table(Vec::new());
    per_page(&backend, g, samples, &mut table);
    per_run(&backend, g, (samples / 8).max(5), &mut table);
    streams_and_events(&backend, samples, &mut table);
    pinned(&backend, g, samples, &mut table);
    table.print();
}

fn per_page(b: &Arc<dyn Backend>, g: u64, n: usize, table: &mut Table) {
    let rw = [(D0, Access::ReadWrite)];
    let names = [
        "reserve",
        "create",
        "map",
        "set_access",
        "unmap",
        "release",
        "free_va",
    ];
    let mut s: Vec<Samples> = names.iter().map(|_| Samples::default()).collect();
    for _ in 0..n {
        let va = s[0].time(|| b.reserve(g, 0).expect("reserve"));
        let h = s[1].time(|| b.create(D0, g, CreateFlags::empty()).expect("create"));
        s[2].time(|| b.map(va, g, h, 0).expect("map"));
        s[3].time(|| b.set_access(va, g, &rw).expect("set_access"));
        s[4].time(|| b.unmap(va, g).expect("unmap"));
        s[5].time(|| b.release(h).expect("release"));
        s[6].time(|| b.free_va(va, g).expect("free_va"));
    }
    for (name, samples) in names.iter().zip(s) {
        table.row(name, "one page", samples);
    }
}

fn per_run(b: &Arc<dyn Backend>, g: u64, n: usize, table: &mut Table) {
    let rw = [(D0, Access::ReadWrite)];
    let span = RUN * g;
    let names = [
        "reserve",
        "create ×32",
        "map ×32",
        "set_access",
        "unmap",
        "release ×32",
        "free_va",
    ];
    let mut s: Vec<Samples> = names.iter().map(|_| Samples::default()).collect();
    for _ in 0..n {
        let va = s[0].time(|| b.reserve(span, 0).expect("reserve"));
        let handles: Vec<PhysHandle> = s[1].time(|| {
            (0..RUN)
                .map(|_| b.create(D0, g, CreateFlags::empty()).expect("create"))
                .collect()
        });
        s[2].time(|| {
            for (i, &h) in handles.iter().enumerate() {
                b.map(va + i as u64 * g, g, h, 0).expect("map");
            }
        });
        s[3].time(|| b.set_access(va, span, &rw).expect("set_access"));
        // One call over the 32 adjacent mappings (the contract allows whole adjacent ones).
        s[4].time(|| b.unmap(va, span).expect("unmap"));
        s[5].time(|| {
            for &h in &handles {
                b.release(h).expect("release");
            }
        });
        s[6].time(|| b.free_va(va, span).expect("free_va"));
    }
    for (name, samples) in names.iter().zip(s) {
        table.row(name, "run of 32 pages", samples);
    }
}

fn streams_and_events(b: &Arc<dyn Backend>, n: usize, table: &mut Table) {
    let names = [
        "stream_create",
        "event_create",
        "event_record",
        "event_query",
        "stream_wait_event",
        "event_synchronize",
        "stream_synchronize",
        "event_destroy",
        "stream_destroy",
    ];
    let mut s: Vec<Samples> = names.iter().map(|_| Samples::default()).collect();
    for _ in 0..n {
        let stream = s[0].time(|| b.stream_create(0).expect("stream_create"));
        let event = s[1].time(|| b.event_create().expect("event_create"));
        s[2].time(|| b.event_record(event, stream).expect("event_record"));
        s[3].time(|| b.event_query(event).expect("event_query"));
        s[4].time(|| {
            b.stream_wait_event(StreamHandle::DEFAULT, event)
                .expect("stream_wait_event")
        });
        s[5].time(|| b.event_synchronize(event).expect("event_synchronize"));
        s[6].time(|| b.stream_synchronize(stream).expect("stream_synchronize"));
        s[7].time(|| b.event_destroy(event).expect("event_destroy"));
        s[8].time(|| b.stream_destroy(stream).expect("stream_destroy"));
    }
    for (name, samples) in names.iter().zip(s) {
        table.row(name, "one call, idle stream", samples);
    }
}

fn pinned(b: &Arc<dyn Backend>, g: u64, n: usize, table: &mut Table) {
    let (mut alloc, mut free) = (Samples::default(), Samples::default());
    for _ in 0..n.min(200) {
        let p = alloc.time(|| b.host_alloc(g).expect("host_alloc"));
        // SAFETY: exactly what `host_alloc` just returned, freed once, never used.
        free.time(|| unsafe { b.host_free(p, g) }.expect("host_free"));
    }
    table.row("host_alloc (pinned)", "one page", alloc);
    table.row("host_free (pinned)", "one page", free);
}
