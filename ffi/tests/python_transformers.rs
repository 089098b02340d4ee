//! Runs `python/tests/test_transformers.py` (strata.transformers: real transformers models
//! generating with `StrataCache`) and `python/tests/test_mirage.py` (strata.mirage: an idle
//! model's parameters reclaimed as KV pages, streamed back with the look-ahead, reverted)
//! against the `libstrata.so` cargo built, on the host backend outside strict mode, where KV
//! tensors are CPU tensors torch's kernels read. Pages of 64 KiB make the tiny models' sequences
//! cross page boundaries while they generate (`test_transformers_layout.py` measures KV bytes at
//! real models' shapes in a process of its own with 2 MiB pages); torch uses one thread. With torch and
//! transformers installed (as in `.ci/run`'s virtual environment) the tests must run, not skip;
//! without them this test says why and returns. On a GPU run (`STRATA_BACKEND=cuda`) they run on
//! `cuda`, all but the host link model's.

mod support;
#[path = "support/unittest.rs"]
mod unittest;

use std::process::Command;

/// `StrataCache`; the offloaded cache runs in a process of its own, beside it (a GPU run gives
/// this executable three test threads).
#[test]
fn python_transformers_generate_on_strata_kv() {
    run_unittest(
        "test_transformers.StrataCacheTest",
        &[
            "test_llama_greedy_matches_dynamic_cache",
            "test_qwen2_greedy_matches_dynamic_cache",
            "test_llama_every_row_in_a_page_matches_dynamic_cache",
            "test_qwen2_request_layout_matches_dynamic_cache",
            "test_beam_search_matches_dynamic_cache",
            "test_llama_with_strata_sdpa_attention_matches_dynamic_cache",
            "test_mixtral_with_strata_sdpa_attention_matches_dynamic_cache",
            "test_mixtral_moe_greedy_matches_dynamic_cache",
            "test_more_tokens_than_reserved_is_a_clear_error_and_keeps_the_cache",
            "test_crop_returns_the_pages_past_the_tokens_kept",
            "test_a_row_spilled_twice_reads_back_what_was_written_between_the_spills",
            "test_crop_with_a_positive_count_keeps_that_many_tokens",
            "test_every_update_checks_batch_heads_head_dim_and_dtype_and_keeps_the_cache",
            "test_transformers_outside_the_supported_range_is_refused",
        ],
        &[],
    );
}

/// `StrataCache`'s layouts: KV bytes within issue 27's targets at the H200 run's shape and a
/// Llama-3-8B shape with 2 MiB pages (a process of its own, which the test starts), the choice
/// of "auto", typed errors for a bad `layout`.
#[test]
fn python_transformers_layouts_keep_kv_bytes_within_the_targets() {
    run_unittest(
        "test_transformers_layout",
        &[
            "test_kv_bytes_within_the_targets_at_the_h200_and_llama3_8b_shapes",
            "test_auto_takes_the_layout_that_maps_less",
            "test_a_bad_layout_is_a_typed_error",
        ],
        &[],
    );
}

/// `OffloadedStrataCache`: layers streamed from host memory, or swapped to host memory and disk
/// (Pie), within a device budget.
#[test]
fn python_transformers_offload_layers_within_a_device_budget() {
    run_unittest(
        "test_transformers.OffloadTest",
        &[
            "test_llama_offload_matches_dynamic_cache",
            "test_qwen2_gqa_offload_matches_dynamic_cache",
            "test_mixtral_moe_offload_matches_dynamic_cache",
            "test_offload_with_strata_sdpa_attention_matches_dynamic_cache",
            "test_mistral_offload_matches_dynamic_cache",
            "test_pie_swapping_in_host_memory_matches_dynamic_cache",
            "test_disk_tier_holds_what_host_memory_cannot_with_and_without_the_lookahead",
            "test_adaptive_expansion_moves_layers_in_a_generate_run",
            "test_offload_under_host_link_matches_dynamic_cache",
            "test_budget_smaller_than_one_layer_is_a_clear_error",
            "test_a_refused_close_leaves_the_cache_usable",
        ],
        &[(
            "test_offload_under_host_link_matches_dynamic_cache",
            "host backend only",
        )],
    );
}

/// `OffloadedStrataCache`'s layer streaming under a stand-in for `torch.cuda` whose side stream
/// lags (`python/tests/test_offload_streams.py`): DynamicCache's tokens, every fetch queued ahead
/// and waited for on the compute stream, no synchronizing call while generating.
#[test]
fn python_transformers_offload_streams_overlap_compute() {
    let tests = [
        "test_half_the_kv_streams_ahead_without_synchronizing",
        "test_a_budget_of_one_layer_streams_through_one_slot",
        "test_swap_modes_and_host_limit_are_checked",
        "test_a_synchronizing_call_on_the_path_would_be_caught",
    ];
    let cpu_only: Vec<_> = tests
        .iter()
        .map(|t| (*t, "CPU only: the stand-in replaces CUDA"))
        .collect();
    run_unittest("test_offload_streams", &tests, &cpu_only);
}

/// `StrataCache(compileable=True)` under torch.compile (`python/tests/test_transformers_compiled.py`):
/// the decode step compiled whole, DynamicCache's tokens, the mapped-ahead margin, the zero page.
#[test]
fn python_transformers_compiled_decode_steps() {
    run_unittest(
        "test_transformers_compiled",
        &[
            "test_llama_compiled_decode_matches_dynamic_cache",
            "test_qwen2_compiled_decode_matches_dynamic_cache",
            "test_mixtral_compiled_decode_matches_dynamic_cache",
            "test_margin_holds_through_prefill_decode_crop_reset_and_a_refused_batch",
            "test_a_compiled_write_past_the_mapped_pages_faults_on_the_zero_page",
        ],
        &[(
            "test_a_compiled_write_past_the_mapped_pages_faults_on_the_zero_page",
            "the host backend outside strict mode (a fault there is a signal)",
        )],
    );
}

/// `strata.mirage` in a process of its own: it squeezes the device's pool, and parameter
/// models stay registered for the process's life.
#[test]
fn python_mirage_reclaims_an_idle_models_layers_as_kv() {
    run_unittest(
        "test_mirage",
        &[
            "test_llama_serves_on_a_qwen2_models_layers_streamed_through_one_slot",
            "test_qwen2_serves_on_a_llama_models_layers_streamed_through_two_slots",
            "test_layers_come_back_when_pressure_falls_even_after_the_pool_let_its_pages_go",
            "test_bad_use_is_a_typed_error",
        ],
        &[],
    );
}

/// Runs the unittest `module` (or `module.Class`) of `python/tests` and checks that `tests`
/// ran, none skipped but what `may_skip` allows on CUDA ([`unittest::assert_ran`]).
fn run_unittest(module: &str, tests: &[&str], may_skip: &[(&str, &str)]) {
    let python = unittest::python();
    if !unittest::imports(&python, "torch, transformers") {
        eprintln!(
            "skipping the transformers tests: {python} cannot import torch and transformers \
             (.ci/run installs them)"
        );
        return;
    }
    let lib = support::library();
    let repo = support::repo();
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "unittest", "-v", module])
        .current_dir(repo.join("python/tests"))
        .env("PYTHONPATH", repo.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("STRATA_LIB", &lib)
        .env("STRATA_HOST_DEVICES", "1x512MiB")
        .env("STRATA_HOST_GRANULARITY", "64KiB")
        .env("STRATA_HOST_STRICT", "0")
        // One torch thread: tiny matrices gain nothing from two, and OpenMP's spinning threads
        // crawl on a machine whose cores are busy with the other tests.
        .env("OMP_NUM_THREADS", "1")
        .env_remove("STRATA_HOST_LINK");
    if !unittest::on_cuda() {
        cmd.env("STRATA_BACKEND", "host");
    }
    let stderr = unittest::run(&mut cmd, module);
    unittest::assert_ran(module, &stderr, tests, may_skip);
}
