//! Device work: kernels and library calls queued on a backend's streams, ordered with its copies
//! like any other work. Apart from the VMM contract ([`Backend`](crate::Backend)), below it: a
//! backend that can run them hands out its [`DeviceWork`] through
//! [`Backend::device_work`](crate::Backend::device_work) (both strata backends do; a test fake
//! need not; [`device_work`](crate::device_work) turns `None` into an error).

mod gemm;

pub use gemm::GemmF32;
pub(crate) use gemm::{check_device_operands, Operand};

use crate::error::Result;
use crate::types::{DevicePtr, StreamHandle};

/// The block-copy kernel and the FP32 GEMM, on a backend's streams.
///
/// Every range obeys the [`Backend`](crate::Backend) copy precondition (8): device VA mapped with `Read`
/// (source) or `ReadWrite` (destination) access for the stream's device, or, for the block
/// copy, host memory outside every reservation
/// ([`Error::IllegalAccess`](crate::Error::IllegalAccess) otherwise).
pub trait DeviceWork: Send + Sync + 'static {
    /// Queues one launch of the block-copy kernel (`strata_kernels::blockcopy`): for each
    /// `(src, dst)` pair, `len` bytes from `src` to `dst`. Destinations must be pairwise
    /// disjoint and disjoint from every source
    /// ([`Error::InvalidArgument`](crate::Error::InvalidArgument) otherwise). The host backend
    /// runs the kernel's CPU twin on the stream's worker (one submission, one link latency);
    /// CUDA compiles the kernel with NVRTC on first use, and where it cannot (no NVRTC, a
    /// kernel the driver refuses) returns [`Error::Unsupported`](crate::Error::Unsupported) so callers fall back to
    /// [`Backend::copy_async`](crate::Backend::copy_async).
    ///
    /// # Safety
    ///
    /// As for [`Backend::copy_async`](crate::Backend::copy_async).
    unsafe fn copy_blocks_async(
        &self,
        stream: StreamHandle,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<()>;

    /// Queues the FP32 product `C = A·B` described by `gemm` (row-major, see [`GemmF32`]) on
    /// `stream`. Every operand must be device memory mapped with `Read` (`A`, `B`) or
    /// `ReadWrite` (`C`) access for the stream's device; the descriptor rules of [`GemmF32`]
    /// are checked first, identically on every backend. An empty product (`m = 0` or `n = 0`)
    /// queues nothing. Safe: no operand is host memory, so the backend validates every byte it
    /// touches (as for `memset_async`).
    ///
    /// CUDA runs `cublasSgemm` (FP32) on a per-device cuBLAS handle bound to the stream; the
    /// host backend runs the CPU twin ([`strata_kernels::gemm`]) on the stream's worker. The two
    /// agree up to rounding (summation order differs), exactly when every partial sum is
    /// representable.
    fn gemm_f32_async(&self, stream: StreamHandle, gemm: &GemmF32) -> Result<()>;
}
