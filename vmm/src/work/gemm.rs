//! The device GEMM's descriptor ([`GemmF32`]) and the checks both backends share, so a bad
//! product is the same typed error on CUDA and on the host emulation.

use strata_kernels::gemm::{Gemm, GemmError};

use crate::error::{Error, Result};
use crate::types::{overlaps, Access, DevicePtr};
use crate::vatable::{Accessor, Translation, VaTable};

/// Bytes per element.
const F32: u64 = 4;

/// One FP32 product `C = A·B` on device memory, row-major: with `A` at `a`, `m×k`, rows `lda`
/// elements apart; `B` at `b`, `k×n`, rows `ldb` apart; `C` at `c`, `m×n`, rows `ldc` apart.
/// Element `(i, j)` of `C` lies at byte `c + 4·(i·ldc + j)`; only the `m×n` elements are written
/// and `C` is overwritten (β = 0). The layout rules and the rounding caveat are those of
/// [`strata_kernels::gemm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmF32 {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a: DevicePtr,
    pub lda: u64,
    pub b: DevicePtr,
    pub ldb: u64,
    pub c: DevicePtr,
    pub ldc: u64,
}

/// One operand's bytes and the access the product needs on them.
pub(crate) type Operand = (DevicePtr, u64, Access);

impl GemmF32 {
    /// Densely packed operands: `lda = k`, `ldb = ldc = n`.
    pub fn packed(m: u64, n: u64, k: u64, a: DevicePtr, b: DevicePtr, c: DevicePtr) -> Self {
        GemmF32 {
            m,
            n,
            k,
            a,
            lda: k,
            b,
            ldb: n,
            c,
            ldc: n,
        }
    }

    /// The element shape, every dimension within cuBLAS's `int`
    /// ([`Error::Overflow`] otherwise, on every backend).
    pub(crate) fn shape(&self) -> Result<Gemm> {
        let dim = |v: u64| -> Result<usize> {
            i32::try_from(v)
                .ok()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or(Error::Overflow("gemm dimension above i32::MAX"))
        };
        Ok(Gemm {
            m: dim(self.m)?,
            n: dim(self.n)?,
            k: dim(self.k)?,
            lda: dim(self.lda)?,
            ldb: dim(self.ldb)?,
            ldc: dim(self.ldc)?,
        })
    }

    /// Checks the descriptor and returns the byte ranges of `A`, `B` and `C` with the access each
    /// needs, or `None` for an empty product (nothing to queue). Errors: a zero inner dimension
    /// or a leading dimension below its row length, an operand not 4-byte aligned, or `C`
    /// overlapping `A` or `B` is [`Error::InvalidArgument`]; extents or addresses that overflow
    /// are [`Error::Overflow`].
    pub(crate) fn operands(&self) -> Result<Option<[Operand; 3]>> {
        let shape = self.shape()?;
        let extents = shape.extents().map_err(|e| match e {
            GemmError::Overflow => Error::Overflow("gemm operand extent"),
            other => Error::InvalidArgument(other.to_string()),
        })?;
        if shape.is_empty() {
            return Ok(None);
        }
        let mut ranges = [(0, 0, Access::Read); 3];
        let operands = [
            ('A', self.a, Access::Read),
            ('B', self.b, Access::Read),
            ('C', self.c, Access::ReadWrite),
        ];
        for ((name, ptr, need), (extent, range)) in operands
            .into_iter()
            .zip(extents.into_iter().zip(ranges.iter_mut()))
        {
            if ptr % F32 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "gemm operand {name} at {ptr:#x} is not 4-byte aligned"
                )));
            }
            let len = (extent as u64)
                .checked_mul(F32)
                .ok_or(Error::Overflow("gemm operand bytes"))?;
            ptr.checked_add(len)
                .ok_or(Error::Overflow("gemm address + extent"))?;
            *range = (ptr, len, need);
        }
        let (c, c_len, _) = ranges[2];
        for (name, (ptr, len, _)) in [('A', ranges[0]), ('B', ranges[1])] {
            if overlaps(ptr, len, c, c_len) {
                return Err(Error::InvalidArgument(format!(
                    "gemm output C {c:#x}+{c_len:#x} overlaps input {name} {ptr:#x}+{len:#x}"
                )));
            }
        }
        Ok(Some(ranges))
    }
}

/// Every operand must be device memory, fully mapped with the access it needs for `accessor`:
/// [`Error::IllegalAccess`] otherwise (host memory included: the product runs on the device).
pub(crate) fn check_device_operands(
    table: &VaTable,
    accessor: Accessor,
    operands: &[Operand; 3],
) -> Result<()> {
    for &(ptr, len, need) in operands {
        if table.translate(ptr, len, accessor, need)? == Translation::Host {
            return Err(Error::IllegalAccess {
                va: ptr,
                size: len,
                reason: "gemm operand is not device memory",
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_are_checked_before_any_backend_sees_them() {
        let base = 0x7000_0000_0000u64;
        let g = GemmF32::packed(2, 3, 4, base, base + 0x100, base + 0x200);
        let ops = g.operands().unwrap().unwrap();
        assert_eq!(ops[0], (base, 2 * 4 * 4, Access::Read));
        assert_eq!(ops[1], (base + 0x100, 4 * 3 * 4, Access::Read));
        assert_eq!(ops[2], (base + 0x200, 2 * 3 * 4, Access::ReadWrite));
        assert_eq!(GemmF32 { m: 0, ..g }.operands().unwrap(), None);
        let invalid = |d: GemmF32| matches!(d.operands(), Err(Error::InvalidArgument(_)));
        assert!(invalid(GemmF32 { k: 0, ..g }));
        assert!(invalid(GemmF32 { lda: 3, ..g }));
        assert!(invalid(GemmF32 { ldc: 2, ..g }));
        assert!(invalid(GemmF32 { a: base + 2, ..g }));
        assert!(invalid(GemmF32 { c: base + 4, ..g }));
        assert!(matches!(
            GemmF32 { m: 1 << 31, ..g }.operands(),
            Err(Error::Overflow(_))
        ));
        assert!(matches!(
            GemmF32 {
                c: u64::MAX - 7,
                ..g
            }
            .operands(),
            Err(Error::Overflow(_))
        ));
    }
}
