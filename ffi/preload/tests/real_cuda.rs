//! libstrata_preload.so over NVIDIA's real driver (`libcuda.so.1`, CUDA 12.2) and runtime
//! (`libcudart.so.12`), which load and answer lookups without a GPU (`.ci/cuda-libs` installs
//! them). `tests/real/real.c` asks the same questions with and without the shim preloaded.
//! Without the libraries each test prints why and passes as skipped.

use std::io::Write;
use std::process::{Command, Stdio};

mod common;

#[allow(dead_code)]
#[path = "../src/table.rs"]
mod table;

use common::{cuda_libs, probe, report, shim};
use table::{proc_lookup, PROC_TABLE};

/// Runs the probe in `mode` over the real libraries, preloaded or not; `None` when the
/// libraries are not installed (the test is then skipped).
fn run(test: &str, mode: &str, preload: bool, stdin: &str) -> Option<String> {
    let Some(libs) = cuda_libs() else {
        eprintln!(
            "skipped {test}: NVIDIA's CUDA libraries are not installed (run .ci/cuda-libs or set STRATA_CUDA_LIBS)"
        );
        report("skipped", test);
        return None;
    };
    let mut cmd = Command::new(probe());
    cmd.arg(mode)
        .env("LD_LIBRARY_PATH", libs)
        .env("STRATA_BACKEND", "host")
        .env("STRATA_HOST_STRICT", "1")
        .env("STRATA_HOST_DEVICES", "1x1GiB")
        .env("STRATA_PRELOAD_LOG", "1")
        .env_remove("STRATA_PRELOAD_DISABLE")
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if preload {
        cmd.env("LD_PRELOAD", shim());
    }
    let mut child = cmd.spawn().expect("run the probe");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write queries");
    let out = child.wait_with_output().expect("wait for the probe");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "real {mode} (preload {preload}):\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
}

/// Every row of the shim's table at each of its version boundaries (and just below), with
/// every flag, plus names the shim does not hook.
fn queries() -> Vec<(String, i32, u64)> {
    let mut q = Vec::new();
    for row in PROC_TABLE {
        let mut versions = vec![row.since, 12020, 12080];
        if row.since > 0 {
            versions.push(row.since - 1);
        }
        if row.until != i32::MAX {
            versions.extend([row.until - 1, row.until]);
        }
        for v in versions {
            for flags in [0, 1, 2] {
                q.push((row.name.to_string(), v, flags));
            }
        }
    }
    for name in [
        "cuInit",
        "cuMemcpyAsync",
        "cuMemCreate",
        "cuMemAlloc_v2",
        "cuGetExportTable",
        "cuMemcpyBatchAsync",
    ] {
        for v in [3020, 12000, 12080] {
            q.push((name.to_string(), v, 0));
        }
    }
    q.sort();
    q.dedup();
    q
}

/// `(v1 answer, v2 answer)` per query line of a `real table` run.
fn answers(out: &str) -> std::collections::HashMap<String, (String, String)> {
    out.lines()
        .filter_map(|l| {
            let mut parts = l.split(" | ");
            let key = parts.next()?.to_string();
            Some((key, (parts.next()?.to_string(), parts.next()?.to_string())))
        })
        .collect()
}

#[test]
fn proc_address_table_answers_as_the_real_driver_except_for_hooked_rows() {
    let test = "proc_address_table_answers_as_the_real_driver_except_for_hooked_rows";
    let queries = queries();
    let input: String = queries
        .iter()
        .map(|(n, v, f)| format!("{n} {v} {f}\n"))
        .collect();
    let Some(bare) = run(test, "table", false, &input) else {
        return;
    };
    let shimmed = run(test, "table", true, &input).expect("libraries present");
    let (bare, shimmed) = (answers(&bare), answers(&shimmed));
    let mut hooked = 0;
    for (name, version, flags) in &queries {
        let key = format!("{name} {version} {flags}");
        let real = bare
            .get(&key)
            .unwrap_or_else(|| panic!("no answer for {key}"));
        let got = shimmed
            .get(&key)
            .unwrap_or_else(|| panic!("no answer for {key}"));
        let hook = proc_lookup(name.as_bytes(), *version, *flags).and_then(|r| r.hook);
        let real_found = real.0.starts_with("v1 0 ") && !real.0.ends_with("null");
        match hook {
            Some(hook) if real_found => {
                hooked += 1;
                let mut allowed = vec![hook.symbol().to_string_lossy().into_owned()];
                if *flags == 0 {
                    // CU_GET_PROC_ADDRESS_DEFAULT may answer with the per-thread twin.
                    allowed.extend(
                        hook.per_thread_twin()
                            .map(|t| t.symbol().to_string_lossy().into_owned()),
                    );
                }
                for (answer, prefix) in [(&got.0, "v1 0 "), (&got.1, "v2 0 0 ")] {
                    assert!(
                        answer.starts_with(prefix)
                            && answer.contains("libstrata_preload.so+")
                            && allowed.iter().any(|s| answer.ends_with(&format!("({s})"))),
                        "{key}: expected the wrapper of {allowed:?}, got {answer} (real driver: {real:?})"
                    );
                }
            }
            _ => assert_eq!(got, real, "{key}: the shim must answer as the real driver"),
        }
    }
    assert!(hooked >= PROC_TABLE.iter().filter(|r| r.hook.is_some()).count());
    report("ran", test);
}

#[test]
fn real_runtime_resolves_its_allocation_entry_points_through_the_shim() {
    let test = "real_runtime_resolves_its_allocation_entry_points_through_the_shim";
    let Some(bare) = run(test, "runtime", false, "") else {
        return;
    };
    // Without a device the runtime refuses everything (cudaErrorNoDevice).
    assert!(bare.contains("cudaGetDeviceCount 100"), "{bare}");
    assert!(bare.contains("cudaMalloc 100"), "{bare}");
    let out = run(test, "runtime", true, "").expect("libraries present");
    // libcudart found the driver's cuGetProcAddress through the shim's dlsym and asked it for
    // every allocation entry point: each came back as the shim's wrapper.
    for line in [
        "dlsym(cuGetProcAddress_v2) -> wrapper",
        "-> wrapper of cuMemAlloc_v2",
        "-> wrapper of cuMemFree_v2",
        "-> wrapper of cuMemAllocAsync\n",
        "-> wrapper of cuMemAllocAsync_ptsz",
        "-> wrapper of cuMemFreeAsync\n",
        "-> wrapper of cuMemFreeAsync_ptsz",
        "-> wrapper of cuMemGetInfo_v2",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    // Its cudaMalloc and cudaFree are served by strata (host backend), even without a device.
    for line in [
        "cudaGetDeviceCount 100",
        "cudaMalloc 0",
        "owned 1",
        "cudaFree 0",
        "owned_after_free 0",
    ] {
        assert!(
            out.contains(&format!("{line}\n")),
            "missing {line:?} in:\n{out}"
        );
    }
    report("ran", test);
}
