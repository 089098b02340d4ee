//! Helpers the preload test binaries share: the C compiler and the shim's build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs the C compiler (`$CC` or `cc`) with warnings as errors.
pub fn cc(args: &[&str]) {
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O1", "-g", "-Wall", "-Wextra", "-Werror"])
        .args(args)
        .output()
        .expect("a C compiler (cc) is needed to build the fake driver");
    assert!(
        out.status.success(),
        "cc {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `target/<profile>/libstrata_preload.so`, built once per test run: cargo does not build a
/// cdylib for its own package's integration tests, and a stale one must never be tested.
pub fn shim() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("current_exe");
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>/deps/<test>")
                .to_path_buf();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build.args(["build", "--quiet", "-p", "strata-preload", "--lib"]);
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build for the shim");
            assert!(status.success(), "building libstrata_preload.so failed");
            let path = profile_dir.join("libstrata_preload.so");
            assert!(
                path.exists(),
                "libstrata_preload.so not found at {}",
                path.display()
            );
            path
        })
        .clone()
}

/// The folder holding NVIDIA's real CUDA libraries (`.ci/cuda-libs`: `target/cuda-libs/lib`,
/// or `STRATA_CUDA_LIBS`), when installed.
#[allow(dead_code)]
pub fn cuda_libs() -> Option<PathBuf> {
    let dir = std::env::var_os("STRATA_CUDA_LIBS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/cuda-libs/lib")
        });
    dir.join("libcuda.so.1").exists().then_some(dir)
}

/// Appends `OUTCOME preload::TEST` to the file `STRATA_CUDA_REPORT` names (`.ci/run` counts).
#[allow(dead_code)]
pub fn report(outcome: &str, test: &str) {
    use std::io::Write;
    let Some(path) = std::env::var_os("STRATA_CUDA_REPORT") else {
        return;
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open STRATA_CUDA_REPORT");
    writeln!(file, "{outcome} preload::{test}").expect("write STRATA_CUDA_REPORT");
}

/// The probe program, built once per test binary.
#[allow(dead_code)]
pub fn probe() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("strata-preload-real");
            std::fs::create_dir_all(&dir).expect("create the probe's directory");
            let out = dir.join("real");
            let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/real/real.c");
            cc(&["-o", &out.to_string_lossy(), &src.to_string_lossy(), "-ldl"]);
            out
        })
        .clone()
}

/// A folder holding the emulated driver (`tests/cuda-emu`, built first) as `libcuda.so.1`.
#[allow(dead_code)]
pub fn emulator() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("current_exe");
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>/deps/<test>")
                .to_path_buf();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build.args(["build", "--quiet", "-p", "strata-cuda-emu"]);
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            assert!(
                build.status().expect("cargo build").success(),
                "building the emulated driver failed"
            );
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("strata-cuda-emu");
            std::fs::create_dir_all(&dir).expect("create the emulator's directory");
            let link = dir.join("libcuda.so.1");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(profile_dir.join("libstrata_cuda_emu.so"), &link)
                .expect("link libcuda.so.1");
            dir
        })
        .clone()
}
