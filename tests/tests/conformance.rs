//! The conformance suite over every allocator.

use std::sync::Arc;

use strata_allocator::{DirectResource, MemoryResource};
use strata_tests::{backend, conformance_suite};

const DEVICE: u64 = 4 << 30;

conformance_suite!(direct, || -> Arc<dyn MemoryResource> {
    Arc::new(DirectResource::new(backend(&[DEVICE]), 0).unwrap())
});
