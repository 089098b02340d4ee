//! Finding (and building) `libstrata.so` for the tests and the benchmark.
//!
//! `cargo test` and `cargo bench` do not build a cdylib-only package's library for its test
//! and bench targets, so [`library`] asks cargo to build it (a no-op when fresh) into the same
//! target folder and profile as the running executable: `target/<profile>/libstrata.so`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// `target/<profile>/`: test and bench executables live in its `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<executable>")
        .to_path_buf()
}

/// The workspace root.
#[allow(dead_code)]
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// `libstrata.so`, built by cargo if needed; `STRATA_LIB` overrides.
pub fn library() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        if let Some(p) = std::env::var_os("STRATA_LIB") {
            return p.into();
        }
        let dir = profile_dir();
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_string(),
            Some(other) => other.to_string(),
            None => panic!("cannot tell the profile of {}", dir.display()),
        };
        let target_dir = dir.parent().expect("target folder");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
        let out = Command::new(cargo)
            .args(["build", "-p", "strata-ffi", "--lib", "--profile", &profile])
            .arg("--target-dir")
            .arg(target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("run cargo build for libstrata.so");
        assert!(
            out.status.success(),
            "building libstrata.so failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lib = dir.join("libstrata.so");
        assert!(lib.exists(), "{} missing after the build", lib.display());
        lib
    })
    .clone()
}
