//! What the host backend's test files share: a two-device strict backend and mapping helpers.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use strata_vmm::host::{Link, LinkModel};
use strata_vmm::{
    Access, Backend, CopyDesc, CreateFlags, Error, HostBackend, HostConfig, Location, PhysHandle,
    StreamHandle,
};

pub const G: u64 = 2 << 20;
pub const DEV: u64 = 64 << 20;
pub const D0: Location = Location::Device(0);
pub const D1: Location = Location::Device(1);
pub const RW: Access = Access::ReadWrite;

pub fn config(strict: bool) -> HostConfig {
    HostConfig {
        devices: vec![DEV, DEV],
        granularity: G,
        strict,
        link: None,
    }
}

pub fn backend() -> Arc<dyn Backend> {
    strata_vmm::host::open(config(true)).unwrap()
}

pub fn host(b: &Arc<dyn Backend>) -> &HostBackend {
    b.as_any().downcast_ref::<HostBackend>().unwrap()
}

/// Reserve + create + map + grant `grants`; returns (reservation, handle).
pub fn mapped(b: &Arc<dyn Backend>, size: u64, grants: &[(Location, Access)]) -> (u64, PhysHandle) {
    let va = b.reserve(size, 0).unwrap();
    let h = b.create(D0, size, CreateFlags::empty()).unwrap();
    b.map(va, size, h, 0).unwrap();
    if !grants.is_empty() {
        b.set_access(va, size, grants).unwrap();
    }
    (va, h)
}

pub fn teardown(b: &Arc<dyn Backend>, va: u64, size: u64, h: PhysHandle) {
    b.unmap(va, size).unwrap();
    b.release(h).unwrap();
    b.free_va(va, size).unwrap();
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Copies on `stream` (host ranges borrowed until the caller synchronizes).
pub fn copy(
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

/// Every link 100 MB/s with 1 ms latency: copies slow enough to overlap and observe.
pub fn slow_config() -> HostConfig {
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
