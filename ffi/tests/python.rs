//! Runs the Python package's tests (`python/tests`, `python3 -m unittest`) against the
//! `libstrata.so` cargo built, on the host backend in strict mode. Skips, saying why, when
//! python3 is missing; torch-only tests skip themselves when PyTorch (or a GPU) is absent.

mod support;

use std::process::Command;

#[test]
fn python_package_unittests() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if !Command::new(&python)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!("skipping the Python tests: {python} not found (set PYTHON to override)");
        return;
    }
    let lib = support::library();
    let repo = support::repo();
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(repo.join("python/tests"))
        .current_dir(&repo)
        .env("PYTHONPATH", repo.join("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("STRATA_LIB", &lib)
        .env("STRATA_HOST_DEVICES", "2x512MiB")
        .env("STRATA_HOST_STRICT", "1")
        .env_remove("STRATA_HOST_LINK");
    if std::env::var("STRATA_BACKEND").as_deref() != Ok("cuda") {
        cmd.env("STRATA_BACKEND", "host");
    }
    let out = cmd.output().expect("run python3 -m unittest");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "Python tests failed:\n{stderr}");
    assert!(stderr.contains("\nOK"), "{stderr}");
    // The ctypes tests really ran (not everything skipped).
    assert!(stderr.contains("test_tags_and_sleep_wake_keep_contents") && stderr.contains("... ok"));
}
