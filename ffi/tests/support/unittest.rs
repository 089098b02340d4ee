//! Running `python/tests` with `python -m unittest -v` and reading its report: which tests ran,
//! which skipped and why (python.rs, python_transformers.rs).
#![allow(dead_code)] // each test file uses part of it

use std::process::Command;

/// The interpreter: `PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Whether `python` runs and imports `modules` (e.g. "torch, transformers"; "" for none).
pub fn imports(python: &str, modules: &str) -> bool {
    let code = if modules.is_empty() {
        String::from("pass")
    } else {
        format!("import {modules}")
    };
    Command::new(python)
        .args(["-c", &code])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A GPU run (or CI's emulated driver) asks for the CUDA backend; otherwise the tests run on the
/// host backend.
pub fn on_cuda() -> bool {
    std::env::var("STRATA_BACKEND").as_deref() == Ok("cuda")
}

/// Runs `cmd` (a `python -m unittest -v ...`), prints its report (unittest writes it to
/// stderr) and returns it; panics, naming `what`, when a test failed.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().expect("run python3 -m unittest");
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("{report}");
    assert!(out.status.success(), "{what} failed:\n{report}");
    report
}

/// The skipped tests of a `-v` report as (test, reason): `TEST (module.Class.TEST) ... skipped
/// 'REASON'`, the `... skipped` part on the next line when the test has a docstring.
pub fn skips(report: &str) -> Vec<(String, String)> {
    let mut last_test = None;
    let mut found = Vec::new();
    for line in report.lines() {
        if let Some((name, rest)) = line.split_once(" (") {
            if name.starts_with("test") && !name.contains(' ') && rest.contains(')') {
                last_test = Some(name.to_string());
            }
        }
        if let (Some(at), Some(test)) = (line.find(" ... skipped '"), &last_test) {
            let reason = &line[at + " ... skipped '".len()..];
            found.push((test.clone(), reason.trim_end_matches('\'').to_string()));
        }
    }
    found
}

/// Asserts that each of `tests` ran in `module`'s `report` and that nothing skipped, except a
/// test of `may_skip` (test, reason prefix) for that reason on the CUDA backend: a one-GPU
/// machine has no second device, and host-backend models (a link model) do not apply there.
pub fn assert_ran(module: &str, report: &str, tests: &[&str], may_skip: &[(&str, &str)]) {
    let allowed = |test: &str, reason: &str| {
        on_cuda()
            && may_skip
                .iter()
                .any(|(t, prefix)| *t == test && reason.starts_with(prefix))
    };
    let unexpected: Vec<_> = skips(report)
        .into_iter()
        .filter(|(test, reason)| !allowed(test, reason))
        .collect();
    assert!(
        unexpected.is_empty(),
        "{module}: tests skipped {unexpected:?}:\n{report}"
    );
    for test in tests {
        assert!(
            report.contains(&format!("{test} (")),
            "{module}: {test} did not run:\n{report}"
        );
    }
}

#[test]
fn skips_are_read_with_their_reasons_docstring_or_not() {
    let report = "\
test_a (m.C.test_a) ... ok
test_b (m.C.test_b) ... skipped 'needs a second device (this machine has 1)'
test_c (m.C.test_c)
A docstring's first line ... skipped 'host backend only: a link model'
test_d (m.C.test_d)
Its docstring ... ok
";
    assert_eq!(
        skips(report),
        [
            (
                "test_b".into(),
                "needs a second device (this machine has 1)".into()
            ),
            ("test_c".into(), "host backend only: a link model".into()),
        ]
    );
}
