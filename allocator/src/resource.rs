//! The one resource trait every allocator implements (RMM's `device_memory_resource`), so one
//! conformance suite and one set of benchmarks run over all of them.

use std::sync::Arc;

use strata_vmm::{Backend, DevicePtr, Result, StreamHandle};

/// Device memory by size, stream-ordered.
///
/// Zero bytes: `allocate(0, _)` returns `Ok(0)` (the null pointer) and allocates nothing;
/// `deallocate(0, _)` is a no-op. Every other pointer is aligned to at least 256 bytes.
pub trait MemoryResource: Send + Sync {
    /// Allocates `size` bytes for use on `stream`. Out of memory is an `Err`, never a panic.
    fn allocate(&self, size: u64, stream: StreamHandle) -> Result<DevicePtr>;
    /// Frees a pointer `allocate` returned; its memory may be reused once `stream`'s work
    /// before this call completes. Unknown pointers and double frees are errors.
    fn deallocate(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()>;
    /// The backend that owns the memory.
    fn backend(&self) -> &Arc<dyn Backend>;
    /// The device the memory lives on.
    fn device(&self) -> u32;
}
