use super::*;
use crate::vatable::Accessor;

fn driver_here() -> bool {
    result::driver_present()
}

#[test]
fn new_without_driver_is_no_driver_not_a_panic() {
    let got = std::panic::catch_unwind(CudaBackend::new);
    let got = got.expect("CudaBackend::new must not panic");
    if driver_here() {
        // A machine with a driver: either it works or it reports a typed error.
        if let Err(e) = got {
            eprintln!("CudaBackend::new on a driver machine: {e}");
        }
        return;
    }
    match got {
        Err(Error::NoDriver(msg)) => assert!(!msg.is_empty()),
        Err(other) => panic!("expected NoDriver, got {other}"),
        Ok(_) => panic!("expected NoDriver on a machine without libcuda"),
    }
}

#[test]
fn open_is_no_driver_without_cuda() {
    let got = std::panic::catch_unwind(open).expect("open must not panic");
    if !driver_here() {
        assert!(matches!(got, Err(Error::NoDriver(_))));
    }
}

#[test]
fn auto_selection_does_not_panic() {
    let got = std::panic::catch_unwind(|| crate::open(crate::Choice::Auto));
    assert!(got.is_ok(), "open(Auto) panicked");
}

#[test]
fn result_layer_reports_no_driver_instead_of_panicking() {
    if driver_here() {
        return;
    }
    assert!(matches!(result::init(), Err(Error::NoDriver(_))));
    // Calling a verb without `init` goes through cudarc's lazy loader, which panics without
    // a library: the result layer must turn that into an error.
    assert!(matches!(result::device::count(), Err(Error::NoDriver(_))));
    assert!(matches!(
        result::va::reserve(1 << 21, 0),
        Err(Error::NoDriver(_))
    ));
    assert!(matches!(result::driver_version(), Err(Error::NoDriver(_))));
    assert!(result::memcpy::batch_fn().is_none());
    assert!(!result::symbol_present(c"cuMemcpyBatchAsync"));
}

#[test]
fn missing_nvrtc_is_unsupported_not_a_panic() {
    use super::nvrtc::{self, Image};
    let present = std::panic::catch_unwind(nvrtc::check_present).expect("no panic");
    let compiled = std::panic::catch_unwind(|| {
        nvrtc::compile(
            strata_kernels::blockcopy::CUDA_SOURCE,
            c"t.cu",
            80,
            Image::Ptx,
        )
    })
    .expect("compile must not panic");
    match present {
        Ok(()) => {
            // NVRTC here: the kernel source compiles on its own (no headers needed).
            let ptx = compiled.expect("CUDA_SOURCE compiles with NVRTC");
            assert_eq!(ptx.last(), Some(&0), "PTX is NUL-terminated");
        }
        Err(e) => {
            assert!(matches!(e, Error::Unsupported(_)), "{e}");
            assert!(matches!(compiled, Err(Error::Unsupported(_))));
            assert!(matches!(
                nvrtc::supported_archs(),
                Err(Error::Unsupported(_))
            ));
        }
    }
}

#[test]
fn access_flags_match_the_driver_values() {
    use sys::CUmemAccess_flags as F;
    assert_eq!(
        result::access::flags(Access::None),
        F::CU_MEM_ACCESS_FLAGS_PROT_NONE
    );
    assert_eq!(
        result::access::flags(Access::Read),
        F::CU_MEM_ACCESS_FLAGS_PROT_READ
    );
    assert_eq!(
        result::access::flags(Access::ReadWrite),
        F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    );
}

#[test]
fn copy_plans_coalesce_adjacent_descriptors_and_check_access() {
    let g = 1u64 << 21;
    let mut table = VaTable::new();
    let base = 0x7000_0000_0000u64;
    table.add_reservation(base, 4 * g).unwrap();
    table
        .insert_mapping(base, 2 * g, PhysHandle(1), 0, 2 * g, g)
        .unwrap();
    let d0 = Accessor::Location(Location::Device(0));
    let host = 0x1000u64;
    let copies = [
        CopyDesc {
            dst: base,
            src: host,
            len: 100,
        },
        CopyDesc {
            dst: base + 100,
            src: host + 100,
            len: 50,
        },
        CopyDesc {
            dst: base + 4096,
            src: host + 150,
            len: 10,
        },
        CopyDesc {
            dst: base + 9999,
            src: host,
            len: 0,
        },
    ];
    // No access yet: illegal.
    assert!(matches!(
        CudaBackend::plan_copies(&table, d0, &copies),
        Err(Error::IllegalAccess { .. })
    ));
    table
        .set_access(base, 2 * g, &[(Location::Device(0), Access::ReadWrite)], g)
        .unwrap();
    let plan = CudaBackend::plan_copies(&table, d0, &copies).unwrap();
    assert_eq!(plan, vec![(base, host, 150), (base + 4096, host + 150, 10)]);
    // Another device has no grant.
    let d1 = Accessor::Location(Location::Device(1));
    assert!(CudaBackend::plan_copies(&table, d1, &copies).is_err());
    // Unmapped part of the reservation.
    let bad = [CopyDesc {
        dst: base + 2 * g,
        src: host,
        len: 1,
    }];
    assert!(matches!(
        CudaBackend::plan_copies(&table, d0, &bad),
        Err(Error::IllegalAccess { .. })
    ));
    // Read-only source is fine, read-only destination is not.
    table
        .set_access(base, g, &[(Location::Device(0), Access::Read)], g)
        .unwrap();
    let from = [CopyDesc {
        dst: host,
        src: base,
        len: 8,
    }];
    assert!(CudaBackend::plan_copies(&table, d0, &from).is_ok());
    let to = [CopyDesc {
        dst: base,
        src: host,
        len: 8,
    }];
    assert!(CudaBackend::plan_copies(&table, d0, &to).is_err());
}
