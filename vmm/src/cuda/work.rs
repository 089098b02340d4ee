//! [`DeviceWork`] on CUDA: the block-copy kernel (`launch.rs`, compiled with NVRTC on first use)
//! and cuBLAS (`blas.rs`), checked against the same VA table as the backend's copies.

use super::{launch, CudaBackend};
use crate::error::{Error, Result};
use crate::types::{DevicePtr, StreamHandle};
use crate::work::{DeviceWork, GemmF32};

impl DeviceWork for CudaBackend {
    unsafe fn copy_blocks_async(
        &self,
        stream: StreamHandle,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<()> {
        let (device, reachable) = {
            let state = self.state.lock();
            let (device, host_ranges) =
                self.device_for_work(&state, stream, |a| state.table.check_blocks(a, len, pairs))?;
            let reachable = host_ranges
                .iter()
                .all(|&(addr, n)| state.pinned_contains(addr, n));
            (device, reachable)
        };
        if len == 0 || pairs.is_empty() {
            return Ok(());
        }
        if !reachable {
            // Pageable host memory: no kernel can reach it, the DMA engines can. The ranges
            // passed the launch rule, so the copies' order is unobservable.
            let plan: Vec<(u64, u64, u64)> =
                pairs.iter().map(|&(src, dst)| (dst, src, len)).collect();
            return self.with_stream(stream, device, |_, raw| {
                // SAFETY: every device range was validated for this stream's device; host
                // ranges are the caller's obligation (this fn's `# Safety`); the stream is held
                // alive with its context current.
                unsafe { self.submit(&plan, raw) }
            });
        }
        let launcher = self.launcher(device)?;
        self.with_stream(stream, device, |_, raw| {
            // SAFETY: `with_stream` holds the stream alive with `device`'s context current (the
            // launcher's); `check_blocks` validated every device range for this device and the
            // launch rule; every host range lies in a live pinned `host_alloc` of ours, kept
            // valid until completion by the caller (this fn's `# Safety`).
            unsafe { launcher.launch(raw, len, pairs) }
        })
    }

    fn gemm_f32_async(&self, stream: StreamHandle, gemm: &GemmF32) -> Result<()> {
        self.gemm_f32(stream, gemm)
    }
}

impl CudaBackend {
    /// The device's kernel launcher, built on first use. What cannot change (no NVRTC, a
    /// compile or load failure) is remembered as `Unsupported`; a context that cannot be entered
    /// or a device out of memory for the first staging slot is returned as is and tried again
    /// next time, so a full device at first use does not turn the kernel off for good.
    fn launcher(&self, device: u32) -> Result<&launch::Launcher> {
        let dev = self.device(device)?;
        let cell = &self.launchers[device as usize];
        if let Some(got) = cell.get() {
            return got.as_ref().map_err(|msg| Error::Unsupported(msg.clone()));
        }
        self.enter(device)?;
        let built = match launch::Launcher::new(device, dev.cu, dev.granularity) {
            Err(e) if e.is_out_of_memory() => return Err(e),
            built => built.map_err(|e| match e {
                Error::Unsupported(msg) => msg,
                other => format!("block-copy kernel: {other}"),
            }),
        };
        // A launcher another thread stored first wins; this one drops here, its context
        // current (entered above).
        let got = cell.get_or_init(|| built);
        got.as_ref().map_err(|msg| Error::Unsupported(msg.clone()))
    }
}
