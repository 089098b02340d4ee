//! The CUDA backend over NVIDIA's real libraries where they run without a GPU: the driver
//! (`libcuda.so.1`, CUDA 12.2 from Debian's `libcuda1`) and NVRTC (`libnvrtc.so.12`), installed
//! by `.ci/cuda-libs` into `target/cuda-libs/lib` (or the folder `STRATA_CUDA_LIBS` names).
//!
//! Every test re-runs itself in a child process with that folder on `LD_LIBRARY_PATH`
//! (`child.rs`). Without the libraries a test prints why and passes as skipped; with
//! `STRATA_CUDA_REPORT` set, each appends `ran NAME` or `skipped NAME` to that file (`.ci/run`
//! counts them).

use super::{launch, result, CudaBackend};
use crate::error::Error;
use crate::types::BackendKind;

fn report(outcome: &str, test: &str) {
    strata_test_support::report(&format!("{outcome} vmm::{test}"));
}

/// True in the child (run the checks). In the parent: runs `test` in a child with the libraries
/// on the library path (or prints that it is skipped), then returns false.
fn in_child(test: &str) -> bool {
    if super::child::is_child() {
        return true;
    }
    let name = format!(
        "{}::{test}",
        module_path!().trim_start_matches("strata_vmm::")
    );
    let Some(dir) = strata_test_support::cuda_libs() else {
        eprintln!(
            "skipped {name}: NVIDIA's CUDA libraries are not installed (run .ci/cuda-libs or set STRATA_CUDA_LIBS)"
        );
        report("skipped", &name);
        return false;
    };
    super::child::rerun(module_path!(), test, dir.as_os_str(), &[]);
    report("ran", &name);
    false
}

#[test]
fn real_driver_exports_every_symbol_strata_calls() {
    if !in_child("real_driver_exports_every_symbol_strata_calls") {
        return;
    }
    assert!(result::driver_present());
    assert_eq!(
        result::missing_symbols(result::REQUIRED_SYMBOLS),
        Vec::<String>::new()
    );
    assert_eq!(
        result::missing_symbols(result::KERNEL_SYMBOLS),
        Vec::<String>::new()
    );
    let version = result::driver_version().expect("cuDriverGetVersion needs no device");
    println!("driver version {version}");
    assert!((12000..12080).contains(&version), "{version}");
}

#[test]
fn real_driver_without_a_device_is_a_typed_error() {
    if !in_child("real_driver_without_a_device_is_a_typed_error") {
        return;
    }
    let got = std::panic::catch_unwind(CudaBackend::new).expect("CudaBackend::new must not panic");
    match got {
        Err(Error::NoDriver(msg)) => {
            // The driver's own name for the code, through the real cuGetErrorName.
            assert!(msg.contains("CUDA_ERROR_NO_DEVICE"), "{msg}");
        }
        Err(other) => panic!("expected NoDriver, got {other}"),
        Ok(_) => panic!("a backend opened without a device"),
    }
    // A verb called after the failed cuInit: a typed driver error, never a panic.
    match result::device::count() {
        Err(Error::Driver { name, .. }) => println!("cuDeviceGetCount after cuInit failed: {name}"),
        other => panic!("expected a driver error, got {other:?}"),
    }
    assert!(matches!(
        crate::open(crate::Choice::Cuda),
        Err(Error::NoDriver(_))
    ));
}

#[test]
fn real_driver_auto_selects_host_and_says_why() {
    if !in_child("real_driver_auto_selects_host_and_says_why") {
        return;
    }
    let (backend, why) = crate::open_explained(crate::Choice::Auto).expect("auto opens a backend");
    assert_eq!(backend.kind(), BackendKind::Host);
    let why = why.expect("auto says why it fell back");
    assert!(why.contains("CUDA_ERROR_NO_DEVICE"), "{why}");
}

#[test]
fn real_driver_older_than_12_8_gets_no_batch_copies() {
    if !in_child("real_driver_older_than_12_8_gets_no_batch_copies") {
        return;
    }
    let version = result::driver_version().unwrap();
    assert!(version < 12080, "{version}");
    // Detected and avoided: no pointer to call, whether or not the library exports the name.
    assert!(result::memcpy::batch_fn().is_none());
    println!(
        "cuMemcpyBatchAsync exported by the {version} driver: {}",
        result::symbol_present(c"cuMemcpyBatchAsync")
    );
}

#[test]
fn real_nvrtc_compiles_the_block_copy_kernel_for_sm80_and_sm90_without_warnings() {
    if !in_child("real_nvrtc_compiles_the_block_copy_kernel_for_sm80_and_sm90_without_warnings") {
        return;
    }
    super::nvrtc::check_present().expect("libnvrtc with every symbol strata calls");
    let supported = super::nvrtc::supported_archs().unwrap();
    let kernel = strata_kernels::blockcopy::KERNEL_NAME;
    for cc in [80, 90] {
        let targets = launch::targets(cc, &supported);
        assert_eq!(
            targets,
            vec![
                (super::nvrtc::Image::Cubin, cc),
                (super::nvrtc::Image::Ptx, cc)
            ],
            "NVRTC supports {supported:?}"
        );
        for (image, arch) in targets {
            let (bytes, log) = launch::compile_kernel(arch, image).unwrap();
            assert!(log.is_empty(), "{image:?} sm_{arch}: NVRTC says: {log}");
            match image {
                super::nvrtc::Image::Ptx => {
                    let ptx = String::from_utf8_lossy(&bytes);
                    assert!(ptx.contains(&format!(".target sm_{arch}")), "{ptx}");
                    assert!(ptx.contains(&format!(".entry {kernel}(")), "{ptx}");
                }
                super::nvrtc::Image::Cubin => {
                    assert_eq!(&bytes[..4], b"\x7fELF");
                    let name = kernel.as_bytes();
                    assert!(bytes.windows(name.len()).any(|w| w == name));
                }
            }
        }
    }
}
