//! Test set-up the workspace's test binaries share (a dev-dependency only; no dependencies of
//! its own, so any crate's tests may use it): where the running test executable's target folder
//! is, building another package into it, the folder of NVIDIA's real CUDA libraries, and the
//! report `.ci/run` counts the CUDA checks from, the named skips `.ci/gpu-run` lists, and the
//! emulated CUDA driver's folder.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>/`: test and bench executables live in its `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<executable>")
        .to_path_buf()
}

/// The workspace root: the checkout this crate was compiled from (`CARGO_MANIFEST_DIR`), so a
/// target folder copied from another checkout must rebuild this crate before its tests run.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// Runs `cargo build --quiet ARGS` into the running executable's target folder and profile (a
/// no-op when fresh: cargo builds no cdylib or binary of another target for a test) and
/// returns [`profile_dir`], where the artifacts are.
pub fn cargo_build(args: &[&str]) -> PathBuf {
    let dir = profile_dir();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(other) => other.to_string(),
        None => panic!("cannot tell the profile of {}", dir.display()),
    };
    let target_dir = dir.parent().expect("target folder");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "--quiet", "--profile", &profile])
        .args(args)
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(repo())
        .output()
        .expect("run cargo build");
    assert!(
        out.status.success(),
        "cargo build {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// The folder holding NVIDIA's real CUDA libraries (`.ci/cuda-libs` installs them into
/// `target/cuda-libs/lib`; `STRATA_CUDA_LIBS` names another), when the driver is there.
pub fn cuda_libs() -> Option<PathBuf> {
    let dir = std::env::var_os("STRATA_CUDA_LIBS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/cuda-libs/lib"));
    dir.join("libcuda.so.1").exists().then_some(dir)
}

/// Appends `line` to the file `STRATA_CUDA_REPORT` names, if set (`.ci/run` counts the `ran`
/// and `skipped` lines of the real-library checks).
pub fn report(line: &str) {
    let Some(path) = std::env::var_os("STRATA_CUDA_REPORT") else {
        return;
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open STRATA_CUDA_REPORT");
    writeln!(file, "{line}").expect("write STRATA_CUDA_REPORT");
}

/// Records that the running test skipped itself, and why: prints `skipped TEST: REASON` (shown
/// by `--show-output`; `.ci/gpu-run` counts and lists these lines) and appends the same line to
/// the file `STRATA_SKIP_REPORT` names, if set. Only for what the machine cannot do (a second
/// device, peer access, a host-backend hook on a real driver); the caller returns right after.
pub fn skip(test: &str, reason: &str) {
    let line = format!("skipped {test}: {reason}");
    println!("{line}");
    let Some(path) = std::env::var_os("STRATA_SKIP_REPORT") else {
        return;
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open STRATA_SKIP_REPORT");
    writeln!(file, "{line}").expect("write STRATA_SKIP_REPORT");
}

/// A folder of its own (`target/<profile>/NAME/`) holding the emulated CUDA driver
/// (`tests/cuda-emu`, built first: a no-op when fresh) as both `libcuda.so.1` and `libcuda.so`,
/// for a child's `LD_LIBRARY_PATH`. Both names, because cudarc asks for `libcuda.so` first and
/// a machine with a real driver would otherwise answer that one from its own library path.
/// `Err(reason)` when the emulator library is not there (a bundle carried to a GPU machine
/// holds no build of it): the caller skips with that reason.
pub fn cuda_emulator(name: &str) -> Result<PathBuf, String> {
    let dir = cargo_build(&["-p", "strata-cuda-emu"]);
    let lib = dir.join("libstrata_cuda_emu.so");
    if !lib.exists() {
        return Err(format!(
            "the emulated CUDA driver is not built here ({} is missing)",
            lib.display()
        ));
    }
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder).map_err(|e| format!("create {}: {e}", folder.display()))?;
    for link in ["libcuda.so.1", "libcuda.so"] {
        let at = folder.join(link);
        let _ = std::fs::remove_file(&at);
        // Another test process may have made the same link just now: fine either way.
        let _ = std::os::unix::fs::symlink(&lib, &at);
        if std::fs::canonicalize(&at).ok() != std::fs::canonicalize(&lib).ok() {
            return Err(format!(
                "could not link {} to {}",
                at.display(),
                lib.display()
            ));
        }
    }
    Ok(folder)
}
