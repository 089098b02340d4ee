//! FP32 matrix product `C = A·B` in row-major terms: the CPU twin of the device GEMM
//! (`strata_vmm::DeviceWork::gemm_f32_async`, cuBLAS `cublasSgemm` on CUDA) and the matmul of KVPR's
//! CPU runtime.
//!
//! Layout (elements, not bytes): `A[i][p] = a[i·lda + p]`, `B[p][j] = b[p·ldb + j]`,
//! `C[i][j] = c[i·ldc + j]` for `i < m`, `j < n`, `p < k`, with `lda ≥ k`, `ldb ≥ n`, `ldc ≥ n`.
//! Only the `m×n` elements of `C` are written (the gaps between rows stay untouched); `C` is
//! overwritten, not accumulated into. Each `C[i][j]` is summed in order `p = 0, 1, …, k−1` with
//! separate multiplies and adds, so two runs of the twin agree bit for bit; a GPU's order (and
//! fused multiply-adds) differ, so a device result equals the twin only up to rounding, or
//! exactly when every partial sum is representable (e.g. small integers).

use std::fmt;

/// Shape and leading dimensions of one row-major product `C[m×n] = A[m×k]·B[k×n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// Why a product is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmError {
    /// `k = 0` with a non-empty `C`: a sum of no terms is not a product anyone asks for.
    ZeroInner,
    /// A leading dimension below the row length it must hold.
    LeadingDimension {
        operand: char,
        ld: usize,
        min: usize,
    },
    /// An operand's extent does not fit in `usize`.
    Overflow,
    /// A slice shorter than the operand's extent.
    TooShort {
        operand: char,
        len: usize,
        need: usize,
    },
}

impl fmt::Display for GemmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            GemmError::ZeroInner => write!(f, "gemm with k = 0 and a non-empty C"),
            GemmError::LeadingDimension { operand, ld, min } => {
                write!(f, "gemm: ld{operand} = {ld} below its row length {min}")
            }
            GemmError::Overflow => write!(f, "gemm operand extent overflows"),
            GemmError::TooShort { operand, len, need } => {
                write!(f, "gemm: {operand} holds {len} elements, needs {need}")
            }
        }
    }
}

impl std::error::Error for GemmError {}

/// Elements from the first element of a `rows × cols` matrix with leading dimension `ld` to one
/// past its last (0 when empty).
fn extent(rows: usize, cols: usize, ld: usize) -> Result<usize, GemmError> {
    if rows == 0 || cols == 0 {
        return Ok(0);
    }
    (rows - 1)
        .checked_mul(ld)
        .and_then(|e| e.checked_add(cols))
        .ok_or(GemmError::Overflow)
}

impl Gemm {
    /// Densely packed operands: `lda = k`, `ldb = ldc = n`.
    pub fn packed(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            m,
            n,
            k,
            lda: k,
            ldb: n,
            ldc: n,
        }
    }

    /// True when `C` has no element (nothing is read or written).
    pub fn is_empty(&self) -> bool {
        self.m == 0 || self.n == 0
    }

    /// Checks the shape and returns the extents `[A, B, C]` in elements (all 0 for an empty
    /// product).
    pub fn extents(&self) -> Result<[usize; 3], GemmError> {
        for (operand, ld, min) in [('a', self.lda, self.k), ('b', self.ldb, self.n)] {
            if ld < min {
                return Err(GemmError::LeadingDimension { operand, ld, min });
            }
        }
        if self.ldc < self.n {
            return Err(GemmError::LeadingDimension {
                operand: 'c',
                ld: self.ldc,
                min: self.n,
            });
        }
        if self.is_empty() {
            return Ok([0; 3]);
        }
        if self.k == 0 {
            return Err(GemmError::ZeroInner);
        }
        Ok([
            extent(self.m, self.k, self.lda)?,
            extent(self.k, self.n, self.ldb)?,
            extent(self.m, self.n, self.ldc)?,
        ])
    }

    /// Computes `C = A·B` over slices that start at each operand's first element.
    pub fn run(&self, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<(), GemmError> {
        let [ea, eb, ec] = self.extents()?;
        for (operand, len, need) in [('a', a.len(), ea), ('b', b.len(), eb), ('c', c.len(), ec)] {
            if len < need {
                return Err(GemmError::TooShort { operand, len, need });
            }
        }
        if self.is_empty() {
            return Ok(());
        }
        for i in 0..self.m {
            let row = &mut c[i * self.ldc..i * self.ldc + self.n];
            row.fill(0.0);
            for (p, &x) in a[i * self.lda..i * self.lda + self.k].iter().enumerate() {
                let b_row = &b[p * self.ldb..p * self.ldb + self.n];
                for (out, &w) in row.iter_mut().zip(b_row) {
                    *out += x * w;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_product_by_hand() {
        // [1 2 3; 4 5 6] · [1 0; 0 1; 1 1] = [4 5; 10 11]
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut c = [0.0f32; 4];
        Gemm::packed(2, 2, 3).run(&a, &b, &mut c).unwrap();
        assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
    }

    #[test]
    fn strides_leave_the_gaps_of_c_alone() {
        // A is the left 1×2 block of a 1×3 row; C rows are 3 apart and only 2 wide.
        let a = [2.0, 3.0, 99.0, 1.0, 1.0];
        let b = [1.0, 2.0, 3.0, 4.0];
        let g = Gemm {
            m: 2,
            n: 2,
            k: 2,
            lda: 3,
            ldb: 2,
            ldc: 3,
        };
        let mut c = [-1.0f32; 5];
        g.run(&a, &b, &mut c).unwrap();
        assert_eq!(c, [11.0, 16.0, -1.0, 4.0, 6.0]);
    }

    #[test]
    fn bad_shapes_are_errors_not_panics() {
        let g = Gemm::packed(2, 2, 2);
        let mut c = [0.0f32; 4];
        assert_eq!(
            g.run(&[0.0; 3], &[0.0; 4], &mut c),
            Err(GemmError::TooShort {
                operand: 'a',
                len: 3,
                need: 4
            })
        );
        let mut bad = g;
        bad.ldc = 1;
        assert!(matches!(
            bad.extents(),
            Err(GemmError::LeadingDimension { operand: 'c', .. })
        ));
        assert_eq!(Gemm::packed(2, 2, 0).extents(), Err(GemmError::ZeroInner));
        assert_eq!(Gemm::packed(0, 2, 0).extents(), Ok([0; 3]));
        let huge = Gemm {
            lda: usize::MAX,
            ..Gemm::packed(3, 1, 1)
        };
        assert_eq!(huge.extents(), Err(GemmError::Overflow));
    }
}
