//! `strata info` over NVIDIA's real driver library without a GPU (`.ci/cuda-libs` installs it):
//! `auto` selects the host emulation and says why. Skipped, with a message, without the library.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folder holding NVIDIA's libraries (`target/cuda-libs/lib` or `STRATA_CUDA_LIBS`).
fn cuda_libs() -> Option<PathBuf> {
    let dir = std::env::var_os("STRATA_CUDA_LIBS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda-libs/lib"));
    dir.join("libcuda.so.1").exists().then_some(dir)
}

/// `target/<profile>/strata`, built first (cargo builds no binary of another package for a
/// test; a no-op when fresh).
fn cli() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build.args(["build", "--quiet", "-p", "strata", "--bin", "strata"]);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    assert!(build.status().expect("cargo build").success());
    profile_dir.join("strata")
}

#[test]
fn info_over_the_real_driver_without_a_device_says_why_it_chose_host() {
    let test = "info_over_the_real_driver_without_a_device_says_why_it_chose_host";
    let Some(libs) = cuda_libs() else {
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
    if let Some(path) = std::env::var_os("STRATA_CUDA_REPORT") {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("open STRATA_CUDA_REPORT");
        writeln!(file, "ran tests::{test}").expect("write STRATA_CUDA_REPORT");
    }
}
