//! Runs the Python package's tests (`python/tests`, `python3 -m unittest`) against the
//! `libstrata.so` cargo built, on the host backend in strict mode, then the DLPack tests
//! (`test_kv_torch`) again outside strict mode, where KV tensors are CPU tensors: with PyTorch
//! installed (as in `.ci/run`'s virtual environment) they must run, not skip. Skips, saying why,
//! when python3 is missing; torch-only tests skip themselves when PyTorch (or a GPU) is absent.

mod support;

use std::process::Command;

/// `python -m unittest` against the built library, on the host backend (unless a GPU run asks
/// for CUDA) with two small devices, strict mode as given ("1" or "0"); arguments follow.
fn unittest(python: &str, strict: &str) -> Command {
    let repo = support::repo();
    let mut cmd = Command::new(python);
    cmd.args(["-m", "unittest"])
        .current_dir(&repo)
        .env("PYTHONPATH", repo.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("STRATA_LIB", support::library())
        .env("STRATA_HOST_DEVICES", "2x512MiB")
        .env("STRATA_HOST_STRICT", strict)
        .env_remove("STRATA_HOST_LINK");
    if std::env::var("STRATA_BACKEND").as_deref() != Ok("cuda") {
        cmd.env("STRATA_BACKEND", "host");
    }
    cmd
}

/// Whether `python` can import `modules` (a comma-separated list).
fn imports(python: &str, modules: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn python_package_unittests() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if !Command::new(&python)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!("skipping the Python tests: {python} not found (set PYTHON to override)");
        return;
    }
    let repo = support::repo();
    let out = unittest(&python, "1")
        .args(["discover", "-v", "-s"])
        .arg(repo.join("python/tests"))
        .output()
        .expect("run python3 -m unittest");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "Python tests failed:\n{stderr}");
    assert!(stderr.contains("\nOK"), "{stderr}");
    // The ctypes tests really ran (not everything skipped).
    assert!(stderr.contains("test_tags_and_sleep_wake_keep_contents") && stderr.contains("... ok"));
    assert!(stderr.contains("test_lost_callback_fires_exactly_once_per_lost_block ("));
    // With torch and CPU tensors (the host backend), the KV lifetime tests ran: DLPack after
    // close, close racing an export.
    if std::env::var("STRATA_BACKEND").as_deref() != Ok("cuda") && imports(&python, "torch") {
        assert_passed(
            &stderr,
            "test_kv_lifetime.KvLifetimeTest",
            &[
                "test_a_descriptor_taken_before_close_is_refused_after_it",
                "test_close_racing_an_export_never_frees_exported_memory",
            ],
        );
    }
    // With hypothesis (.ci/run's environment), the property tests of strata.kv ran, not skipped.
    if imports(&python, "hypothesis") {
        assert_passed(
            &stderr,
            "test_kv_properties.KvIntegerProperties",
            &[
                "test_kv_calls_with_integers_at_and_beyond_the_c_limits",
                "test_kv_space_counts_beyond_their_c_types_are_refused",
            ],
        );
    }
    // With torch and transformers (.ci/run's environment), "strata_sdpa"'s tests ran, not skipped.
    if imports(&python, "torch, transformers") {
        assert_passed(
            &stderr,
            "test_row_attention.RowAttentionTest",
            &[
                "test_decode_over_token_major_views_matches_sdpa",
                "test_everything_else_is_sdpa_unchanged",
                "test_short_contexts_are_sdpa_unchanged",
            ],
        );
    }
}

/// Asserts that unittest's verbose output `stderr` shows each of `tests` of `class` (module.Class)
/// passed, not skipped.
fn assert_passed(stderr: &str, class: &str, tests: &[&str]) {
    for test in tests {
        assert!(
            stderr.contains(&format!("{test} ({class}.{test}) ... ok")),
            "{test} did not pass:\n{stderr}"
        );
    }
}

/// The DLPack tests outside strict mode: KV tensors are CPU tensors over the space's pages.
#[test]
fn python_kv_tensors_through_dlpack() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if !imports(&python, "torch") {
        eprintln!("skipping the DLPack tests: {python} cannot import torch (.ci/run installs it)");
        return;
    }
    let out = unittest(&python, "0")
        .args(["-v", "test_kv_torch"])
        .current_dir(support::repo().join("python/tests"))
        .output()
        .expect("run python3 -m unittest");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "DLPack tests failed:\n{stderr}");
    assert!(
        !stderr.contains("skipped"),
        "DLPack tests skipped:\n{stderr}"
    );
    for test in [
        "test_spill_to_host_and_disk_and_back_bit_for_bit_at_the_same_address",
        "test_lost_blocks_called_back_once_each_then_recomputed_in_place",
        "test_tensor_keeps_its_data_ptr_and_bytes_across_offload_and_onload",
        "test_tensor_keeps_its_data_ptr_and_bytes_when_a_lender_takes_its_pages_back",
    ] {
        assert!(
            stderr.contains(&format!("{test} (")),
            "{test} did not run:\n{stderr}"
        );
    }
}
