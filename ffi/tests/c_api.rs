//! Compiles the C tests in `ffi/tests/c/` against `include/strata.h`, links them with the
//! `libstrata.so` cargo just built (`target/<profile>/`), and runs them on the host backend with
//! two small emulated devices in strict mode (device memory is not CPU-accessible, so the tests
//! would fault if anything dereferenced it), or with `STRATA_BACKEND=cuda` on the CUDA devices
//! the machine has. Each must exit 0. Where the compiler supports AddressSanitizer, the same
//! programs run again under ASan + UBSan.
//!
//! Each program runs under its own timeout (`STRATA_C_TEST_TIMEOUT` seconds, default 120), and
//! a failure is written to stderr at once, outside the test harness's capture: a hang fails only
//! its own test, and a run killed later still shows every failure before it.
//!
//! The C compiler is `$CC` or `cc`; without one the tests print why and pass (CI has gcc).

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use strata_test_support::skip;
use support::{library, profile_dir, repo};
use wait_timeout::ChildExt;

/// Whether the programs run on the CUDA backend (`STRATA_BACKEND=cuda`), else the host backend.
fn on_cuda() -> bool {
    std::env::var("STRATA_BACKEND").as_deref() == Ok("cuda")
}

/// The number of devices the programs see: the host backend's two (`STRATA_HOST_DEVICES` in
/// [`run`]), or the CUDA driver's. Passed to them as `STRATA_TEST_DEVICES`.
fn devices() -> u32 {
    static N: OnceLock<u32> = OnceLock::new();
    *N.get_or_init(|| {
        if on_cuda() {
            strata_vmm::cuda::open().map_or(0, |b| b.device_count())
        } else {
            2
        }
    })
}

/// How long one C program may run: `STRATA_C_TEST_TIMEOUT` seconds, 120 by default.
fn time_limit() -> Duration {
    let secs = std::env::var("STRATA_C_TEST_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    Duration::from_secs(secs)
}

/// Fails the running test with `message`, written to stderr first (uncaptured, so it is seen
/// even if the test executable is killed before its summary).
fn fail(message: &str) -> ! {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "\n==== C test failed: {message}");
    let _ = err.flush();
    panic!("{message}");
}

fn compiler() -> Option<String> {
    static CC: OnceLock<Option<String>> = OnceLock::new();
    CC.get_or_init(|| {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        match Command::new(&cc).arg("--version").output() {
            Ok(out) if out.status.success() => Some(cc),
            _ => None,
        }
    })
    .clone()
}

/// Whether `cc` can build and run an ASan + UBSan program here.
fn asan_works(cc: &str, out_dir: &Path) -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let src = out_dir.join("asan_probe.c");
        let exe = out_dir.join("asan_probe");
        std::fs::write(&src, "int main(void) { return 0; }\n").expect("write probe");
        let built = Command::new(cc)
            .args(["-fsanitize=address,undefined", "-o"])
            .arg(&exe)
            .arg(&src)
            .status()
            .is_ok_and(|s| s.success());
        built && Command::new(&exe).status().is_ok_and(|s| s.success())
    })
}

/// Compiles `name.c` (with `-fsanitize` when `asan`) and returns the executable.
fn build(cc: &str, name: &str, asan: bool, defines: &[&str]) -> PathBuf {
    build_as(cc, name, name, asan, defines)
}

/// [`build`] into the executable `exe` (`exe-asan` with ASan): tests that run one source with
/// other settings at the same time need executables of their own, or one test's compiler
/// rewrites the file the other is starting.
fn build_as(cc: &str, name: &str, exe: &str, asan: bool, defines: &[&str]) -> PathBuf {
    let out_dir = profile_dir().join("strata-c-tests");
    std::fs::create_dir_all(&out_dir).expect("create output folder");
    let exe = out_dir.join(if asan {
        format!("{exe}-asan")
    } else {
        exe.to_string()
    });
    let lib = library();
    let lib_dir = lib.parent().expect("library folder");
    let mut cmd = Command::new(cc);
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-I")
        .arg(repo().join("include"))
        .arg(repo().join(format!("ffi/tests/c/{name}.c")))
        .arg("-o")
        .arg(&exe);
    if asan {
        cmd.args(["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]);
    }
    if name == "dlopen" {
        cmd.arg("-ldl");
    } else {
        cmd.arg("-L")
            .arg(lib_dir)
            .arg("-lstrata")
            .arg(format!("-Wl,-rpath,{}", lib_dir.display()));
    }
    cmd.args(["-lpthread", "-lm"]);
    let out = cmd.output().expect("run the C compiler");
    assert!(
        out.status.success(),
        "compiling {name}.c failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn run(exe: &Path, name: &str, env: &[(&str, &str)], args: &[&str]) {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    if name == "dlopen" {
        cmd.arg(library());
    }
    // The host backend unless a GPU run asks for CUDA explicitly.
    if !on_cuda() {
        cmd.env("STRATA_BACKEND", "host");
    }
    cmd.env("STRATA_TEST_DEVICES", devices().to_string())
        .env("STRATA_HOST_DEVICES", "2x512MiB")
        .env("STRATA_HOST_STRICT", "1")
        .env_remove("STRATA_HOST_LINK")
        // protect_shadow_gap=0: the CUDA driver maps memory inside ASan's shadow gap.
        .env(
            "ASAN_OPTIONS",
            // allocator_may_return_null=1: a failed malloc is an outcome some tests provoke.
            "detect_leaks=0:abort_on_error=0:protect_shadow_gap=0:allocator_may_return_null=1",
        )
        .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
        .envs(env.iter().copied());
    // Output into files (a pipe nobody reads while waiting could fill and stall the program).
    let outputs = |ext: &str| exe.with_extension(ext);
    let file = |ext: &str| std::fs::File::create(outputs(ext)).expect("create an output file");
    cmd.stdout(Stdio::from(file("stdout")))
        .stderr(Stdio::from(file("stderr")));
    let limit = time_limit();
    let started = Instant::now();
    let mut child = cmd.spawn().expect("run the C test");
    let status = child.wait_timeout(limit).expect("wait for the C test");
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let read = |ext: &str| std::fs::read_to_string(outputs(ext)).unwrap_or_default();
    let (stdout, stderr) = (read("stdout"), read("stderr"));
    match status {
        None => fail(&format!(
            "{} did not finish within {limit:?} (STRATA_C_TEST_TIMEOUT), killed:\n{stdout}\n{stderr}",
            exe.display()
        )),
        Some(s) if !s.success() => fail(&format!(
            "{} failed ({s}) after {:.1?}:\n{stdout}\n{stderr}",
            exe.display(),
            started.elapsed()
        )),
        Some(_) if !stdout.contains(&format!("{name}: ok")) => fail(&format!(
            "{} exited 0 without \"{name}: ok\":\n{stdout}\n{stderr}",
            exe.display()
        )),
        Some(_) => print!("{stdout}"),
    }
}

fn c_test(name: &str) {
    c_test_with(name, &[]);
}

/// [`c_test`] with extra environment variables for the program.
fn c_test_with(name: &str, env: &[(&str, &str)]) {
    c_program(name, env, &[], &[]);
}

/// Builds `name.c` with `defines`, runs it with `env` and `args`, plainly and under ASan.
fn c_program(name: &str, env: &[(&str, &str)], defines: &[&str], args: &[&str]) {
    c_program_as(name, name, env, defines, args);
}

/// `name.c` run with `env` as a variant of its own, built into the executable `exe`.
fn c_variant(name: &str, exe: &str, env: &[(&str, &str)]) {
    c_program_as(name, exe, env, &[], &[]);
}

fn c_program_as(name: &str, exe: &str, env: &[(&str, &str)], defines: &[&str], args: &[&str]) {
    library();
    let Some(cc) = compiler() else {
        eprintln!("skipping C test {name}: no C compiler ($CC or cc)");
        return;
    };
    run(&build_as(&cc, name, exe, false, defines), name, env, args);
    let out_dir = profile_dir().join("strata-c-tests");
    std::fs::create_dir_all(&out_dir).expect("create output folder");
    if asan_works(&cc, &out_dir) {
        run(&build_as(&cc, name, exe, true, defines), name, env, args);
    } else {
        eprintln!("C test {name}: AddressSanitizer not available, plain run only");
    }
}

#[test]
fn c_api_whole_surface() {
    c_test("api");
}

#[test]
fn c_harvest_alloc_revoke_and_callbacks() {
    if devices() < 2 {
        skip(
            "c_harvest_alloc_revoke_and_callbacks",
            "lending needs a second device (a peer); this machine has one",
        );
        return;
    }
    c_test("harvest");
}

#[test]
fn c_malloc_and_harvest_share_one_pool() {
    c_test("shared_pool");
}

#[test]
fn c_random_walk_with_patterns_and_tags() {
    c_test("walk");
}

#[test]
fn c_threads() {
    c_test("threads");
}

#[test]
fn c_offload_onload() {
    c_test("offload");
}

#[test]
fn c_sleep_wake() {
    c_test("sleep_wake");
}

#[test]
fn c_sleep_without_host_memory_is_out_of_memory() {
    c_test("sleep_host_oom");
}

#[test]
fn c_forked_child_is_refused() {
    c_test("fork");
}

#[test]
fn c_sleep_is_all_or_nothing_and_holds_before_first_use() {
    c_test("sleep_contract");
}

#[test]
fn c_small_host_granularities_allocate() {
    for granularity in ["4KiB", "16KiB", "32KiB"] {
        c_test_with("small_pages", &[("STRATA_HOST_GRANULARITY", granularity)]);
    }
}

#[test]
fn c_empty_cache_sticks_and_the_cap_covers_the_pool() {
    c_test("limits");
}

#[test]
fn c_statuses_and_messages_name_the_mistake() {
    c_test("messages");
}

#[test]
fn c_tag_names_no_longer_in_use_are_released() {
    c_test("tag_names");
}

#[test]
fn c_tags_set_to_overflow_are_kept() {
    c_test("tag_overflow");
}

#[test]
fn c_sleep_to_disk() {
    c_test("sleep_disk");
}

#[test]
fn c_params_remap_and_revert() {
    c_test("params");
}

#[test]
fn c_pie_layer_swapping() {
    c_test("pie");
}

#[test]
fn c_kv_spaces() {
    c_test("kv");
}

#[test]
fn c_kv_token_copies() {
    c_test_with("kv_copy", &[("STRATA_HOST_LINK", "1GB,20ms")]);
}

#[test]
fn c_kv_threads_with_a_revoker() {
    c_test("kv_threads");
}

#[test]
fn c_kv_random_walk() {
    c_test("kv_walk");
}

/// The revoker storm with every KV space's background mapper on (`STRATA_KV_MAP_AHEAD`, spaces
/// without a zero page): appends publish pages mapped ahead while the revoker, spills and
/// releases race with the mapper.
#[test]
fn c_kv_threads_with_a_revoker_and_the_mapper_on() {
    c_variant(
        "kv_threads",
        "kv_threads-mapper",
        &[("STRATA_KV_MAP_AHEAD", "64")],
    );
}

/// The C random walk with the mapper on (its spaces without a zero page).
#[test]
fn c_kv_random_walk_with_the_mapper_on() {
    c_variant(
        "kv_walk",
        "kv_walk-mapper",
        &[("STRATA_KV_MAP_AHEAD", "32")],
    );
}

#[test]
fn c_kv_at_the_limits_of_their_types() {
    c_test("kv_limits");
}

#[test]
fn c_dlopen_like_pytorch() {
    c_test("dlopen");
}

/// The fuzz target `fuzz.c` (libFuzzer's entry point over a byte-coded call sequence with a
/// model), over the committed corpus `ffi/tests/fuzz/corpus/` and its mutations ([`c_fuzz`]).
#[test]
fn c_fuzz_call_sequences() {
    c_fuzz("fuzz", "ffi/tests/fuzz/corpus");
}

/// The KV fuzz target `kv_fuzz.c` (random shapes, sizes at the type limits, random, stale and
/// foreign handles, against a model), over the corpus `ffi/tests/fuzz/kv-corpus/` ([`c_fuzz`]).
#[test]
fn c_kv_fuzz_call_sequences() {
    c_fuzz("kv_fuzz", "ffi/tests/fuzz/kv-corpus");
}

/// Drives the fuzz target `name.c` without libFuzzer, plain and under ASan: the corpus folder
/// `corpus` (from the repository root), then mutations for `STRATA_FUZZ_SECONDS` (default 20)
/// per build from `STRATA_FUZZ_SEED` (default: the clock; printed). A failing input is saved as
/// `NAME-failure.bin` in the test's output folder.
fn c_fuzz(name: &str, corpus: &str) {
    let seconds = std::env::var("STRATA_FUZZ_SECONDS").unwrap_or_else(|_| "20".into());
    let seed = std::env::var("STRATA_FUZZ_SEED").unwrap_or_else(|_| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(1, |d| d.as_secs()).to_string()
    });
    let corpus = repo().join(corpus);
    let artifacts = profile_dir().join("strata-c-tests");
    c_program(
        name,
        &[("STRATA_FUZZ_ARTIFACTS", &artifacts.to_string_lossy())],
        &["STRATA_FUZZ_DRIVER"],
        &[&corpus.to_string_lossy(), &seconds, &seed],
    );
}

/// A bounded soak (`soak.c`): threads running every kind of call at once, contents checked,
/// accounting back to zero; `STRATA_SOAK_SECONDS` (default 15) per build, plain and under ASan.
#[test]
fn c_soak_threads_all_calls() {
    c_test("soak");
}

/// The header and the library agree: every function `include/strata.h` declares is exported,
/// and the library exports nothing else under the `strata_` prefix (nor any other public
/// symbol of its own). Uses `nm -D`; skips, saying why, without it.
#[test]
fn header_and_exports_match() {
    let lib = library();
    let Ok(out) = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
    else {
        eprintln!("skipping the export check: nm not found");
        return;
    };
    assert!(out.status.success(), "nm failed");
    let mut exported: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .filter(|name| name.starts_with("strata_"))
        .collect();
    exported.sort();
    let header = std::fs::read_to_string(repo().join("include/strata.h")).expect("header");
    let mut declared: Vec<String> = header
        .lines()
        .filter(|l| !l.trim_start().starts_with('*') && !l.trim_start().starts_with("/*"))
        .filter_map(|l| {
            let open = l.find("strata_")?;
            let rest = &l[open..];
            let end = rest.find('(')?;
            let name = &rest[..end];
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
                .then(|| name.to_string())
        })
        .collect();
    declared.sort();
    declared.dedup();
    assert!(
        declared.len() >= 20,
        "parsed too few prototypes: {declared:?}"
    );
    assert_eq!(
        declared, exported,
        "include/strata.h vs libstrata.so exports"
    );
}

/// A backend that cannot open keeps its typed status through the C ABI: a malformed `STRATA_*`
/// variable is `STRATA_CONFIG` and CUDA asked for without a driver `STRATA_NO_DEVICE`, never a
/// blanket `STRATA_UNSUPPORTED`. Each case is a fresh process with its own environment (the
/// library opens its backend once per process).
#[test]
fn c_backend_errors_keep_their_status() {
    library();
    let Some(cc) = compiler() else {
        eprintln!("skipping C test backend_errors: no C compiler ($CC or cc)");
        return;
    };
    let exe = build(&cc, "backend_errors", false, &[]);
    let host = ("STRATA_BACKEND", "host");
    let mut cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (vec![("STRATA_BACKEND", "gpu")], "STRATA_CONFIG"),
        (
            vec![host, ("STRATA_HOST_DEVICES", "banana")],
            "STRATA_CONFIG",
        ),
        (vec![host, ("STRATA_HOST_STRICT", "maybe")], "STRATA_CONFIG"),
        (
            vec![host, ("STRATA_HOST_GRANULARITY", "3KiB")],
            "STRATA_CONFIG",
        ),
    ];
    if strata_vmm::cuda::result::driver_present() {
        eprintln!("backend_errors: a CUDA driver is present, the no-driver cases are skipped");
    } else {
        cases.push((vec![("STRATA_BACKEND", "cuda")], "STRATA_NO_DEVICE"));
        // `auto` without a driver falls back to the host backend and its configuration.
        cases.push((vec![("STRATA_HOST_DEVICES", "banana")], "STRATA_CONFIG"));
    }
    for (env, expected) in cases {
        let mut cmd = Command::new(&exe);
        cmd.arg(expected);
        for var in [
            "STRATA_BACKEND",
            "STRATA_HOST_DEVICES",
            "STRATA_HOST_STRICT",
            "STRATA_HOST_GRANULARITY",
            "STRATA_HOST_LINK",
        ] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied());
        let out = cmd.output().expect("run backend_errors");
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
            "{env:?}, expected {expected}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
