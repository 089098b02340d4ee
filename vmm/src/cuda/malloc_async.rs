//! [`MallocAsync`]: the CUDA driver's stream-ordered allocator, the baseline strata is measured
//! against (PyTorch's `cudaMallocAsync` backend and engines that call `cudaMallocAsync` get it).

use std::collections::BTreeSet;
use std::sync::Arc;

use super::result;
use super::streams::raw_stream;
use super::{Ctx, CudaBackend};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::DevicePtr;

/// `cuMemAllocAsync` / `cuMemFreeAsync` on the device's default memory pool, on a stream of
/// its own: one per thread, as an engine thread keeps its stream. It knows the pointers it
/// handed out, so a free of any other is [`Error::UnknownPointer`], never a driver fault;
/// dropping it frees what is left, waits for its stream and destroys it.
pub struct MallocAsync {
    /// Keeps the backend, which retains the device's context, alive.
    _backend: Arc<dyn Backend>,
    ctx: Ctx,
    /// The stream's `CUstream` pointer value, created here.
    stream: u64,
    live: BTreeSet<DevicePtr>,
}

impl std::fmt::Debug for MallocAsync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MallocAsync")
            .field("stream", &format_args!("{:#x}", self.stream))
            .field("live", &self.live.len())
            .finish_non_exhaustive()
    }
}

impl MallocAsync {
    /// A stream of its own on `device`. [`Error::Unsupported`] unless `backend` is the CUDA
    /// backend.
    pub fn new(backend: &Arc<dyn Backend>, device: u32) -> Result<MallocAsync> {
        let cuda = backend
            .as_any()
            .downcast_ref::<CudaBackend>()
            .ok_or_else(|| Error::Unsupported("cudaMallocAsync needs the CUDA backend".into()))?;
        let ctx = Ctx(cuda.enter(device)?.ctx.0);
        let stream = result::stream::create()? as usize as u64;
        Ok(MallocAsync {
            _backend: Arc::clone(backend),
            ctx,
            stream,
            live: BTreeSet::new(),
        })
    }

    fn enter(&self) -> Result<()> {
        // SAFETY: the context stays retained while `_backend` lives, which is as long as `self`.
        unsafe { result::ctx::set_current(self.ctx.0) }
    }

    /// `size` bytes, ordered on this stream (as `cudaMallocAsync`).
    pub fn allocate(&mut self, size: u64) -> Result<DevicePtr> {
        self.enter()?;
        // SAFETY: the stream was created in this context and lives until `drop`.
        let ptr = unsafe { result::mem::alloc_async(size, raw_stream(self.stream))? };
        self.live.insert(ptr);
        Ok(ptr)
    }

    /// Frees `ptr`, ordered on this stream (as `cudaFreeAsync`).
    pub fn free(&mut self, ptr: DevicePtr) -> Result<()> {
        if !self.live.remove(&ptr) {
            return Err(Error::UnknownPointer(ptr));
        }
        self.enter()?;
        // SAFETY: `ptr` came from this stream's `alloc_async` and was live (freed once: it left
        // `live` above); every use of it by this allocator's caller is ordered on this stream.
        unsafe { result::mem::free_async(ptr, raw_stream(self.stream)) }
    }

    /// Waits for the stream's work, frees included.
    pub fn synchronize(&self) -> Result<()> {
        self.enter()?;
        // SAFETY: the stream lives until `drop`.
        unsafe { result::stream::synchronize(raw_stream(self.stream)) }
    }
}

impl Drop for MallocAsync {
    fn drop(&mut self) {
        if crate::process_is_exiting() || self.enter().is_err() {
            return;
        }
        let stream = raw_stream(self.stream);
        for ptr in std::mem::take(&mut self.live) {
            // SAFETY: a live pointer of this stream, freed once (taken out of `live`).
            let _ = unsafe { result::mem::free_async(ptr, stream) };
        }
        // SAFETY: the stream was created here and nothing uses it after this.
        unsafe {
            let _ = result::stream::synchronize(stream);
            let _ = result::stream::destroy(stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HostBackend, HostConfig};

    #[test]
    fn only_the_cuda_backend_has_it() {
        let host: Arc<dyn Backend> = Arc::new(
            HostBackend::new(HostConfig {
                devices: vec![64 << 20],
                granularity: 64 << 10,
                strict: true,
                link: None,
            })
            .unwrap(),
        );
        let err = MallocAsync::new(&host, 0).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
    }
}
