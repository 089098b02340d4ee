//! Helpers the preload test binaries share: the C compiler and the shim's build.

use std::path::PathBuf;
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
            let profile_dir = strata_test_support::cargo_build(&["-p", "strata-preload", "--lib"]);
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

#[allow(unused_imports)]
pub use strata_test_support::cuda_libs;

/// Appends `OUTCOME preload::TEST` to the file `STRATA_CUDA_REPORT` names (`.ci/run` counts).
#[allow(dead_code)]
pub fn report(outcome: &str, test: &str) {
    strata_test_support::report(&format!("{outcome} preload::{test}"));
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

/// The emulated CUDA driver's folder (`libcuda.so.1`, `libcuda.so`), or why it is not here.
#[allow(dead_code)]
pub fn emulator() -> Result<PathBuf, String> {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| strata_test_support::cuda_emulator("cuda-emu-preload-tests"))
        .clone()
}
