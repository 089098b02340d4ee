//! Shared helpers for the integration suites: backend factories, fill-pattern checks and the
//! conformance suite every [`MemoryResource`](strata_allocator::MemoryResource) runs.

pub mod conformance;

use std::sync::Arc;

use strata_vmm::{Backend, HostConfig};

/// A strict host backend with the given device capacities and a 2 MiB granularity.
///
/// With `STRATA_BACKEND=cuda` the suites run on the real driver instead.
pub fn backend(devices: &[u64]) -> Arc<dyn Backend> {
    if std::env::var("STRATA_BACKEND").as_deref() == Ok("cuda") {
        return strata_vmm::open(strata_vmm::Choice::Cuda)
            .expect("STRATA_BACKEND=cuda but no CUDA device");
    }
    host(HostConfig {
        devices: devices.to_vec(),
        granularity: 2 << 20,
        strict: true,
        link: None,
    })
}

/// A host backend with an explicit configuration.
pub fn host(config: HostConfig) -> Arc<dyn Backend> {
    strata_vmm::host::open(config).expect("host backend")
}

/// The host backend behind a trait object (fault injection, resident bytes).
pub fn as_host(backend: &Arc<dyn Backend>) -> Option<&strata_vmm::HostBackend> {
    backend.as_any().downcast_ref::<strata_vmm::HostBackend>()
}

/// Writes the fill pattern of `seed` over `len` bytes at device VA `ptr`.
pub fn fill(backend: &dyn Backend, ptr: u64, len: u64, seed: u64) {
    let mut buf = vec![0u8; len as usize];
    strata_kernels::pattern::fill(&mut buf, seed, 0);
    backend.write(ptr, &buf).expect("write pattern");
}

/// Reads `len` bytes at `ptr` and returns the first offset that differs from the pattern.
pub fn mismatch(backend: &dyn Backend, ptr: u64, len: u64, seed: u64) -> Option<usize> {
    let mut buf = vec![0u8; len as usize];
    backend.read(ptr, &mut buf).expect("read pattern");
    strata_kernels::pattern::first_mismatch(&buf, seed, 0)
}
