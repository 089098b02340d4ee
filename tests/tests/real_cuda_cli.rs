//! `strata info` over NVIDIA's real driver library without a GPU (`.ci/cuda-libs` installs it):
//! `auto` selects the host emulation and says why. Skipped, with a message, without the library.

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/strata`, built first (cargo builds no binary of another package for a
/// test; a no-op when fresh).
fn cli() -> PathBuf {
    strata_test_support::cargo_build(&["-p", "strata", "--bin", "strata"]).join("strata")
}

#[test]
fn info_over_the_real_driver_without_a_device_says_why_it_chose_host() {
    let test = "info_over_the_real_driver_without_a_device_says_why_it_chose_host";
    let Some(libs) = strata_test_support::cuda_libs() else {
        eprintln!(
            "skipped {test}: NVIDIA's CUDA libraries are not installed (run .ci/cuda-libs or set STRATA_CUDA_LIBS)"
        );
        return;
    };
    let out = Command::new(cli())
        .args(["info", "--no-measure"])
        .env("LD_LIBRARY_PATH", libs)
        .env_remove("STRATA_BACKEND")
        .output()
        .expect("run strata info");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("backend: host\n"), "{text}");
    assert!(
        text.contains("cuda: not used (") && text.contains("CUDA_ERROR_NO_DEVICE"),
        "{text}"
    );
    strata_test_support::report(&format!("ran tests::{test}"));
}
