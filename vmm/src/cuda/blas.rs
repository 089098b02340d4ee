//! cuBLAS behind [`DeviceWork::gemm_f32_async`](crate::DeviceWork::gemm_f32_async): one handle per
//! device's primary context, created on first use with that context current, bound to the
//! caller's stream for each call (`cublasSetStream`) and destroyed before the context is
//! released.
//!
//! `libcublas` is loaded dynamically, like the driver. cudarc panics when the library or a
//! symbol is missing; [`call`] turns that into [`Error::Unsupported`] (the driver works, only
//! the GEMM is unavailable), and a failing status into [`Error::Driver`] with cuBLAS's name.
//!
//! Row-major through a column-major library: a row-major `X` with leading dimension `ld` is, to
//! cuBLAS, the column-major `Xᵀ` with the same `ld`. So `C = A·B` is computed as
//! `Cᵀ = Bᵀ·Aᵀ`: `cublasSgemm(N, N, n, m, k, 1, B, ldb, A, lda, 0, C, ldc)`. FP32 in the default
//! math mode (no TF32 unless the process opts in).

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::cublas::sys as cublas;
use parking_lot::Mutex;

use super::CudaBackend;
use crate::error::{Error, Result};
use crate::types::{Location, StreamHandle};
use crate::vatable::Accessor;
use crate::work::{check_device_operands, GemmF32};

/// A cuBLAS handle created in one device's primary context.
#[derive(Clone, Copy, Debug)]
struct Handle(cublas::cublasHandle_t);

// SAFETY: a cuBLAS handle is an opaque library object, not memory this process dereferences;
// cuBLAS allows using a handle from any host thread as long as calls on it are not concurrent,
// which the per-device `Mutex` in `Handles` guarantees (set-stream and GEMM run under it).
unsafe impl Send for Handle {}

/// The lazily created handle of each device, each behind the lock that serializes its use.
#[derive(Debug)]
pub(super) struct Handles(Vec<Mutex<Option<Handle>>>);

impl Handles {
    pub(super) fn new(devices: usize) -> Self {
        Handles((0..devices).map(|_| Mutex::new(None)).collect())
    }
}

/// Runs one cuBLAS call: a panic from cudarc's loader becomes [`Error::Unsupported`], a status
/// other than success [`Error::Driver`].
fn call(name: &'static str, f: impl FnOnce() -> cublas::cublasStatus_t) -> Result<()> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS) => Ok(()),
        Ok(status) => Err(Error::Driver {
            call: name,
            code: status as i32,
            name: format!("{status:?}"),
        }),
        Err(_) => Err(Error::Unsupported(format!(
            "{name}: the cuBLAS library (libcublas) or this symbol could not be loaded"
        ))),
    }
}

/// Creates a handle in the current context.
fn create() -> Result<Handle> {
    let present = catch_unwind(|| {
        // SAFETY: loading a shared library runs its initializers; libcublas is designed to be
        // loaded this way. The probe calls nothing in it.
        unsafe { cublas::is_culib_present() }
    })
    .unwrap_or(false);
    if !present {
        return Err(Error::Unsupported(
            "the cuBLAS library (libcublas) could not be loaded".into(),
        ));
    }
    let mut raw: cublas::cublasHandle_t = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer for the call; the caller made the device's primary
    // context current, which the handle binds to.
    call("cublasCreate_v2", || unsafe {
        cublas::cublasCreate_v2(&mut raw)
    })?;
    Ok(Handle(raw))
}

impl CudaBackend {
    /// [`DeviceWork::gemm_f32_async`](crate::DeviceWork::gemm_f32_async) on cuBLAS.
    pub(super) fn gemm_f32(&self, stream: StreamHandle, gemm: &GemmF32) -> Result<()> {
        let Some(operands) = gemm.operands()? else {
            return Ok(());
        };
        let shape = gemm.shape()?;
        let device = {
            let state = self.state.lock();
            let check = |d: u32| {
                check_device_operands(
                    &state.table,
                    Accessor::Location(Location::Device(d)),
                    &operands,
                )
            };
            let device = if stream == StreamHandle::DEFAULT {
                (0..self.devices.len() as u32)
                    .find(|&d| check(d).is_ok())
                    .unwrap_or(0)
            } else {
                Self::stream_device(&state, stream)?
            };
            check(device)?;
            device
        };
        // Dimensions fit in `i32` (checked by `shape`).
        let dim = |v: usize| v as std::ffi::c_int;
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.with_stream(stream, device, |device, raw_stream| {
            let mut slot = self.blas.0[device as usize].lock();
            let handle = match *slot {
                Some(h) => h,
                None => *slot.insert(create()?),
            };
            // SAFETY: the handle was created in this device's context, which `with_stream` made
            // current, and is used by this thread alone (its lock is held); the stream is null
            // or live (its gate is held by `with_stream`) in the same context.
            call("cublasSetStream_v2", || unsafe {
                cublas::cublasSetStream_v2(handle.0, raw_stream.cast())
            })?;
            // SAFETY: as above for the handle and stream. Every operand range was validated as
            // device VA mapped with the access it needs for this device, 4-byte aligned, `C`
            // disjoint from `A` and `B`, and the leading dimensions cover the rows
            // (`gemm.operands()`); the product is the row-major `C = A·B` read as the
            // column-major `Cᵀ = Bᵀ·Aᵀ`. `alpha` and `beta` are host scalars that outlive the
            // call (the default host pointer mode reads them before returning).
            call("cublasSgemm_v2", || unsafe {
                cublas::cublasSgemm_v2(
                    handle.0,
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    dim(shape.n),
                    dim(shape.m),
                    dim(shape.k),
                    &alpha,
                    gemm.b as usize as *const f32,
                    dim(shape.ldb),
                    gemm.a as usize as *const f32,
                    dim(shape.lda),
                    &beta,
                    gemm.c as usize as *mut f32,
                    dim(shape.ldc),
                )
            })
        })
    }

    /// Destroys every cuBLAS handle (before the primary contexts are released).
    pub(super) fn destroy_blas_handles(&self) {
        for (device, slot) in self.blas.0.iter().enumerate() {
            let Some(handle) = slot.lock().take() else {
                continue;
            };
            let destroyed = self.enter(device as u32).and_then(|_| {
                // SAFETY: the handle was created in this device's context (current now) and was
                // just taken out of its slot, so nothing uses it again: destroyed exactly once.
                call("cublasDestroy_v2", || unsafe {
                    cublas::cublasDestroy_v2(handle.0)
                })
            });
            if let Err(e) = destroyed {
                crate::raii::record_deferred(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_libcublas_is_a_typed_error_not_a_panic() {
        let got = std::panic::catch_unwind(|| {
            call("cublasSgemm_v2", || panic!("Missing symbol cublasSgemm_v2"))
        })
        .expect("call must not unwind");
        assert!(matches!(got, Err(Error::Unsupported(_))));
        let failed = call("cublasCreate_v2", || {
            cublas::cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED
        });
        assert!(matches!(failed, Err(Error::Driver { code: 1, .. })));
    }
}
