//! What the KV calls of the C ABI cost next to the same `KvBlockManager` calls made from Rust,
//! side by side in one run: append (fresh pages mapped; and on a recycled slot, where the pages
//! are already mapped), spill to host memory, and restore (`make_resident`, waited for).
//! `libstrata.so` is loaded with dlopen as an engine would; both sides use the same shape, the
//! same host tier and the same backend kind (each its own instance).
//!
//! Run: `cargo bench -p strata-ffi --bench kv_abi` (host backend unless `STRATA_BACKEND=cuda`;
//! `-- --quick` for fewer rounds). Prints medians per call and the restore throughput.

use std::ffi::c_void;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_allocator::{PagePool, PoolConfig};
use strata_tiers::policy::Links;
use strata_tiers::{KvBlockManager, KvBlocksConfig, RequestId, StoreConfig, Tier, TierStore};

#[path = "../tests/support/mod.rs"]
mod support;

const LAYERS: u32 = 4;
const HEADS: u32 = 8;
const DIM: u32 = 128;
const ELEM: u32 = 2;
/// Tokens per 2 MiB page at 2 KiB per token.
const TPB: u32 = 1024;
const REQUESTS: u32 = 16;
/// Blocks per request (each `2 × LAYERS` pages).
const BLOCKS: u32 = 4;
const HOST_BYTES: u64 = 1 << 30;

#[repr(C)]
struct Config {
    device: i32,
    durability: i32,
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    elem_size: u32,
    max_requests: u32,
    max_tokens: u32,
    zero_page: i32,
    reserved: i32,
    host_bytes: u64,
    disk_bytes: u64,
    disk_dir: *const i8,
    step_time_ns: u64,
    spare: [u64; 4],
}

type Create = unsafe extern "C" fn(*const Config, *mut u64) -> i32;
type Destroy = unsafe extern "C" fn(u64) -> i32;
type Admit = unsafe extern "C" fn(u64, *mut u64) -> i32;
type Append = unsafe extern "C" fn(u64, u64, u32) -> i32;
type Release = unsafe extern "C" fn(u64, u64) -> i32;
type Spill = unsafe extern "C" fn(u64, u64, i32) -> i32;
type MakeResident = unsafe extern "C" fn(u64, *const u64, usize, *mut c_void) -> i32;

struct Abi {
    create: Create,
    destroy: Destroy,
    admit: Admit,
    append: Append,
    release: Release,
    spill: Spill,
    make_resident: MakeResident,
    _lib: libloading::Library,
}

fn abi() -> Abi {
    let path = support::library();
    // SAFETY: loading our own library runs no initializers with preconditions.
    let lib = unsafe { libloading::Library::new(&path) }.expect("dlopen libstrata.so");
    // SAFETY: the symbols have these exact signatures (include/strata.h).
    unsafe {
        Abi {
            create: *lib.get(b"strata_kv_create\0").expect("create"),
            destroy: *lib.get(b"strata_kv_destroy\0").expect("destroy"),
            admit: *lib.get(b"strata_kv_admit\0").expect("admit"),
            append: *lib.get(b"strata_kv_append\0").expect("append"),
            release: *lib.get(b"strata_kv_release\0").expect("release"),
            spill: *lib.get(b"strata_kv_spill\0").expect("spill"),
            make_resident: *lib
                .get(b"strata_kv_make_resident\0")
                .expect("make_resident"),
            _lib: lib,
        }
    }
}

/// The operations both sides implement.
trait Kv {
    fn admit(&mut self) -> u64;
    fn append(&mut self, r: u64, tokens: u32);
    fn release(&mut self, r: u64);
    fn spill(&mut self, r: u64);
    /// Restores and waits for the copies.
    fn restore(&mut self, r: u64);
}

struct CSpace<'a> {
    abi: &'a Abi,
    kv: u64,
}

impl<'a> CSpace<'a> {
    fn new(abi: &'a Abi) -> Self {
        let c = Config {
            device: 0,
            durability: 1,
            layers: LAYERS,
            kv_heads: HEADS,
            head_dim: DIM,
            elem_size: ELEM,
            max_requests: REQUESTS,
            max_tokens: BLOCKS * TPB,
            zero_page: 1,
            reserved: 0,
            host_bytes: HOST_BYTES,
            disk_bytes: 0,
            disk_dir: std::ptr::null(),
            step_time_ns: 0,
            spare: [0; 4],
        };
        let mut kv = 0;
        // SAFETY: valid config and out pointer.
        assert_eq!(unsafe { (abi.create)(&c, &mut kv) }, 0, "strata_kv_create");
        CSpace { abi, kv }
    }
}

impl Drop for CSpace<'_> {
    fn drop(&mut self) {
        // SAFETY: a live handle.
        unsafe { (self.abi.destroy)(self.kv) };
    }
}

impl Kv for CSpace<'_> {
    fn admit(&mut self) -> u64 {
        let mut r = 0;
        // SAFETY: valid handle and out pointer.
        assert_eq!(unsafe { (self.abi.admit)(self.kv, &mut r) }, 0);
        r
    }
    fn append(&mut self, r: u64, tokens: u32) {
        // SAFETY: plain values.
        assert_eq!(unsafe { (self.abi.append)(self.kv, r, tokens) }, 0);
    }
    fn release(&mut self, r: u64) {
        // SAFETY: plain values.
        assert_eq!(unsafe { (self.abi.release)(self.kv, r) }, 0);
    }
    fn spill(&mut self, r: u64) {
        // SAFETY: plain values.
        assert_eq!(unsafe { (self.abi.spill)(self.kv, r, 1) }, 0);
    }
    fn restore(&mut self, r: u64) {
        // SAFETY: one readable handle; NULL is the default stream (waited for on return).
        let rc = unsafe { (self.abi.make_resident)(self.kv, &r, 1, std::ptr::null_mut()) };
        assert_eq!(rc, 0);
    }
}

struct RustSpace(KvBlockManager);

impl RustSpace {
    fn new() -> Self {
        let backend = strata_vmm::global().expect("backend");
        let pool = PagePool::new(backend, 0, PoolConfig::default()).expect("pool");
        let block = pool.page_size().min(256 << 10);
        let store =
            Arc::new(TierStore::new(pool, StoreConfig::new(block, 0, HOST_BYTES)).expect("store"));
        let m = KvBlockManager::new(
            store,
            KvBlocksConfig {
                layers: LAYERS,
                max_requests: REQUESTS,
                max_tokens: BLOCKS * TPB,
                bytes_per_token: u64::from(HEADS * DIM * ELEM),
                t_iter: Duration::from_millis(20),
                delta_sched: Duration::from_micros(100),
                links: Links {
                    host_to_hbm: (Duration::from_micros(5), 50e9),
                    disk_to_host: (Duration::from_micros(80), 7e9),
                },
                zero_page: true,
            },
        )
        .expect("manager");
        RustSpace(m)
    }
}

impl Kv for RustSpace {
    fn admit(&mut self) -> u64 {
        self.0.admit().expect("admit").0
    }
    fn append(&mut self, r: u64, tokens: u32) {
        self.0.append(RequestId(r), tokens).expect("append");
    }
    fn release(&mut self, r: u64) {
        self.0.release(RequestId(r)).expect("release");
    }
    fn spill(&mut self, r: u64) {
        self.0.pause(RequestId(r), Tier::Host).expect("spill");
    }
    fn restore(&mut self, r: u64) {
        let ev = self.0.make_resident(&[RequestId(r)]).expect("restore");
        ev.synchronize().expect("wait");
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn timed(samples: &mut Vec<Duration>, f: impl FnOnce()) {
    let t = Instant::now();
    f();
    samples.push(t.elapsed());
}

/// Per-call medians: (append fresh, append recycled, spill, restore).
fn run(space: &mut dyn Kv, rounds: usize) -> [Duration; 4] {
    let (mut fresh, mut recycled, mut spill, mut restore) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        let reqs: Vec<u64> = (0..REQUESTS).map(|_| space.admit()).collect();
        for &r in &reqs {
            for _ in 0..BLOCKS {
                let samples = if round == 0 {
                    &mut fresh
                } else {
                    &mut recycled
                };
                timed(samples, || space.append(black_box(r), TPB));
            }
        }
        for &r in reqs.iter().take(4) {
            timed(&mut spill, || space.spill(r));
            timed(&mut restore, || space.restore(r));
        }
        for r in reqs {
            space.release(r);
        }
    }
    [
        median(fresh),
        median(recycled),
        median(spill),
        median(restore),
    ]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 3 } else { 8 };
    let abi = abi();
    let backend = strata_vmm::global().expect("backend");
    let page = backend
        .granularity(strata_vmm::Location::Device(0))
        .expect("granularity");
    assert_eq!(
        page,
        u64::from(TPB * HEADS * DIM * ELEM),
        "needs 2 MiB pages"
    );
    // Alternate sides so that drift on a shared machine hits both alike.
    let (mut c_runs, mut rust_runs) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        c_runs.push(run(&mut CSpace::new(&abi), rounds));
        rust_runs.push(run(&mut RustSpace::new(), rounds));
    }
    let pick = |runs: &[[Duration; 4]], i: usize| median(runs.iter().map(|r| r[i]).collect());
    let request_bytes = u64::from(BLOCKS) * 2 * u64::from(LAYERS) * page;
    println!(
        "kv_abi on the {} backend: {LAYERS} layers, {BLOCKS} blocks of {} MiB per request",
        backend.kind(),
        (2 * u64::from(LAYERS) * page) >> 20
    );
    println!("| call | C ABI | Rust (same run) | C / Rust |");
    println!("|---|---|---|---|");
    for (i, name) in [
        "append 1 block (fresh pages: 2 × layers mapped)",
        "append 1 block (recycled slot)",
        "spill a request to host",
        "restore a request (make_resident, waited)",
    ]
    .into_iter()
    .enumerate()
    {
        let (c, r) = (pick(&c_runs, i), pick(&rust_runs, i));
        println!(
            "| {name} | {c:.2?} | {r:.2?} | {:.3} |",
            c.as_secs_f64() / r.as_secs_f64()
        );
    }
    let gbps = |d: Duration| request_bytes as f64 / d.as_secs_f64() / 1e9;
    println!(
        "restore throughput: C ABI {:.2} GB/s, Rust {:.2} GB/s ({} MiB per request)",
        gbps(pick(&c_runs, 3)),
        gbps(pick(&rust_runs, 3)),
        request_bytes >> 20
    );
}
