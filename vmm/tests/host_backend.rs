//! The host backend against the `Backend` contract: every precondition of the VMM calls as a
//! typed error (reserve, create, map, unmap, set_access, memset), aliasing, backend selection.
//! Memory semantics are in `host_backend_memory.rs`, streams and faults in `host_backend_streams.rs`.

use strata_vmm::{
    Access, CreateFlags, Error, HostBackend, LiveCounts, Location, PhysHandle, StreamHandle,
};

mod host_support;
use host_support::*;

#[test]
fn device_queries() {
    let b = backend();
    assert_eq!(b.device_count(), 2);
    let info = b.device_info(1).unwrap();
    assert_eq!(
        (info.ordinal, info.total_memory, info.granularity),
        (1, DEV, G)
    );
    assert!(matches!(b.device_info(2), Err(Error::NoDevice(2))));
    assert_eq!(b.granularity(D1).unwrap(), G);
    assert_eq!(b.granularity(Location::Host).unwrap(), G);
    assert!(matches!(
        b.granularity(Location::Device(9)),
        Err(Error::NoDevice(9))
    ));
    let m = b.mem_info(0).unwrap();
    assert_eq!((m.free, m.total), (DEV, DEV));
    assert_eq!(b.live_counts(), LiveCounts::default());
    assert_eq!(host(&b).config().granularity, G);
}

#[test]
fn bad_configs_are_refused() {
    let mut c = config(false);
    c.granularity = 3 << 20;
    assert!(matches!(HostBackend::new(c), Err(Error::Config { .. })));
    let mut c = config(false);
    c.devices = vec![];
    assert!(matches!(HostBackend::new(c), Err(Error::Config { .. })));
}

#[test]
fn reservation_rules() {
    let b = backend();
    assert!(matches!(b.reserve(0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        b.reserve(G + 4096, 0),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(b.reserve(G, 4096), Err(Error::Misaligned { .. })));
    assert!(matches!(
        b.reserve(u64::MAX - G + 1, 2 * G),
        Err(Error::Overflow(_))
    ));
    let va = b.reserve(4 * G, 32 * G).unwrap();
    assert_eq!(va % (32 * G), 0, "alignment honoured");
    assert!(matches!(
        b.free_va(va, 2 * G),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.free_va(va + G, 2 * G),
        Err(Error::NotReserved { .. })
    ));
    let h = b.create(D0, G, CreateFlags::empty()).unwrap();
    b.map(va + G, G, h, 0).unwrap();
    assert!(matches!(
        b.free_va(va, 4 * G),
        Err(Error::StillMapped { .. })
    ));
    b.unmap(va + G, G).unwrap();
    b.release(h).unwrap();
    b.free_va(va, 4 * G).unwrap();
    assert!(matches!(
        b.free_va(va, 4 * G),
        Err(Error::NotReserved { .. })
    ));
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn create_and_release_rules() {
    let b = backend();
    assert!(matches!(
        b.create(D0, 0, CreateFlags::empty()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.create(D0, G + 1, CreateFlags::empty()),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        b.create(Location::Device(2), G, CreateFlags::empty()),
        Err(Error::NoDevice(2))
    ));
    let h = b.create(D1, 2 * G, CreateFlags::empty()).unwrap();
    assert_eq!(b.handle_size(h).unwrap(), 2 * G);
    assert_eq!(b.mem_info(1).unwrap().free, DEV - 2 * G);
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
    b.release(h).unwrap();
    assert!(matches!(b.release(h), Err(Error::InvalidHandle { .. })));
    assert!(matches!(b.handle_size(h), Err(Error::InvalidHandle { .. })));
    assert_eq!(b.mem_info(1).unwrap().free, DEV);
    let hh = b.create(Location::Host, G, CreateFlags::empty()).unwrap();
    b.release(hh).unwrap();
}

#[test]
fn map_rules() {
    let b = backend();
    let va = b.reserve(8 * G, 0).unwrap();
    let other = b.reserve(2 * G, 0).unwrap();
    let h = b.create(D0, 2 * G, CreateFlags::empty()).unwrap();
    assert!(matches!(b.map(va, 0, h, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        b.map(va + 4096, G, h, 0),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        b.map(va, G + 4096, h, 0),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        b.map(va, G, h, 4096),
        Err(Error::Misaligned { .. })
    ));
    assert!(
        matches!(b.map(va, 4 * G, h, 0), Err(Error::InvalidArgument(_))),
        "size > handle"
    );
    // The real driver maps handles from offset 0 only (CUDA_ERROR_NOT_SUPPORTED on an H200).
    assert!(
        matches!(b.map(va, G, h, G), Err(Error::Unsupported(_))),
        "non-zero offset"
    );
    assert!(matches!(
        b.map(va, G, h, u64::MAX - G + 1),
        Err(Error::Unsupported(_))
    ));
    assert_eq!(b.live_counts().mappings, 0, "a refused map leaves nothing");
    assert!(matches!(
        b.map(u64::MAX - G + 1, 2 * G, h, 0),
        Err(Error::Overflow(_))
    ));
    assert!(
        matches!(
            b.map(va + 7 * G, 2 * G, h, 0),
            Err(Error::NotReserved { .. })
        ),
        "crosses the end"
    );
    assert!(matches!(b.map(G, G, h, 0), Err(Error::NotReserved { .. })));
    assert!(matches!(
        b.map(va, G, PhysHandle(999), 0),
        Err(Error::InvalidHandle { .. })
    ));
    b.map(va + 2 * G, 2 * G, h, 0).unwrap();
    assert!(matches!(
        b.map(va + 3 * G, G, h, 0),
        Err(Error::AlreadyMapped { .. })
    ));
    assert!(matches!(
        b.map(va + G, 2 * G, h, 0),
        Err(Error::AlreadyMapped { .. })
    ));
    // The same handle again elsewhere (and in another reservation) is fine, a prefix too.
    b.map(va + 4 * G, G, h, 0).unwrap();
    b.map(other, 2 * G, h, 0).unwrap();
    assert_eq!(b.live_counts().mappings, 3);
    b.release(h).unwrap();
    assert!(
        matches!(b.map(va, G, h, 0), Err(Error::InvalidHandle { .. })),
        "released handle"
    );
    b.unmap(va + 2 * G, 3 * G).unwrap();
    b.unmap(other, 2 * G).unwrap();
    b.free_va(va, 8 * G).unwrap();
    b.free_va(other, 2 * G).unwrap();
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn unmap_rules() {
    let b = backend();
    let va = b.reserve(8 * G, 0).unwrap();
    let h = b.create(D0, 4 * G, CreateFlags::empty()).unwrap();
    b.map(va, 2 * G, h, 0).unwrap();
    b.map(va + 2 * G, 2 * G, h, 0).unwrap();
    b.map(va + 5 * G, G, h, 0).unwrap();
    assert!(matches!(b.unmap(va, G), Err(Error::PartialUnmap { .. })));
    assert!(matches!(
        b.unmap(va + G, 2 * G),
        Err(Error::PartialUnmap { .. })
    ));
    assert!(
        matches!(b.unmap(va + 2 * G, 4 * G), Err(Error::NotMapped { .. })),
        "hole at 4G"
    );
    assert!(matches!(
        b.unmap(va + 6 * G, G),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        b.unmap(va + 7 * G, 2 * G),
        Err(Error::NotReserved { .. })
    ));
    assert!(matches!(b.unmap(va, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.unmap(va + 1, G), Err(Error::Misaligned { .. })));
    assert_eq!(b.live_counts().mappings, 3, "failed unmaps change nothing");
    b.unmap(va, 4 * G).unwrap();
    b.unmap(va + 5 * G, G).unwrap();
    b.release(h).unwrap();
    b.free_va(va, 8 * G).unwrap();
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn set_access_rules() {
    let b = backend();
    let va = b.reserve(4 * G, 0).unwrap();
    let h = b.create(D0, 2 * G, CreateFlags::empty()).unwrap();
    assert!(matches!(
        b.set_access(va, G, &[(D0, RW)]),
        Err(Error::NotMapped { .. })
    ));
    b.map(va, 2 * G, h, 0).unwrap();
    assert!(matches!(
        b.set_access(va, 3 * G, &[(D0, RW)]),
        Err(Error::NotMapped { .. })
    ));
    assert!(matches!(
        b.set_access(va, G, &[(Location::Device(5), RW)]),
        Err(Error::NoDevice(5))
    ));
    assert!(matches!(
        b.set_access(va, G + 1, &[(D0, RW)]),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        b.set_access(va + 4 * G, G, &[(D0, RW)]),
        Err(Error::NotReserved { .. })
    ));
    b.set_access(va + G, G, &[(D0, RW)]).unwrap();
    let mut buf = [0u8; 16];
    b.read(va + G, &mut buf).unwrap();
    assert!(
        matches!(b.read(va, &mut buf), Err(Error::IllegalAccess { .. })),
        "first half still has no access"
    );
    b.unmap(va, 2 * G).unwrap();
    b.release(h).unwrap();
    b.free_va(va, 4 * G).unwrap();
}

#[test]
fn fresh_mapping_has_no_access() {
    let b = backend();
    let (va, h) = mapped(&b, G, &[]);
    let data = pattern(4096, 1);
    assert!(matches!(
        b.write(va, &data),
        Err(Error::IllegalAccess { .. })
    ));
    b.set_access(va, G, &[(D0, Access::Read)]).unwrap();
    assert!(
        matches!(b.write(va, &data), Err(Error::IllegalAccess { .. })),
        "read-only"
    );
    let mut out = vec![1u8; 4096];
    b.read(va, &mut out).unwrap();
    assert!(
        out.iter().all(|&x| x == 0),
        "fresh memory reads as zero here"
    );
    b.set_access(va, G, &[(D0, RW)]).unwrap();
    b.write(va, &data).unwrap();
    b.read(va, &mut out).unwrap();
    assert_eq!(out, data);
    // Remap at the same VA: no access again, although the bytes are still there.
    b.unmap(va, G).unwrap();
    b.map(va, G, h, 0).unwrap();
    assert!(matches!(
        b.read(va, &mut out),
        Err(Error::IllegalAccess { .. })
    ));
    b.set_access(va, G, &[(D1, Access::Read)]).unwrap();
    b.read(va, &mut out).unwrap();
    assert_eq!(out, data);
    // Copies straddling a reservation's boundary or into unmapped VA are illegal.
    assert!(matches!(
        b.read(va + G - 8, &mut out),
        Err(Error::IllegalAccess { .. })
    ));
    teardown(&b, va, G, h);
}

#[test]
fn created_streams_need_a_grant_for_their_device() {
    let b = backend();
    let (va, h) = mapped(&b, G, &[(D1, RW)]);
    let s0 = b.stream_create(0).unwrap();
    let s1 = b.stream_create(1).unwrap();
    let data = pattern(1024, 3);
    assert!(matches!(
        copy(&b, s0, va, data.as_ptr() as u64, 1024),
        Err(Error::IllegalAccess { .. })
    ));
    copy(&b, s1, va, data.as_ptr() as u64, 1024).unwrap();
    b.stream_synchronize(s1).unwrap();
    let mut out = vec![0u8; 1024];
    b.read(va, &mut out).unwrap();
    assert_eq!(out, data);
    assert!(matches!(b.stream_create(2), Err(Error::NoDevice(2))));
    b.stream_destroy(s0).unwrap();
    b.stream_destroy(s1).unwrap();
    assert!(matches!(
        b.stream_destroy(s1),
        Err(Error::InvalidHandle { .. })
    ));
    assert!(matches!(
        b.stream_synchronize(s1),
        Err(Error::InvalidHandle { .. })
    ));
    teardown(&b, va, G, h);
}

#[test]
fn one_handle_at_two_vas_shows_the_same_bytes() {
    let b = backend();
    let size = 2 * G;
    let a = b.reserve(size, 0).unwrap();
    let c = b.reserve(size, 0).unwrap();
    let h = b.create(D0, size, CreateFlags::empty()).unwrap();
    b.map(a, size, h, 0).unwrap();
    // A prefix of the handle (offsets other than 0 are refused, as by the real driver).
    b.map(c, G, h, 0).unwrap();
    b.set_access(a, size, &[(D0, RW)]).unwrap();
    b.set_access(c, G, &[(D0, RW)]).unwrap();
    let data = pattern(64 << 10, 9);
    b.write(a + 4096, &data).unwrap();
    let mut out = vec![0u8; data.len()];
    b.read(c + 4096, &mut out).unwrap();
    assert_eq!(out, data);
    // And back the other way, device to device.
    b.memset_async(StreamHandle::DEFAULT, c, 0xab, 100).unwrap();
    let mut head = [0u8; 101];
    b.read(a, &mut head).unwrap();
    assert!(head[..100].iter().all(|&x| x == 0xab) && head[100] == 0);
    copy(&b, StreamHandle::DEFAULT, a + G, c + 4096, 4096).unwrap();
    let mut first = vec![0u8; 4096];
    b.read(a + G, &mut first).unwrap();
    assert_eq!(first, data[..4096]);
    b.unmap(a, size).unwrap();
    b.unmap(c, G).unwrap();
    b.release(h).unwrap();
    b.free_va(a, size).unwrap();
    b.free_va(c, size).unwrap();
}

#[test]
fn memset_rules() {
    let b = backend();
    let (va, h) = mapped(&b, G, &[(D0, Access::Read)]);
    let s = StreamHandle::DEFAULT;
    assert!(
        matches!(
            b.memset_async(s, va, 1, 64),
            Err(Error::IllegalAccess { .. })
        ),
        "read-only"
    );
    let mut host_buf = vec![0u8; 64];
    assert!(matches!(
        b.memset_async(s, host_buf.as_mut_ptr() as u64, 1, 64),
        Err(Error::IllegalAccess { .. })
    ));
    b.set_access(va, G, &[(D0, RW)]).unwrap();
    b.memset_async(s, va, 7, G).unwrap();
    b.read(va + G - 64, &mut host_buf).unwrap();
    assert!(host_buf.iter().all(|&x| x == 7));
    teardown(&b, va, G, h);
}

#[test]
fn selection_opens_the_host_backend() {
    let b = strata_vmm::open(strata_vmm::Choice::Host).unwrap();
    assert_eq!(b.kind(), strata_vmm::BackendKind::Host);
    assert!(b.as_any().downcast_ref::<HostBackend>().is_some());
    assert!(b.device_count() >= 1);
}

/// The CUDA driver refuses host (`CU_MEM_LOCATION_TYPE_HOST_NUMA`) access over memory of
/// another location (`cuMemSetAccess`); the host backend follows it (it accepted it before).
#[test]
fn host_access_is_granted_only_over_host_memory() {
    let b = backend();
    let va = b.reserve(2 * G, 0).unwrap();
    let dh = b.create(D0, G, CreateFlags::empty()).unwrap();
    let hh = b.create(Location::Host, G, CreateFlags::empty()).unwrap();
    b.map(va, G, dh, 0).unwrap();
    b.map(va + G, G, hh, 0).unwrap();
    let host_rw = [(Location::Host, RW)];
    assert!(matches!(
        b.set_access(va, G, &host_rw),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.set_access(va, 2 * G, &host_rw),
        Err(Error::InvalidArgument(_))
    ));
    b.set_access(va + G, G, &[(Location::Host, RW), (D0, RW)])
        .unwrap();
    b.set_access(va, G, &[(D0, RW)]).unwrap();
    b.unmap(va, 2 * G).unwrap();
    b.release(dh).unwrap();
    b.release(hh).unwrap();
    b.free_va(va, 2 * G).unwrap();
}
