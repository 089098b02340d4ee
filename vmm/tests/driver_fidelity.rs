//! What the host backend does to behave like the real driver beyond the `Backend` contract's
//! checks: the refusal mode for imported handles (`STRATA_HOST_IMPORTED_MAPS=refuse`) and the
//! latency profiles (`STRATA_HOST_LATENCY`). Timings here assert orders only, never absolute
//! times: a charged cost is a lower bound (a clock never runs early), and ratios are wide.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_vmm::latency::{Call, Profile};
use strata_vmm::{Access, Backend, CreateFlags, Error, HostBackend, HostConfig, Location};

const G: u64 = 2 << 20;
const D0: Location = Location::Device(0);

fn config() -> HostConfig {
    HostConfig {
        devices: vec![64 << 20],
        granularity: G,
        strict: true,
        link: None,
    }
}

fn open(b: HostBackend) -> Arc<dyn Backend> {
    Arc::new(b)
}

#[test]
fn imported_handles_cannot_be_mapped_in_the_refusal_mode() {
    let b = open(
        HostBackend::with_latency(config(), Profile::none())
            .unwrap()
            .refusing_imported_maps(),
    );
    let h = b.create(D0, G, CreateFlags::EXPORTABLE).unwrap();
    let fd = b.export_fd(h).unwrap();
    let imported = b.import_fd(fd.as_fd()).unwrap();
    let va = b.reserve(2 * G, 0).unwrap();
    match b.map(va, G, imported, 0) {
        Err(Error::Unsupported(words)) => {
            assert!(words.contains("CUDA_ERROR_NOT_SUPPORTED"), "{words}")
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // The creator's handle still maps; nothing was left behind by the refusal.
    assert_eq!(b.live_counts().mappings, 0);
    b.map(va + G, G, h, 0).unwrap();
    b.unmap(va + G, G).unwrap();
    b.release(imported).unwrap();
    b.release(h).unwrap();
    b.free_va(va, 2 * G).unwrap();
    // Without the mode the same import maps (the host backend's default).
    let b = open(HostBackend::with_latency(config(), Profile::none()).unwrap());
    let h = b.create(D0, G, CreateFlags::EXPORTABLE).unwrap();
    let fd = b.export_fd(h).unwrap();
    let imported = b.import_fd(fd.as_fd()).unwrap();
    let va = b.reserve(G, 0).unwrap();
    b.map(va, G, imported, 0).unwrap();
    b.unmap(va, G).unwrap();
    b.release(imported).unwrap();
    b.release(h).unwrap();
    b.free_va(va, G).unwrap();
}

/// Median of `n` timings of `f`.
fn median(n: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..n)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    t[n / 2]
}

#[test]
fn under_a100_a_create_costs_more_than_a_map_and_set_access_more_than_map() {
    let b = open(HostBackend::with_latency(config(), Profile::a100()).unwrap());
    let rw = [(D0, Access::ReadWrite)];
    let va = b.reserve(G, 0).unwrap();
    let mut handles = Vec::new();
    let create = median(9, || {
        handles.push(b.create(D0, G, CreateFlags::empty()).unwrap())
    });
    let h = handles[0];
    let (mut map, mut access) = (Vec::new(), Vec::new());
    for _ in 0..9 {
        let t = Instant::now();
        b.map(va, G, h, 0).unwrap();
        map.push(t.elapsed());
        let t = Instant::now();
        b.set_access(va, G, &rw).unwrap();
        access.push(t.elapsed());
        b.unmap(va, G).unwrap();
    }
    map.sort();
    access.sort();
    let (map, access) = (map[4], access[4]);
    assert!(create >= Profile::a100().cost(Call::Create), "{create:?}");
    assert!(
        access >= Profile::a100().cost(Call::SetAccess),
        "{access:?}"
    );
    assert!(create > 2 * map, "create {create:?} vs map {map:?}");
    assert!(access > map, "set_access {access:?} vs map {map:?}");
    for h in handles {
        b.release(h).unwrap();
    }
    b.free_va(va, G).unwrap();
}

#[test]
fn copies_are_charged_at_the_profile_bandwidth() {
    // 0.05 GB/s host to device: 1 MiB takes at least 21 ms, far above a 1 MiB memcpy.
    let slow = Profile::parse_file("h2d_gbps=0.05\n").unwrap();
    let len = 1 << 20;
    let floor = slow.copy_time(strata_vmm::latency::Direction::HostToDevice, len);
    let mut times = Vec::new();
    for profile in [Profile::none(), slow] {
        let b = open(HostBackend::with_latency(config(), profile).unwrap());
        let va = b.reserve(G, 0).unwrap();
        let h = b.create(D0, G, CreateFlags::empty()).unwrap();
        b.map(va, G, h, 0).unwrap();
        b.set_access(va, G, &[(D0, Access::ReadWrite)]).unwrap();
        let data = vec![7u8; len as usize];
        times.push(median(3, || b.write(va, &data).unwrap()));
        let mut back = vec![0u8; 16];
        b.read(va, &mut back).unwrap();
        assert_eq!(back, [7u8; 16]);
        b.unmap(va, G).unwrap();
        b.release(h).unwrap();
        b.free_va(va, G).unwrap();
    }
    assert!(times[1] >= floor, "{:?} < {floor:?}", times[1]);
    assert!(
        times[1] > 2 * times[0],
        "charged {:?} vs free {:?}",
        times[1],
        times[0]
    );
}
