//! The block-copy (gather/scatter) kernel: many small, equally sized blocks moved in one launch.
//!
//! Semantics (the same for the CUDA kernel and its CPU twin): for every pair `i`, the `len` bytes
//! at `src[i]` are copied to `dst[i]`. Destinations are pairwise disjoint and no destination
//! overlaps any source (a launch whose ranges overlap is rejected before it runs: on a GPU its
//! result would depend on thread scheduling). Pairs are independent, so the order in which they
//! run is unobservable. A gather is the case where the sources are scattered and the destinations
//! contiguous, a scatter the reverse; the kernel does not care.
//!
//! Why a kernel at all: DMA submission costs ~0.5 µs of CPU per descriptor and the engines do
//! not merge adjacent descriptors (vLLM PR #48434); for 8 KiB × 1024 blocks a copy kernel was
//! ~3.7× faster than DMA on A30, while DMA wins from ~28 KiB per block (vLLM #57555, PR #42212).
//! [`choose`] encodes that decision; the transfer engine coalesces adjacent blocks first.

/// CUDA C source of the kernel, compiled at run time with NVRTC. One thread block per pair;
/// its threads copy 16-byte words when both ends are 16-byte aligned, bytes otherwise.
/// Self-contained: it names no type from CUDA's headers (its 16-byte word is a local `alignas`
/// struct), so it compiles under NVRTC with no include path.
pub const CUDA_SOURCE: &str = r#"
struct alignas(16) strata_word16 { unsigned long long lo, hi; };

extern "C" __global__ void strata_copy_blocks(const unsigned long long* __restrict__ src,
                                              const unsigned long long* __restrict__ dst,
                                              unsigned long long len,
                                              unsigned int count) {
    unsigned int pair = blockIdx.x;
    if (pair >= count) return;
    const unsigned char* s = (const unsigned char*)src[pair];
    unsigned char* d = (unsigned char*)dst[pair];
    if ((((unsigned long long)s | (unsigned long long)d | len) & 15ull) == 0ull) {
        const strata_word16* s4 = (const strata_word16*)s;
        strata_word16* d4 = (strata_word16*)d;
        unsigned long long words = len >> 4;
        for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) d4[w] = s4[w];
    } else {
        for (unsigned long long b = threadIdx.x; b < len; b += blockDim.x) d[b] = s[b];
    }
}
"#;

/// Name of the kernel's entry point in [`CUDA_SOURCE`].
pub const KERNEL_NAME: &str = "strata_copy_blocks";

/// Threads per block the launcher uses.
pub const THREADS_PER_BLOCK: u32 = 256;

/// Below this many bytes per (coalesced) descriptor, the kernel beats DMA (REFERENCE.md §6:
/// "DMA wins for ≥ 28 KiB").
pub const KERNEL_MAX_BYTES: u64 = 28 << 10;

/// At least this many descriptors before a launch pays for itself.
pub const KERNEL_MIN_PAIRS: usize = 8;

/// How a batch of block copies is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    /// One DMA descriptor per (coalesced) run, submitted as one batch.
    Dma,
    /// One launch of the block-copy kernel.
    Kernel,
}

/// Picks the method for `pairs` descriptors of `len` bytes each (after coalescing).
pub fn choose(pairs: usize, len: u64) -> Method {
    if pairs >= KERNEL_MIN_PAIRS && len < KERNEL_MAX_BYTES {
        Method::Kernel
    } else {
        Method::Dma
    }
}

/// An address range `(start, len)`.
pub type Range = (u64, u64);

/// Checks the launch rule on resolved ranges `(address, len)`: destinations pairwise disjoint and
/// disjoint from every source. Returns the first offending pair of ranges.
pub fn check_disjoint(
    sources: &[(u64, u64)],
    destinations: &[(u64, u64)],
) -> Result<(), (Range, Range)> {
    let mut dst: Vec<(u64, u64)> = destinations.iter().copied().filter(|r| r.1 > 0).collect();
    dst.sort_unstable();
    for w in dst.windows(2) {
        if w[0].0.saturating_add(w[0].1) > w[1].0 {
            return Err((w[0], w[1]));
        }
    }
    for &(s, n) in sources.iter().filter(|r| r.1 > 0) {
        // The last destination starting before the source's end is the only candidate overlap
        // besides none (destinations are disjoint and sorted).
        let end = s.saturating_add(n);
        let i = dst.partition_point(|&(d, _)| d < end);
        if i > 0 {
            let (d, m) = dst[i - 1];
            if d.saturating_add(m) > s {
                return Err(((s, n), (d, m)));
            }
        }
    }
    Ok(())
}

/// The CPU twin of one thread block: copies the concatenation of `src` segments into the
/// concatenation of `dst` segments (the backend resolves one block into the physical segments it
/// spans). Both sides hold the same number of bytes; a mismatch copies the shorter length and
/// returns it, so callers can assert.
pub fn copy_block(src: &[&[u8]], dst: &mut [&mut [u8]]) -> usize {
    let (mut si, mut so, mut copied) = (0usize, 0usize, 0usize);
    for d in dst.iter_mut() {
        let mut doff = 0usize;
        while doff < d.len() && si < src.len() {
            let s = src[si];
            let n = (s.len() - so).min(d.len() - doff);
            d[doff..doff + n].copy_from_slice(&s[so..so + n]);
            doff += n;
            so += n;
            copied += n;
            if so == s.len() {
                si += 1;
                so = 0;
            }
        }
    }
    copied
}

/// The CPU twin of a whole launch over slices: `pairs` are `(src_offset, dst_offset)` into `src`
/// and `dst`, each `len` bytes. Used by tests and by the benchmark as the reference semantics.
pub fn copy_blocks(src: &[u8], dst: &mut [u8], len: usize, pairs: &[(usize, usize)]) {
    for &(s, d) in pairs {
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_concatenated_on_both_sides() {
        let a = [1u8, 2, 3];
        let b = [4u8, 5];
        let mut x = [0u8; 1];
        let mut y = [0u8; 4];
        let n = copy_block(&[&a, &b], &mut [&mut x, &mut y]);
        assert_eq!(n, 5);
        assert_eq!(x, [1]);
        assert_eq!(y, [2, 3, 4, 5]);
    }

    #[test]
    fn overlapping_ranges_are_rejected() {
        assert!(check_disjoint(&[(0, 10)], &[(10, 10), (20, 10)]).is_ok());
        assert!(check_disjoint(&[(0, 11)], &[(10, 10)]).is_err());
        assert!(check_disjoint(&[(100, 10)], &[(10, 10), (15, 10)]).is_err());
        assert!(check_disjoint(&[(25, 10)], &[(10, 10), (30, 10)]).is_err());
    }

    #[test]
    fn dispatch_prefers_the_kernel_for_many_small_blocks() {
        assert_eq!(choose(1024, 8 << 10), Method::Kernel);
        assert_eq!(choose(1024, 256 << 10), Method::Dma);
        assert_eq!(choose(2, 8 << 10), Method::Dma);
    }

    #[test]
    fn slice_twin_gathers() {
        let src: Vec<u8> = (0..64).collect();
        let mut dst = vec![0u8; 16];
        copy_blocks(&src, &mut dst, 8, &[(40, 0), (8, 8)]);
        assert_eq!(&dst[..8], &src[40..48]);
        assert_eq!(&dst[8..], &src[8..16]);
    }
}
