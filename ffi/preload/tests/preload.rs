//! libstrata_preload.so against a fake CUDA driver and runtime, no GPU needed.
//!
//! Builds `tests/fake/` with the system C compiler (`cc`): a fake `libcuda.so.1` whose
//! allocations come from a static arena with counters, a fake `libcudart.so` that reaches the
//! driver through `dlopen` + `cuGetProcAddress` like the real one, and `routes`, a C program
//! that allocates by every route an engine uses. Each route runs in its own process under
//! `LD_PRELOAD` with the host backend in strict mode (strata memory is never CPU-accessible,
//! and the C side never dereferences it), and again without the shim / with
//! `STRATA_PRELOAD_DISABLE=1`, where the same checks must see the fake driver serve.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod common;

use common::{cc, shim};

const DEVICE_BYTES: u64 = 1 << 30;

fn fake_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake")
}

/// Builds the fakes once per test binary; returns their directory.
fn build() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("strata-preload-fake");
        std::fs::create_dir_all(&dir).expect("create the fake's directory");
        let src = fake_dir();
        let s = |name: &str| src.join(name).to_string_lossy().into_owned();
        let o = |name: &str| dir.join(name).to_string_lossy().into_owned();
        // -Bsymbolic: the fake's own function addresses (its proc-address table) bind inside
        // it, as in the real driver, never to the shim's same-named exports.
        cc(&[
            "-shared",
            "-fPIC",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            &o("libcuda.so.1"),
            &s("cuda.c"),
            "-lpthread",
        ]);
        let link = dir.join("libcuda.so");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libcuda.so.1", &link).expect("symlink libcuda.so");
        cc(&[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcudart.so",
            "-o",
            &o("libcudart.so"),
            &s("cudart.c"),
            "-ldl",
            "-lpthread",
        ]);
        let dash_l = format!("-L{}", dir.display());
        cc(&[
            "-o",
            &o("routes"),
            &s("routes.c"),
            &dash_l,
            "-lcuda",
            "-lcudart",
            "-ldl",
            "-lpthread",
        ]);
        dir
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// LD_PRELOAD=libstrata_preload.so: strata serves.
    Preloaded,
    /// Preloaded with STRATA_PRELOAD_DISABLE=1: the fake driver serves.
    Disabled,
    /// No shim at all: the fake driver serves.
    Bare,
}

fn run(route: &str, mode: Mode, extra: &[(&str, &str)]) -> (bool, String) {
    let dir = build();
    let mut cmd = Command::new(dir.join("routes"));
    cmd.arg(route)
        .env("LD_LIBRARY_PATH", dir)
        .env("STRATA_BACKEND", "host")
        .env("STRATA_HOST_STRICT", "1")
        .env("STRATA_HOST_DEVICES", "1x1GiB")
        .env("STRATA_HOST_GRANULARITY", "2MiB")
        .env_remove("STRATA_PRELOAD_DISABLE")
        .env_remove("STRATA_PRELOAD_LIMIT")
        .env_remove("STRATA_PRELOAD_LOG")
        .env_remove("LD_PRELOAD");
    match mode {
        Mode::Preloaded => {
            // cuMemGetInfo's total is the strata device's, not the fake driver's arena.
            cmd.env("LD_PRELOAD", shim())
                .env("EXPECT_TOTAL", DEVICE_BYTES.to_string());
        }
        Mode::Disabled => {
            cmd.env("LD_PRELOAD", shim())
                .env("STRATA_PRELOAD_DISABLE", "1")
                .env("EXPECT", "fake");
        }
        Mode::Bare => {
            cmd.env("EXPECT", "fake");
        }
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run routes");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn served_by_strata(route: &str) {
    let (ok, out) = run(route, Mode::Preloaded, &[]);
    assert!(ok, "{route} under LD_PRELOAD:\n{out}");
    let (ok, out) = run(route, Mode::Disabled, &[]);
    assert!(ok, "{route} with STRATA_PRELOAD_DISABLE=1:\n{out}");
    let (ok, out) = run(route, Mode::Bare, &[]);
    assert!(ok, "{route} without the shim:\n{out}");
}

#[test]
fn direct_calls_are_served_by_strata() {
    served_by_strata("direct");
}

#[test]
fn dlsym_on_libcuda_and_pseudo_handles_is_served_by_strata() {
    served_by_strata("dlsym");
}

#[test]
fn cu_get_proc_address_v1_and_v2_forms_are_served_by_strata() {
    served_by_strata("proc");
}

#[test]
fn cu_get_proc_address_of_itself_is_hooked() {
    served_by_strata("proc_self");
}

#[test]
fn stream_ordered_and_ptsz_variants_are_served_by_strata() {
    served_by_strata("async");
}

#[test]
fn runtime_cuda_malloc_is_served_by_strata() {
    served_by_strata("runtime");
}

#[test]
fn foreign_pointers_go_to_the_real_free() {
    served_by_strata("foreign");
}

#[test]
fn lookups_pass_through_and_initialize_nothing() {
    served_by_strata("lookups");
}

#[test]
fn mem_get_info_is_consistent() {
    served_by_strata("meminfo");
}

#[test]
fn threads_allocate_and_free_concurrently() {
    served_by_strata("threads");
}

#[test]
fn a_forked_child_passes_through_to_the_driver() {
    served_by_strata("fork");
}

#[test]
fn limit_caps_what_strata_serves() {
    let limit = 32u64 << 20;
    let bytes = limit.to_string();
    let env = [
        ("STRATA_PRELOAD_LIMIT", "32MiB"),
        ("STRATA_PRELOAD_LIMIT_BYTES", bytes.as_str()),
    ];
    let (ok, out) = run("limit", Mode::Preloaded, &env);
    assert!(ok, "limit under LD_PRELOAD:\n{out}");
}

#[test]
fn mem_get_info_reports_what_a_large_allocation_gets() {
    let limit = 64u64 << 20;
    let bytes = limit.to_string();
    let env = [
        ("STRATA_PRELOAD_LIMIT", "64MiB"),
        ("STRATA_PRELOAD_LIMIT_BYTES", bytes.as_str()),
    ];
    let (ok, out) = run("meminfo_small", Mode::Preloaded, &env);
    assert!(ok, "meminfo_small under LD_PRELOAD:\n{out}");
}

/// The checks can fail: the shim serving where the fake driver should is caught, and so is
/// the fake driver serving where strata should.
#[test]
fn the_checks_tell_the_two_owners_apart() {
    let (ok, out) = run("direct", Mode::Preloaded, &[("EXPECT", "fake")]);
    assert!(
        !ok && out.contains("should come from the fake driver"),
        "{out}"
    );
    let (ok, out) = run(
        "direct",
        Mode::Preloaded,
        &[("STRATA_PRELOAD_DISABLE", "1")],
    );
    assert!(!ok && out.contains("should come from strata"), "{out}");
}

#[test]
fn log_names_each_hook() {
    let (ok, out) = run("proc_self", Mode::Preloaded, &[("STRATA_PRELOAD_LOG", "1")]);
    assert!(ok, "{out}");
    assert!(
        out.contains(
            "cuGetProcAddress(cuGetProcAddress, 12000, 0) -> wrapper of cuGetProcAddress_v2"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "cuGetProcAddress(cuGetProcAddress, 11030, 0) -> wrapper of cuGetProcAddress\n"
        ),
        "{out}"
    );
    assert!(out.contains("(strata)"), "{out}");
}

/// The shim's own dependencies resolve: it needs only the C library (and Rust's unwinder).
#[test]
fn shim_links_only_libc() {
    let out = Command::new("readelf")
        .args(["-d"])
        .arg(shim())
        .output()
        .expect("readelf (binutils)");
    let text = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1)?.split(']').next())
        .collect();
    assert!(!needed.is_empty(), "{text}");
    let allowed = |n: &str| {
        [
            "libc.so",
            "libdl.so",
            "libpthread.so",
            "libgcc_s.so",
            "ld-linux",
            "libm.so",
            "librt.so",
        ]
        .iter()
        .any(|a| n.starts_with(a))
    };
    assert!(
        needed.iter().all(|n| allowed(n)),
        "unexpected NEEDED: {needed:?}"
    );
    let ldd = Command::new("ldd").arg(shim()).output().expect("ldd");
    let ldd = String::from_utf8_lossy(&ldd.stdout);
    assert!(!ldd.contains("not found"), "{ldd}");
}

/// The shim publishes its figures for `strata ps` (`<pid>.preload.json`) and applies `strata
/// limit`: the next allocation beyond the cap fails, one under it succeeds.
#[test]
fn strata_ps_sees_the_shim_and_strata_limit_caps_it() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    use strata_ops::{read_all, request_limit, Folder, LimitValue};

    let dir = build();
    let shm = std::env::temp_dir().join(format!("strata-preload-shm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&shm);
    let mut child = Command::new(dir.join("routes"))
        .arg("hold")
        .env("LD_LIBRARY_PATH", dir)
        .env("LD_PRELOAD", shim())
        .env("STRATA_BACKEND", "host")
        .env("STRATA_HOST_DEVICES", "1x1GiB")
        .env("STRATA_HOST_GRANULARITY", "2MiB")
        .env("STRATA_SHM_DIR", &shm)
        .env_remove("STRATA_PRELOAD_LIMIT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run routes hold");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut answer = |stdin: &mut std::process::ChildStdin, ask: &str| {
        line.clear();
        if !ask.is_empty() {
            writeln!(stdin, "{ask}").unwrap();
        }
        stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    };
    assert_eq!(answer(&mut stdin, ""), "held");
    let folder = Folder::at(&shm);
    let pid = child.id();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let figures = loop {
        let listing = read_all(&folder).unwrap();
        if let Some(p) = listing.processes.iter().find(|p| p.pid == pid) {
            if p.devices.first().is_some_and(|d| d.allocated_bytes > 0) {
                break p.clone();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no figures from the shim: {listing:?}, {:?}",
            folder.names()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(figures.library, "preload");
    let d = &figures.devices[0];
    assert_eq!(d.allocated_bytes, 6 << 20);
    assert_eq!(d.reserved_bytes, 6 << 20);
    assert_eq!(d.total_bytes, DEVICE_BYTES);
    let cap = 10 << 20;
    let applied = request_limit(&folder, pid, Some(0), LimitValue::Bytes(cap)).unwrap();
    assert_eq!(applied, vec![("preload".to_string(), 0, Some(cap))]);
    assert_eq!(
        answer(&mut stdin, "alloc 6291456"),
        "fail",
        "beyond the cap"
    );
    assert_eq!(answer(&mut stdin, "alloc 4194304"), "ok", "under the cap");
    drop(stdin);
    assert!(child.wait().unwrap().success());
    std::fs::remove_dir_all(&shm).unwrap();
}
