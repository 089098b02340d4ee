//! The host backend against the `Backend` contract: every precondition as a typed error, real
//! memory semantics (aliasing, release, sparse reservations, export/import), streams and events,
//! fault injection and strict mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_vmm::host::{FaultOp, Link, LinkModel};
use strata_vmm::{
    Access, Backend, CopyDesc, CreateFlags, Error, HostBackend, HostConfig, LiveCounts, Location,
    PhysHandle, StreamHandle,
};

const G: u64 = 2 << 20;
const DEV: u64 = 64 << 20;
const D0: Location = Location::Device(0);
const D1: Location = Location::Device(1);
const RW: Access = Access::ReadWrite;

fn config(strict: bool) -> HostConfig {
    HostConfig {
        devices: vec![DEV, DEV],
        granularity: G,
        strict,
        link: None,
    }
}

fn backend() -> Arc<dyn Backend> {
    strata_vmm::host::open(config(true)).unwrap()
}

fn host(b: &Arc<dyn Backend>) -> &HostBackend {
    b.as_any().downcast_ref::<HostBackend>().unwrap()
}

/// Reserve + create + map + grant `grants`; returns (reservation, handle).
fn mapped(b: &Arc<dyn Backend>, size: u64, grants: &[(Location, Access)]) -> (u64, PhysHandle) {
    let va = b.reserve(size, 0).unwrap();
    let h = b.create(D0, size, CreateFlags::empty()).unwrap();
    b.map(va, size, h, 0).unwrap();
    if !grants.is_empty() {
        b.set_access(va, size, grants).unwrap();
    }
    (va, h)
}

fn teardown(b: &Arc<dyn Backend>, va: u64, size: u64, h: PhysHandle) {
    b.unmap(va, size).unwrap();
    b.release(h).unwrap();
    b.free_va(va, size).unwrap();
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Copies on `stream` (host ranges borrowed until the caller synchronizes).
fn copy(
    b: &Arc<dyn Backend>,
    stream: StreamHandle,
    dst: u64,
    src: u64,
    len: u64,
) -> Result<(), Error> {
    // SAFETY: every caller keeps its host buffers alive and untouched until it synchronizes
    // `stream`, as the contract requires.
    unsafe { b.copy_async(stream, &[CopyDesc { dst, src, len }]) }
}

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
fn release_really_returns_memory() {
    let b = backend();
    let hb = host(&b);
    let base = hb.resident_bytes(D0).unwrap();
    let size = 4 * G;
    let a = b.reserve(size, 0).unwrap();
    let c = b.reserve(size, 0).unwrap();
    let h = b.create(D0, size, CreateFlags::empty()).unwrap();
    b.map(a, size, h, 0).unwrap();
    b.map(c, size, h, 0).unwrap();
    b.set_access(a, size, &[(D0, RW)]).unwrap();
    b.memset_async(StreamHandle::DEFAULT, a, 0x5a, size)
        .unwrap();
    let touched = hb.resident_bytes(D0).unwrap();
    assert!(touched >= base + size, "{touched} < {base} + {size}");
    b.release(h).unwrap();
    assert_eq!(b.live_counts().handles, 0);
    assert_eq!(
        hb.resident_bytes(D0).unwrap(),
        touched,
        "still mapped twice"
    );
    assert_eq!(
        b.mem_info(0).unwrap().free,
        DEV - size,
        "capacity held while mapped"
    );
    b.unmap(a, size).unwrap();
    assert_eq!(hb.resident_bytes(D0).unwrap(), touched, "still mapped once");
    b.unmap(c, size).unwrap();
    assert_eq!(
        hb.resident_bytes(D0).unwrap(),
        base,
        "last unmap returns the memory"
    );
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
    b.free_va(a, size).unwrap();
    b.free_va(c, size).unwrap();
}

fn vm_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Rss (bytes) of the /proc/self/smaps entries inside `va..va+size`.
fn smaps_rss(va: u64, size: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((s, e)) = first.split_once('-') {
            if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) {
                inside = s >= va && e <= va + size;
                continue;
            }
        }
        if inside && line.starts_with("Rss:") {
            total += line
                .split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<u64>()
                .unwrap()
                * 1024;
        }
    }
    total
}

#[test]
fn reserving_a_tebibyte_costs_no_memory() {
    let b = backend();
    let base = host(&b).resident_bytes(D0).unwrap();
    let tib = 1u64 << 40;
    let va = b.reserve(tib, 0).unwrap();
    assert_eq!(smaps_rss(va, tib), 0);
    assert_eq!(host(&b).resident_bytes(D0).unwrap(), base);
    b.free_va(va, tib).unwrap();
    // VmRSS is process-wide, so measure it in a child process running only the probe below.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "vm_rss_probe_for_reserve",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "run by reserving_a_tebibyte_costs_no_memory in a child process"]
fn vm_rss_probe_for_reserve() {
    let b = backend();
    let before = vm_rss_bytes();
    let tib = 1u64 << 40;
    let va = b.reserve(tib, 0).unwrap();
    let after = vm_rss_bytes();
    assert!(
        after < before + (16 << 20),
        "VmRSS grew {} bytes",
        after - before
    );
    b.free_va(va, tib).unwrap();
}

#[test]
fn beyond_capacity_is_out_of_memory_and_leaks_nothing() {
    let b = backend();
    let base_counts = b.live_counts();
    let mut handles = Vec::new();
    for _ in 0..(DEV / (8 * G)) {
        handles.push(b.create(D0, 8 * G, CreateFlags::empty()).unwrap());
    }
    assert_eq!(b.mem_info(0).unwrap().free, 0);
    let err = b.create(D0, G, CreateFlags::empty()).unwrap_err();
    assert!(err.is_out_of_memory());
    assert!(matches!(
        err,
        Error::OutOfMemory {
            location: D0,
            requested: G,
            available: 0
        }
    ));
    assert!(matches!(
        b.create(D0, G, CreateFlags::EXPORTABLE),
        Err(Error::OutOfMemory { .. })
    ));
    // The other device is unaffected.
    let other = b.create(D1, DEV, CreateFlags::empty()).unwrap();
    assert!(matches!(
        b.create(D1, DEV + G, CreateFlags::empty()),
        Err(Error::OutOfMemory { .. })
    ));
    b.release(other).unwrap();
    assert_eq!(b.live_counts().handles, handles.len() as u64);
    b.release(handles.pop().unwrap()).unwrap();
    let h = b.create(D0, 8 * G, CreateFlags::EXPORTABLE).unwrap();
    b.release(h).unwrap();
    for h in handles {
        b.release(h).unwrap();
    }
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
    assert_eq!(b.mem_info(1).unwrap().free, DEV);
    assert_eq!(b.live_counts(), base_counts);
    // Fragmentation of the offset space never blocks what capacity allows.
    let small: Vec<_> = (0..DEV / G)
        .map(|_| b.create(D0, G, CreateFlags::empty()).unwrap())
        .collect();
    let mut kept = Vec::new();
    for (i, h) in small.into_iter().enumerate() {
        if i % 2 == 0 {
            b.release(h).unwrap();
        } else {
            kept.push(h);
        }
    }
    let big: Vec<_> = (0..DEV / (4 * G))
        .map(|_| b.create(D0, 2 * G, CreateFlags::empty()).unwrap())
        .collect();
    assert_eq!(b.mem_info(0).unwrap().free, 0);
    for h in kept.into_iter().chain(big) {
        b.release(h).unwrap();
    }
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
}

#[test]
fn export_import_shows_the_same_bytes() {
    use std::os::fd::AsFd;
    let b = backend();
    let size = 2 * G;
    let plain = b.create(D0, G, CreateFlags::empty()).unwrap();
    assert!(matches!(b.export_fd(plain), Err(Error::InvalidArgument(_))));
    b.release(plain).unwrap();
    let h = b.create(D0, size, CreateFlags::EXPORTABLE).unwrap();
    assert_eq!(
        b.mem_info(0).unwrap().free,
        DEV - size,
        "exportable memory is charged"
    );
    let a = b.reserve(size, 0).unwrap();
    b.map(a, size, h, 0).unwrap();
    b.set_access(a, size, &[(D0, RW)]).unwrap();
    let data = pattern(8192, 42);
    b.write(a + G, &data).unwrap();
    let fd = b.export_fd(h).unwrap();
    let imported = b.import_fd(fd.as_fd()).unwrap();
    drop(fd); // import_fd does not take ownership: the handle keeps its own reference.
    assert_eq!(b.handle_size(imported).unwrap(), size);
    assert_eq!(b.live_counts().handles, 2);
    b.unmap(a, size).unwrap();
    b.release(h).unwrap();
    assert_eq!(
        b.mem_info(0).unwrap().free,
        DEV,
        "capacity returns with the creation reference"
    );
    // A second backend (as another process would) sees the same bytes through the fd.
    let b2 = backend();
    let fd = b.export_fd(imported).unwrap();
    let h2 = b2.import_fd(fd.as_fd()).unwrap();
    let c = b2.reserve(size, 0).unwrap();
    b2.map(c, size, h2, 0).unwrap();
    b2.set_access(c, size, &[(D1, Access::Read)]).unwrap();
    let mut out = vec![0u8; data.len()];
    b2.read(c + G, &mut out).unwrap();
    assert_eq!(out, data);
    teardown(&b2, c, size, h2);
    b.map(a, size, imported, 0).unwrap();
    b.set_access(a, size, &[(D0, Access::Read)]).unwrap();
    let mut out = vec![0u8; data.len()];
    b.read(a + G, &mut out).unwrap();
    assert_eq!(out, data);
    teardown(&b, a, size, imported);
    assert_eq!(b.live_counts(), LiveCounts::default());
    // Not a memory file.
    let dir = std::fs::File::open("/proc/self").unwrap();
    assert!(b.import_fd(dir.as_fd()).is_err());
}

#[test]
fn streams_run_in_order() {
    let b = backend();
    let (va, h) = mapped(&b, G, &[(D0, RW)]);
    let s = b.stream_create(0).unwrap();
    let bufs: Vec<Vec<u8>> = (0..20).map(|i| vec![i as u8; 4096]).collect();
    for buf in &bufs {
        copy(&b, s, va, buf.as_ptr() as u64, 4096).unwrap();
    }
    let mut out = vec![0u8; 4096];
    // Device → host after the writes, same stream: sees the last one.
    copy(&b, s, out.as_mut_ptr() as u64, va, 4096).unwrap();
    b.stream_synchronize(s).unwrap();
    assert!(out.iter().all(|&x| x == 19));
    // A batch with several descriptors runs in order too.
    let src = pattern(4096, 5);
    let mut back = vec![0u8; 4096];
    let batch = [
        CopyDesc {
            dst: va + 8192,
            src: src.as_ptr() as u64,
            len: 4096,
        },
        CopyDesc {
            dst: va + 65536,
            src: va + 8192,
            len: 4096,
        },
        CopyDesc {
            dst: back.as_mut_ptr() as u64,
            src: va + 65536,
            len: 4096,
        },
    ];
    // SAFETY: `src` and `back` outlive the synchronize below and nobody else touches them.
    unsafe { b.copy_async(s, &batch).unwrap() };
    b.stream_synchronize(s).unwrap();
    assert_eq!(back, src);
    b.stream_destroy(s).unwrap();
    teardown(&b, va, G, h);
}

fn slow_config() -> HostConfig {
    let link = Link {
        bandwidth: 100e6,
        latency: Duration::from_millis(1),
    };
    HostConfig {
        link: Some(LinkModel {
            host_to_device: link,
            device_to_host: link,
            device_to_device: link,
        }),
        ..config(true)
    }
}

#[test]
fn events_order_work_across_streams() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let len = 8u64 << 20; // ~84 ms on the modelled link
    let (va, h) = mapped(&b, 4 * G, &[(D0, RW)]);
    let a = b.stream_create(0).unwrap();
    let s = b.stream_create(0).unwrap();
    let ev = b.event_create().unwrap();
    assert!(b.event_query(ev).unwrap(), "never recorded: complete");
    let src = pattern(len as usize, 77);
    let mut out = vec![0u8; len as usize];
    let start = Instant::now();
    copy(&b, a, va, src.as_ptr() as u64, len).unwrap();
    b.event_record(ev, a).unwrap();
    assert!(
        !b.event_query(ev).unwrap(),
        "the slow copy is still running"
    );
    b.stream_wait_event(s, ev).unwrap();
    copy(&b, s, out.as_mut_ptr() as u64, va, len).unwrap();
    b.stream_synchronize(s).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(160),
        "both copies took modelled time"
    );
    assert!(b.event_query(ev).unwrap());
    assert!(out == src, "stream s read only after the event");
    // Event synchronize and a wait on the default stream block the host.
    copy(&b, a, va, src.as_ptr() as u64, 1 << 20).unwrap();
    b.event_record(ev, a).unwrap();
    b.event_synchronize(ev).unwrap();
    assert!(b.event_query(ev).unwrap());
    b.event_record(ev, StreamHandle::DEFAULT).unwrap();
    assert!(b.event_query(ev).unwrap());
    b.stream_wait_event(StreamHandle::DEFAULT, ev).unwrap();
    b.event_destroy(ev).unwrap();
    assert!(matches!(
        b.event_query(ev),
        Err(Error::InvalidHandle { .. })
    ));
    assert!(matches!(
        b.event_destroy(ev),
        Err(Error::InvalidHandle { .. })
    ));
    b.stream_destroy(a).unwrap();
    b.stream_destroy(s).unwrap();
    teardown(&b, va, 4 * G, h);
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn link_model_applies_on_the_default_stream() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let (va, h) = mapped(&b, 2 * G, &[(D0, RW)]);
    let data = vec![1u8; 2 << 20];
    let start = Instant::now();
    b.write(va, &data).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(20));
    teardown(&b, va, 2 * G, h);
}

#[test]
fn execution_time_errors_surface_at_synchronize() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let (va, h) = mapped(&b, 4 * G, &[(D0, RW)]);
    let (vb, hb) = mapped(&b, G, &[(D0, RW)]);
    let s = b.stream_create(0).unwrap();
    let ev = b.event_create().unwrap();
    let src = pattern(4 << 20, 1);
    let mut out = vec![0u8; 4096];
    copy(&b, s, va, src.as_ptr() as u64, 4 << 20).unwrap(); // ~43 ms
    copy(&b, s, out.as_mut_ptr() as u64, vb, 4096).unwrap(); // valid now...
    b.event_record(ev, s).unwrap();
    // ...but its source is gone by the time it runs (callers must sync before unmapping; this
    // one does not, which on a GPU is an illegal address).
    b.unmap(vb, G).unwrap();
    let err = b.stream_synchronize(s).unwrap_err();
    assert!(
        matches!(err, Error::Async { stream, .. } if stream == s.0),
        "{err}"
    );
    assert!(b.event_query(ev).unwrap(), "later events still complete");
    b.stream_synchronize(s).unwrap();
    // The stream still works.
    let mut back = vec![0u8; 4096];
    copy(&b, s, back.as_mut_ptr() as u64, va, 4096).unwrap();
    b.stream_synchronize(s).unwrap();
    assert_eq!(back, src[..4096]);
    // An error pending at destroy is reported there.
    b.map(vb, G, hb, 0).unwrap();
    b.set_access(vb, G, &[(D0, RW)]).unwrap();
    copy(&b, s, va, src.as_ptr() as u64, 4 << 20).unwrap();
    copy(&b, s, out.as_mut_ptr() as u64, vb, 4096).unwrap();
    b.unmap(vb, G).unwrap();
    assert!(matches!(b.stream_destroy(s), Err(Error::Async { .. })));
    assert_eq!(b.live_counts().streams, 0);
    b.event_destroy(ev).unwrap();
    b.release(hb).unwrap();
    b.free_va(vb, G).unwrap();
    teardown(&b, va, 4 * G, h);
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn injected_faults_fail_the_nth_call_and_leak_nothing() {
    let b = backend();
    let hb = host(&b);
    let baseline = b.live_counts();
    let va = b.reserve(4 * G, 0).unwrap();

    hb.inject_fault(FaultOp::Create, 2);
    let h1 = b.create(D0, G, CreateFlags::empty()).unwrap();
    assert!(matches!(
        b.create(D0, G, CreateFlags::empty()),
        Err(Error::InjectedFault("create"))
    ));
    assert_eq!(
        b.mem_info(0).unwrap().free,
        DEV - G,
        "the failed create charged nothing"
    );
    let h2 = b.create(D0, G, CreateFlags::empty()).unwrap();

    hb.inject_fault(FaultOp::Map, 1);
    assert!(matches!(
        b.map(va, G, h1, 0),
        Err(Error::InjectedFault("map"))
    ));
    assert_eq!(b.live_counts().mappings, 0);
    b.map(va, G, h1, 0).unwrap();
    b.map(va + G, G, h2, 0).unwrap();

    hb.inject_fault(FaultOp::SetAccess, 2);
    b.set_access(va, G, &[(D0, RW)]).unwrap();
    assert!(matches!(
        b.set_access(va + G, G, &[(D0, RW)]),
        Err(Error::InjectedFault("set_access"))
    ));
    let mut buf = [0u8; 8];
    assert!(
        matches!(b.read(va + G, &mut buf), Err(Error::IllegalAccess { .. })),
        "no grant was made"
    );
    b.set_access(va + G, G, &[(D0, RW)]).unwrap();

    hb.inject_fault(FaultOp::Copy, 3);
    b.write(va, &[1; 8]).unwrap();
    b.write(va, &[2; 8]).unwrap();
    assert!(matches!(
        b.write(va, &[3; 8]),
        Err(Error::InjectedFault("copy"))
    ));
    b.read(va, &mut buf).unwrap();
    assert_eq!(buf, [2; 8], "the failed copy wrote nothing");

    hb.inject_fault(FaultOp::Create, 1);
    hb.clear_faults();
    let h3 = b.create(D0, G, CreateFlags::empty()).unwrap();

    b.unmap(va, 2 * G).unwrap();
    for h in [h1, h2, h3] {
        b.release(h).unwrap();
    }
    b.free_va(va, 4 * G).unwrap();
    assert_eq!(b.live_counts(), baseline);
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
}

/// The permissions column of the /proc/self/maps line that starts at `va`.
fn perms_at(va: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let prefix = format!("{va:x}-");
    let line = maps
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("{va:#x} not in maps"));
    line.split_whitespace().nth(1).unwrap().to_string()
}

#[test]
fn strict_mode_never_exposes_device_memory_to_the_cpu() {
    let b = backend();
    let (va, h) = mapped(&b, G, &[]);
    assert_eq!(perms_at(va), "---s");
    b.set_access(va, G, &[(D0, RW)]).unwrap();
    assert_eq!(
        perms_at(va),
        "---s",
        "strict: grants never reach the CPU view"
    );
    b.write(va, b"device bytes").unwrap();
    let mut out = [0u8; 12];
    b.read(va, &mut out).unwrap();
    assert_eq!(&out, b"device bytes");
    teardown(&b, va, G, h);
}

#[test]
fn non_strict_mode_lets_the_cpu_look() {
    let b = strata_vmm::host::open(config(false)).unwrap();
    let (va, h) = mapped(&b, 2 * G, &[]);
    assert_eq!(perms_at(va), "---s", "fresh mapping: no access");
    b.set_access(va, G, &[(D0, Access::Read)]).unwrap();
    assert_eq!(perms_at(va), "r--s");
    b.set_access(va, 2 * G, &[(D1, RW)]).unwrap();
    assert_eq!(perms_at(va), "rw-s");
    b.write(va + 100, b"look").unwrap();
    // SAFETY: non-strict mode maps the range readable and writable (checked above); 4 bytes at
    // va+100 lie inside the mapping and nothing writes them concurrently.
    let seen = unsafe { std::slice::from_raw_parts((va + 100) as *const u8, 4) }.to_vec();
    assert_eq!(seen, b"look");
    b.set_access(va, 2 * G, &[(D0, Access::None), (D1, Access::None)])
        .unwrap();
    assert_eq!(perms_at(va), "---s");
    b.unmap(va, 2 * G).unwrap();
    assert_eq!(
        perms_at(va),
        "---p",
        "unmap puts the private reservation back"
    );
    b.release(h).unwrap();
    b.free_va(va, 2 * G).unwrap();
}

#[test]
fn concurrent_use_from_many_threads() {
    let b = backend();
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let s = b.stream_create(u32::from(t % 2)).unwrap();
                for i in 0..20u8 {
                    let (va, h) = mapped(&b, G, &[(Location::Device(u32::from(t % 2)), RW)]);
                    let data = vec![t ^ i; 4096];
                    let mut out = vec![0u8; 4096];
                    copy(&b, s, va, data.as_ptr() as u64, 4096).unwrap();
                    copy(&b, s, out.as_mut_ptr() as u64, va, 4096).unwrap();
                    b.stream_synchronize(s).unwrap();
                    assert_eq!(out, data);
                    teardown(&b, va, G, h);
                }
                b.stream_destroy(s).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(b.live_counts(), LiveCounts::default());
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
}

#[test]
fn dropping_the_backend_with_live_objects_cleans_up() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let (va, _h) = mapped(&b, G, &[(D0, RW)]);
    let s = b.stream_create(0).unwrap();
    let _ev = b.event_create().unwrap();
    let src = vec![3u8; 1 << 20];
    copy(&b, s, va, src.as_ptr() as u64, 1 << 20).unwrap();
    let counts = b.live_counts();
    assert_eq!(
        (
            counts.reservations,
            counts.handles,
            counts.mappings,
            counts.streams,
            counts.events
        ),
        (1, 1, 1, 1, 1)
    );
    drop(b); // drains the stream (src outlives it), joins the worker, unmaps everything
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(!maps.contains(&format!("{va:x}-")), "reservation unmapped");
}

#[test]
fn raii_owners_tear_down_in_order() {
    use strata_vmm::{Mapping, PhysicalMemory, Reservation};
    let b = backend();
    {
        let r = Arc::new(Reservation::new(&b, 4 * G, 0).unwrap());
        let p = Arc::new(PhysicalMemory::create(&b, D0, 2 * G, CreateFlags::empty()).unwrap());
        let m = Mapping::new(&r, r.ptr(), Arc::clone(&p), 0, 2 * G, &[(D0, RW)]).unwrap();
        b.write(m.va(), b"raii").unwrap();
        drop(p);
        let phys = m.unmap().unwrap();
        assert_eq!(phys.size(), 2 * G);
    }
    strata_vmm::check_deferred().unwrap();
    assert_eq!(b.live_counts(), LiveCounts::default());
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
}

#[test]
fn a_running_copy_pins_its_memory_against_release() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let hb = host(&b);
    let base = hb.resident_bytes(D0).unwrap();
    let len = 8u64 << 20; // ~84 ms on the modelled link
    let (va, h) = mapped(&b, 4 * G, &[(D0, RW)]);
    let data = pattern(len as usize, 11);
    b.write(va, &data).unwrap();
    let s = b.stream_create(0).unwrap();
    let started = b.event_create().unwrap();
    b.event_record(started, s).unwrap();
    let mut out = vec![0u8; len as usize];
    copy(&b, s, out.as_mut_ptr() as u64, va, len).unwrap();
    b.event_synchronize(started).unwrap();
    std::thread::sleep(Duration::from_millis(20)); // the worker has picked the copy up
                                                   // A caller bug (no synchronize before unmap/release) must not pull the pages from under
                                                   // the running copy: the pin keeps them until it ends.
    b.unmap(va, 4 * G).unwrap();
    b.release(h).unwrap();
    assert_eq!(
        b.mem_info(0).unwrap().free,
        DEV - 4 * G,
        "pinned by the copy"
    );
    assert!(hb.resident_bytes(D0).unwrap() >= base + len);
    b.stream_synchronize(s).unwrap();
    assert!(out == data);
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
    assert_eq!(hb.resident_bytes(D0).unwrap(), base);
    b.event_destroy(started).unwrap();
    b.stream_destroy(s).unwrap();
    b.free_va(va, 4 * G).unwrap();
    assert_eq!(b.live_counts(), LiveCounts::default());
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
