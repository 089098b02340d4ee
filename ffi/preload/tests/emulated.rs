//! libstrata_preload.so with strata on the CUDA backend, both over the emulated driver
//! (`tests/cuda-emu`) in one process: an engine's driver allocations are served by strata's
//! CUDA backend, which itself calls the same driver library underneath the shim.

use std::process::Command;

mod common;

use common::{emulator, probe, shim};

fn run(emulator: &std::path::Path, preload: bool, disable: bool) -> String {
    let mut cmd = Command::new(probe());
    cmd.arg("driver")
        .env("LD_LIBRARY_PATH", emulator)
        .env("STRATA_BACKEND", "cuda")
        .env("STRATA_CUDA_EMU_DEVICES", "1x1GiB")
        .env_remove("STRATA_PRELOAD_DISABLE")
        .env_remove("LD_PRELOAD");
    if preload {
        cmd.env("LD_PRELOAD", shim());
    }
    if disable {
        cmd.env("STRATA_PRELOAD_DISABLE", "1");
    }
    let out = cmd.output().expect("run the probe");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    text
}

fn has(out: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            out.contains(&format!("{line}\n")),
            "missing {line:?} in:\n{out}"
        );
    }
}

#[test]
fn driver_allocations_are_served_by_strata_on_the_cuda_backend() {
    let test = "driver_allocations_are_served_by_strata_on_the_cuda_backend";
    let emulator = match emulator() {
        Ok(dir) => dir,
        Err(reason) => return strata_test_support::skip(test, &reason),
    };
    let out = run(&emulator, true, false);
    has(
        &out,
        &[
            "cuMemAlloc 0",
            "owned 1",
            "cuMemFree 0",
            "owned_after_free 0",
            "cuMemAllocAsync 0",
            "async_owned 1",
            "cuMemFreeAsync 0",
            "cuMemGetInfo 0",
            "total 1073741824",
            "free_below_total 1",
            // No current context on that thread: the shim passes the call through and the
            // driver refuses it (CUDA_ERROR_INVALID_CONTEXT).
            "cuMemAlloc_without_context 201",
        ],
    );
}

#[test]
fn without_the_shim_the_emulated_driver_serves_and_refuses_the_same_way() {
    let test = "without_the_shim_the_emulated_driver_serves_and_refuses_the_same_way";
    let emulator = match emulator() {
        Ok(dir) => dir,
        Err(reason) => return strata_test_support::skip(test, &reason),
    };
    for (preload, disable) in [(false, false), (true, true)] {
        let out = run(&emulator, preload, disable);
        has(
            &out,
            &[
                "cuMemAlloc 0",
                "owned 0",
                "cuMemFree 0",
                "cuMemAllocAsync 0",
                "async_owned 0",
                "cuMemFreeAsync 0",
                "total 1073741824",
                "free_below_total 1",
                "cuMemAlloc_without_context 201",
            ],
        );
    }
}
