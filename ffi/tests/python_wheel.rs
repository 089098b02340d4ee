//! Builds the Python package the way `pip install .` does (pyproject.toml, setup.py:
//! setuptools-rust runs cargo for `ffi/` and `ffi/preload/`), installs the wheel into an empty
//! folder and imports `strata` from there, away from the source tree: the installed package
//! must find its own `libstrata.so`, ship `libstrata_preload.so`, and neither may link libcuda
//! or carry debug info (setup.py strips it). With auditwheel installed (`.ci/run`'s environment
//! has it and patchelf) the wheel is first repaired (`auditwheel repair`: tagged with the oldest
//! manylinux policy whose glibc symbol versions it stays within), and that wheel is installed.
//!
//! The build is unoptimised (`SETUPTOOLS_RUST_CARGO_PROFILE=dev`) into `target/wheel/`, which
//! stays between runs, so only the first run compiles the dependencies. It uses the Python's
//! installed setuptools-rust (`--no-build-isolation`, nothing downloaded); `.ci/run`'s virtual
//! environment has it, and there the test must run. Without it the test says why and returns.

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn needed_libraries(library: &Path) -> Vec<String> {
    let text = run(
        Command::new("readelf").arg("-d").arg(library),
        "readelf (binutils)",
    );
    text.lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split('[').nth(1)?.split(']').next()?.to_string()))
        .collect()
}

/// The ELF sections of `library` that hold debug info (`.debug_*`).
fn debug_sections(library: &Path) -> Vec<String> {
    let text = run(
        Command::new("readelf").arg("-SW").arg(library),
        "readelf (binutils)",
    );
    text.split_whitespace()
        .filter(|w| w.starts_with(".debug_"))
        .map(str::to_string)
        .collect()
}

fn only_wheel(dir: &Path) -> PathBuf {
    let wheels: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read the wheel folder")
        .map(|e| e.expect("wheel folder entry").path())
        .collect();
    assert_eq!(wheels.len(), 1, "one wheel expected: {wheels:?}");
    wheels.into_iter().next().expect("one wheel")
}

/// `auditwheel` of `python`'s environment, with that environment's `bin/` (where the
/// `patchelf` package puts its binary) first on `PATH`; None (and why) when it is not installed.
fn auditwheel(python: &str) -> Option<Command> {
    let found = Command::new(python)
        .args(["-c", "import auditwheel, sys; print(sys.prefix)"])
        .output()
        .ok()
        .filter(|o| o.status.success());
    let Some(found) = found else {
        eprintln!(
            "no manylinux check: {python} cannot import auditwheel (.ci/run's environment has it)"
        );
        return None;
    };
    let prefix = PathBuf::from(String::from_utf8_lossy(&found.stdout).trim());
    let path = std::env::join_paths(std::iter::once(prefix.join("bin")).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .expect("PATH");
    let mut cmd = Command::new(python);
    cmd.args(["-m", "auditwheel"]).env("PATH", path);
    Some(cmd)
}

#[test]
fn pip_builds_a_wheel_whose_package_loads_its_own_libraries() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let has_backend = Command::new(&python)
        .args([
            "-c",
            "import setuptools_rust, setuptools.command.bdist_wheel",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_backend {
        eprintln!(
            "skipping the wheel test: {python} cannot import setuptools_rust \
             (.ci/run's environment installs it)"
        );
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf();
    let work: PathBuf = repo
        .join("target/wheel-test")
        .join(std::process::id().to_string());
    let _ = std::fs::remove_dir_all(&work);
    let (dist, site) = (work.join("dist"), work.join("site"));
    std::fs::create_dir_all(&dist).expect("create the wheel folder");

    run(
        Command::new(&python)
            .args(["-m", "pip", "wheel", "--no-build-isolation", "--no-deps"])
            .args(["--no-index", "--quiet", "--wheel-dir"])
            .arg(&dist)
            .arg(&repo)
            .env("SETUPTOOLS_RUST_CARGO_PROFILE", "dev")
            .env("CARGO_TARGET_DIR", repo.join("target/wheel")),
        "pip wheel",
    );
    let mut wheel = only_wheel(&dist);
    let repaired = work.join("repaired");
    if let Some(mut auditwheel) = auditwheel(&python) {
        run(
            auditwheel
                .args(["repair", "--wheel-dir"])
                .arg(&repaired)
                .arg(&wheel),
            "auditwheel repair",
        );
        wheel = only_wheel(&repaired);
        let name = wheel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        assert!(
            name.starts_with("strata-") && name.contains("-py3-none-manylinux_"),
            "not a manylinux wheel: {name}"
        );
    }
    run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--no-deps", "--no-index", "--quiet"])
            .arg("--target")
            .arg(&site)
            .arg(&wheel),
        "pip install of the wheel",
    );

    let package = site.join("strata");
    for library in ["libstrata.so", "libstrata_preload.so"] {
        let path = package.join(library);
        assert!(path.is_file(), "{library} is not in the installed package");
        let needed = needed_libraries(&path);
        assert!(!needed.is_empty(), "{library}: no NEEDED entries read");
        assert!(
            needed.iter().all(|n| !n.starts_with("libcuda")),
            "{library} links {needed:?}"
        );
        let debug = debug_sections(&path);
        assert!(debug.is_empty(), "{library} ships debug info: {debug:?}");
    }

    // Run from the empty work folder with only the installed package on the path.
    let out = run(
        Command::new(&python)
            .args([
                "-c",
                "import strata, strata._lib as l; print(strata.__file__); \
                 print(l.loaded_path()); print(strata.version())",
            ])
            .current_dir(&work)
            .env("PYTHONPATH", &site)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("STRATA_BACKEND", "host")
            .env_remove("STRATA_LIB"),
        "import strata from the installed wheel",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(Path::new(lines[0]).starts_with(&package), "{out}");
    assert_eq!(Path::new(lines[1]), package.join("libstrata.so"), "{out}");
    assert!(
        lines[2].contains(env!("CARGO_PKG_VERSION")),
        "version {:?} does not name {}",
        lines[2],
        env!("CARGO_PKG_VERSION")
    );
    std::fs::remove_dir_all(&work).expect("remove the test's folder");
}
