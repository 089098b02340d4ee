//! [`DeviceWork`] on the host backend: the block-copy kernel's and the GEMM's CPU twins, run on
//! the stream's worker over the memory the VA table resolves (never through the user VA).

use std::sync::Arc;

use strata_kernels::gemm::Gemm;

use super::copy::{copy_segments, sub_segments, Segments};
use super::fault::FaultOp;
use super::{HostBackend, Inner};
use crate::error::{Error, Result};
use crate::types::{Access, DevicePtr, StreamHandle};
use crate::vatable::Accessor;
use crate::work::{check_device_operands, DeviceWork, GemmF32, Operand};

impl DeviceWork for HostBackend {
    unsafe fn copy_blocks_async(
        &self,
        stream: StreamHandle,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<()> {
        self.inner.faults.check(FaultOp::Copy)?;
        let (accessor, worker) = self.accessor(stream)?;
        // The rule the CUDA backend applies too (typed errors before anything is queued);
        // `run_blocks` checks overlap again on the memory it resolves at run time.
        self.inner
            .state
            .lock()
            .va
            .check_blocks(accessor, len, pairs)?;
        match worker {
            None => self.inner.run_blocks(accessor, len, pairs),
            Some(worker) => {
                let inner = Arc::clone(&self.inner);
                let pairs = pairs.to_vec();
                worker.submit(Box::new(move || inner.run_blocks(accessor, len, &pairs)))
            }
        }
    }

    fn gemm_f32_async(&self, stream: StreamHandle, gemm: &GemmF32) -> Result<()> {
        let Some(operands) = gemm.operands()? else {
            return Ok(());
        };
        let shape = gemm.shape()?;
        let (accessor, worker) = self.accessor(stream)?;
        check_device_operands(&self.inner.state.lock().va, accessor, &operands)?;
        match worker {
            None => self.inner.run_gemm(accessor, shape, &operands),
            Some(worker) => {
                let inner = Arc::clone(&self.inner);
                worker.submit(Box::new(move || inner.run_gemm(accessor, shape, &operands)))
            }
        }
    }
}

impl Inner {
    /// Runs one block-copy launch now: resolves every range under one lock, checks the launch
    /// rule on the memory itself (aliases through different VAs included), pays the link
    /// latency once, then runs the kernel's CPU twin per pair.
    fn run_blocks(
        &self,
        accessor: Accessor,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<()> {
        if len == 0 || pairs.is_empty() {
            return Ok(());
        }
        let mut pins = Vec::new();
        let mut resolved = Vec::with_capacity(pairs.len());
        let mut any_src_dev = false;
        let mut any_dst_dev = false;
        let outcome = (|| {
            let mut st = self.state.lock();
            for &(src, dst) in pairs {
                let (s, sd) = self.resolve(&mut st, src, len, accessor, Access::Read, &mut pins)?;
                let (d, dd) =
                    self.resolve(&mut st, dst, len, accessor, Access::ReadWrite, &mut pins)?;
                any_src_dev |= sd;
                any_dst_dev |= dd;
                resolved.push((s, d));
            }
            Ok::<_, Error>(())
        })();
        let result = outcome.and_then(|()| {
            let srcs: Vec<(u64, u64)> = resolved
                .iter()
                .flat_map(|(s, _)| s.iter().map(|&(a, n)| (a as u64, n)))
                .collect();
            let dsts: Vec<(u64, u64)> = resolved
                .iter()
                .flat_map(|(_, d)| d.iter().map(|&(a, n)| (a as u64, n)))
                .collect();
            if let Err((a, b)) = strata_kernels::blockcopy::check_disjoint(&srcs, &dsts) {
                return Err(Error::InvalidArgument(format!(
                    "block-copy ranges overlap: {:#x}+{:#x} and {:#x}+{:#x}",
                    a.0, a.1, b.0, b.1
                )));
            }
            let total = len.saturating_mul(pairs.len() as u64);
            let delay = self.link_delay(total, any_src_dev, any_dst_dev);
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            for (s, d) in &resolved {
                // SAFETY: every segment lies in a shadow view of a pinned handle or in host
                // memory the caller keeps valid (the `copy_async` contract); `check_disjoint`
                // proved no destination overlaps a source or another destination, so these
                // slices alias nothing that is written; they live only for this call.
                let src: Vec<&[u8]> = s
                    .iter()
                    .map(|&(a, n)| unsafe {
                        std::slice::from_raw_parts(a as *const u8, n as usize)
                    })
                    .collect();
                // SAFETY: as above; destinations are pairwise disjoint.
                let mut dst: Vec<&mut [u8]> = d
                    .iter()
                    .map(|&(a, n)| unsafe {
                        std::slice::from_raw_parts_mut(a as *mut u8, n as usize)
                    })
                    .collect();
                let copied = strata_kernels::blockcopy::copy_block(&src, &mut dst);
                debug_assert_eq!(copied as u64, len);
            }
            Ok(())
        });
        self.unpin(&pins);
        result
    }

    /// Runs one GEMM now: resolves the operands (translating again, as copies do), refuses an
    /// output that aliases an input through any VA, gathers `A` and `B`, runs the CPU twin and
    /// writes back only the `m×n` elements of `C`. Compute costs no link time.
    fn run_gemm(&self, accessor: Accessor, shape: Gemm, operands: &[Operand; 3]) -> Result<()> {
        let mut pins = Vec::new();
        let resolved = (|| {
            let mut st = self.state.lock();
            let mut segs: [Segments; 3] = Default::default();
            for (seg, &(ptr, len, need)) in segs.iter_mut().zip(operands) {
                *seg = self
                    .resolve(&mut st, ptr, len, accessor, need, &mut pins)?
                    .0;
            }
            Ok::<_, Error>(segs)
        })();
        let result = resolved.and_then(|[a, b, c]| {
            let ranges = |s: &Segments| s.iter().map(|&(p, n)| (p as u64, n)).collect::<Vec<_>>();
            let inputs: Vec<_> = ranges(&a).into_iter().chain(ranges(&b)).collect();
            if let Err((x, y)) = strata_kernels::blockcopy::check_disjoint(&inputs, &ranges(&c)) {
                return Err(Error::InvalidArgument(format!(
                    "gemm output overlaps an input or itself: {:#x}+{:#x} and {:#x}+{:#x}",
                    x.0, x.1, y.0, y.1
                )));
            }
            let [ea, eb, ec] = shape
                .extents()
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            // The operands go through local vectors (valid for their whole length, referenced
            // by nothing else while bytes move), so the twin never sees device memory.
            let (mut av, mut bv, mut cv) = (vec![0f32; ea], vec![0f32; eb], vec![0f32; ec]);
            copy_segments(&a, &vec![(av.as_mut_ptr() as usize, ea as u64 * 4)]);
            copy_segments(&b, &vec![(bv.as_mut_ptr() as usize, eb as u64 * 4)]);
            shape
                .run(&av, &bv, &mut cv)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            for i in 0..shape.m {
                let start = i * shape.ldc;
                let row = vec![(cv[start..].as_ptr() as usize, shape.n as u64 * 4)];
                copy_segments(
                    &row,
                    &sub_segments(&c, start as u64 * 4, shape.n as u64 * 4),
                );
            }
            Ok(())
        });
        self.unpin(&pins);
        result
    }
}
