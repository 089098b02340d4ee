//! Replays the committed allocation traces (`benches/traces/`) through the C ABI, as PyTorch's
//! `CUDAPluggableAllocator` would call it: `strata_malloc` / `strata_free` from `libstrata.so`
//! (dlopen + dlsym), then `strata_stats` for the peaks. One process holds one runtime, so each
//! trace runs in a child process of this bench (a fresh allocator each).
//!
//! Run: `cargo bench -p strata-ffi --bench replay_c_abi` (options: `-- FILE...`, `--ops N`).

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::ptr::null_mut;
use std::time::Instant;

use strata_replay::{BenchArgs, Op, Trace};

#[path = "../tests/support/mod.rs"]
mod support;

type Malloc = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type Free = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type Stats = unsafe extern "C" fn(c_int, *mut StatsOut) -> c_int;

/// `strata_stats_t` of include/strata.h.
#[repr(C)]
#[derive(Default)]
struct StatsOut {
    device: i32,
    initialized: i32,
    total_bytes: u64,
    page_size: u64,
    allocated_bytes: u64,
    allocated_block_bytes: u64,
    reserved_bytes: u64,
    mapped_pages: u64,
    cached_large_bytes: u64,
    pool_free_bytes: u64,
    peak_allocated_bytes: u64,
    peak_reserved_bytes: u64,
    rest: [u64; 18],
}

const CHILD: &str = "STRATA_REPLAY_CHILD";

fn main() {
    let args = BenchArgs::parse(std::env::args().skip(1)).unwrap_or_else(|e| panic!("{e}"));
    if let Some(file) = std::env::var_os(CHILD) {
        return child(PathBuf::from(file), &args);
    }
    let files = args.files_or_standard(&support::repo());
    support::library();
    println!("| trace | ops | peak allocated | peak reserved | reserved ÷ allocated | ns per op |");
    println!("|---|---|---|---|---|---|");
    for file in files {
        let exe = std::env::current_exe().expect("current exe");
        let status = std::process::Command::new(exe)
            .args(std::env::args().skip(1))
            .env(CHILD, &file)
            .status()
            .expect("run the replay child");
        assert!(status.success(), "replay of {} failed", file.display());
    }
}

fn child(file: PathBuf, args: &BenchArgs) {
    let trace = args
        .cut(Trace::load(&file, None).unwrap_or_else(|e| panic!("trace {}: {e}", file.display())));
    let path = support::library();
    // SAFETY: loading our own library runs no initializers with preconditions.
    let lib = unsafe { libloading::Library::new(&path) }
        .unwrap_or_else(|e| panic!("dlopen {}: {e}", path.display()));
    // SAFETY: the symbols have these exact signatures (include/strata.h).
    let (malloc, free, stats) = unsafe {
        (
            *lib.get::<Malloc>(b"strata_malloc\0")
                .expect("strata_malloc"),
            *lib.get::<Free>(b"strata_free\0").expect("strata_free"),
            *lib.get::<Stats>(b"strata_stats\0").expect("strata_stats"),
        )
    };
    let mut live: std::collections::HashMap<u64, (*mut c_void, usize)> = Default::default();
    let start = Instant::now();
    for op in &trace.ops {
        match *op {
            Op::Alloc { id, bytes, .. } => {
                let size = usize::try_from(bytes).expect("size");
                // SAFETY: valid arguments; NULL (out of memory) is checked.
                let p = unsafe { malloc(size, 0, null_mut()) };
                if !p.is_null() {
                    live.insert(id, (p, size));
                }
            }
            Op::Free { id } => {
                if let Some((p, size)) = live.remove(&id) {
                    // SAFETY: a pointer strata_malloc returned, freed once, with its size.
                    unsafe { free(p, size, 0, null_mut()) };
                }
            }
        }
    }
    let elapsed = start.elapsed();
    let mut out = StatsOut::default();
    // SAFETY: `out` is valid for writing one strata_stats_t.
    let rc = unsafe { stats(0, &mut out) };
    assert_eq!(rc, 0, "strata_stats");
    for (_, (p, size)) in live.drain() {
        // SAFETY: as above.
        unsafe { free(p, size, 0, null_mut()) };
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "| {} | {} | {:.1} MiB | {:.1} MiB | {:.3} | {:.0} |",
        file.file_name().unwrap_or_default().to_string_lossy(),
        trace.ops.len(),
        mib(out.peak_allocated_bytes),
        mib(out.peak_reserved_bytes),
        out.peak_reserved_bytes as f64 / out.peak_allocated_bytes.max(1) as f64,
        elapsed.as_nanos() as f64 / trace.ops.len().max(1) as f64,
    );
}
