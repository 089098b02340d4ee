//! Runs the Python package's tests (`python/tests`, `python3 -m unittest`) against the
//! `libstrata.so` cargo built, on the host backend in strict mode, then the DLPack tests
//! (`test_kv_torch`) again outside strict mode, where KV tensors are CPU tensors (on a GPU run,
//! CUDA tensors): with PyTorch installed (as in `.ci/run`'s virtual environment) they must run,
//! not skip. Skips, saying why, when python3 is missing; torch-only tests skip themselves when
//! PyTorch (or a GPU) is absent. `test_transformers` and `test_mirage` run in
//! python_transformers.rs, in processes of their own.

mod support;
#[path = "support/unittest.rs"]
mod unittest;

use std::process::Command;

/// The modules python_transformers.rs runs (outside strict mode, where they do not skip).
const RUN_ELSEWHERE: [&str; 5] = [
    "test_transformers",
    "test_transformers_compiled",
    "test_transformers_layout",
    "test_offload_streams",
    "test_mirage",
];

/// `python -m unittest` in `python/tests` against the built library, on the host backend
/// (unless a GPU run asks for CUDA) with two small devices, strict mode as given ("1" or "0");
/// arguments follow.
fn unittest(python: &str, strict: &str) -> Command {
    let repo = support::repo();
    let mut cmd = Command::new(python);
    cmd.args(["-m", "unittest"])
        .current_dir(repo.join("python/tests"))
        .env("PYTHONPATH", repo.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("STRATA_LIB", support::library())
        .env("STRATA_HOST_DEVICES", "2x512MiB")
        .env("STRATA_HOST_STRICT", strict)
        .env_remove("STRATA_HOST_LINK");
    if !unittest::on_cuda() {
        cmd.env("STRATA_BACKEND", "host");
    }
    cmd
}

/// The test modules of `python/tests` but [`RUN_ELSEWHERE`].
fn modules() -> Vec<String> {
    let dir = support::repo().join("python/tests");
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let module = name.strip_prefix("test")?.strip_suffix(".py")?;
            Some(format!("test{module}"))
        })
        .filter(|module| !RUN_ELSEWHERE.contains(&module.as_str()))
        .collect();
    found.sort();
    found
}

#[test]
fn python_package_unittests() {
    let python = unittest::python();
    if !unittest::imports(&python, "") {
        eprintln!("skipping the Python tests: {python} not found (set PYTHON to override)");
        return;
    }
    let modules = modules();
    assert!(modules.len() >= 8, "{modules:?}");
    let stderr = unittest::run(
        unittest(&python, "1").arg("-v").args(&modules),
        "Python tests",
    );
    assert!(stderr.contains("\nOK"), "{stderr}");
    // The ctypes tests really ran (not everything skipped).
    assert!(stderr.contains("test_tags_and_sleep_wake_keep_contents") && stderr.contains("... ok"));
    assert!(stderr.contains("test_lost_callback_fires_exactly_once_per_lost_block ("));
    // With torch and CPU tensors (the host backend), the KV lifetime tests ran: DLPack after
    // close, close racing an export.
    if !unittest::on_cuda() && unittest::imports(&python, "torch") {
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
    if unittest::imports(&python, "hypothesis") {
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
    if unittest::imports(&python, "torch, transformers") {
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

/// The DLPack tests outside strict mode: KV tensors are CPU tensors over the space's pages (CUDA
/// tensors on a GPU). The lender test needs a second device: on a one-GPU machine it skips.
#[test]
fn python_kv_tensors_through_dlpack() {
    let python = unittest::python();
    if !unittest::imports(&python, "torch") {
        eprintln!("skipping the DLPack tests: {python} cannot import torch (.ci/run installs it)");
        return;
    }
    let stderr = unittest::run(
        unittest(&python, "0").args(["-v", "test_kv_torch"]),
        "DLPack tests",
    );
    let lender = "test_tensor_keeps_its_data_ptr_and_bytes_when_a_lender_takes_its_pages_back";
    unittest::assert_ran(
        "test_kv_torch",
        &stderr,
        &[
            "test_spill_to_host_and_disk_and_back_bit_for_bit_at_the_same_address",
            "test_lost_blocks_called_back_once_each_then_recomputed_in_place",
            "test_tensor_keeps_its_data_ptr_and_bytes_across_offload_and_onload",
            lender,
        ],
        &[(lender, "needs a second device")],
    );
}

/// `test_params` on a machine of one device (a one-GPU machine; here the host backend with one):
/// the tests use the devices there are, none hard-coded.
#[test]
fn python_params_on_one_device() {
    let python = unittest::python();
    if !unittest::imports(&python, "") {
        eprintln!("skipping the params tests: {python} not found (set PYTHON to override)");
        return;
    }
    let stderr = unittest::run(
        unittest(&python, "1")
            .env("STRATA_HOST_DEVICES", "1x512MiB")
            .args(["-v", "test_params"]),
        "params tests",
    );
    assert_passed(
        &stderr,
        "test_params.ParamsTest",
        &[
            "test_remap_prepare_and_revert_keep_every_layer",
            "test_look_ahead_and_prefill_budget",
            "test_reversion_comes_when_the_device_has_room_though_the_pool_let_its_pages_go",
            "test_unregister_gives_the_pages_back_and_waits_for_idle",
        ],
    );
}
