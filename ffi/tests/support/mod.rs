//! Finding (and building) `libstrata.so` for the tests and the benchmark.
//!
//! `cargo test` and `cargo bench` do not build a cdylib-only package's library for its test
//! and bench targets, so [`library`] asks cargo to build it (a no-op when fresh) into the same
//! target folder and profile as the running executable: `target/<profile>/libstrata.so`.

use std::path::PathBuf;
use std::sync::OnceLock;

#[allow(unused_imports)]
pub use strata_test_support::{profile_dir, repo};

/// `libstrata.so`, built by cargo if needed; `STRATA_LIB` overrides.
pub fn library() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        if let Some(p) = std::env::var_os("STRATA_LIB") {
            return p.into();
        }
        let dir = strata_test_support::cargo_build(&["-p", "strata-ffi", "--lib"]);
        let lib = dir.join("libstrata.so");
        assert!(lib.exists(), "{} missing after the build", lib.display());
        lib
    })
    .clone()
}
