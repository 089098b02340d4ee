//! Re-running one unit test in a child process with another library path: cudarc loads each
//! CUDA library once per process, by name, so a test over a particular driver runs in a child
//! started with that driver's folder on `LD_LIBRARY_PATH`.

use std::ffi::OsStr;
use std::process::Command;

const CHILD: &str = "STRATA_CUDA_TEST_CHILD";

/// True inside the child (the test's checks run there).
pub(super) fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs `module::test` (`module` as `module_path!()` gives it) in a child with `path` as its
/// library path and `env` set, and asserts that it passed; returns the child's output.
pub(super) fn rerun(module: &str, test: &str, path: &OsStr, env: &[(&str, &str)]) -> String {
    let test = format!("{}::{test}", module.trim_start_matches("strata_vmm::"));
    let out = Command::new(std::env::current_exe().expect("current_exe"))
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", path)
        .envs(env.iter().copied())
        .env_remove("STRATA_BACKEND")
        .output()
        .expect("re-run the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} with LD_LIBRARY_PATH={}:\n{text}",
        path.to_string_lossy()
    );
    text
}
