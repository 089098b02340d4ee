//! One conformance suite for every memory resource (RMM's `mr_ref_test`): 0 B, tiny, 1 MiB,
//! 1 GiB, absurd sizes, concurrent allocations, random walks with fill patterns, threads, and
//! bad input. Instantiate it with [`conformance_suite!`](crate::conformance_suite).

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_allocator::MemoryResource;
use strata_vmm::{overlaps, Error, StreamHandle};

use crate::{fill, mismatch};

const S: StreamHandle = StreamHandle::DEFAULT;

/// Zero bytes: the null pointer, nothing allocated; freeing null is a no-op.
pub fn zero_bytes(mr: &dyn MemoryResource) {
    assert_eq!(mr.allocate(0, S).unwrap(), 0);
    mr.deallocate(0, S).unwrap();
}

/// One byte: a real, 256-byte-aligned pointer whose byte round-trips.
pub fn tiny(mr: &dyn MemoryResource) {
    let p = mr.allocate(1, S).unwrap();
    assert_ne!(p, 0);
    assert_eq!(p % 256, 0, "pointer {p:#x} not 256-byte aligned");
    mr.backend().write(p, &[0xa5]).unwrap();
    let mut b = [0u8];
    mr.backend().read(p, &mut b).unwrap();
    assert_eq!(b, [0xa5]);
    mr.deallocate(p, S).unwrap();
}

/// 1 MiB, filled and checked end to end.
pub fn one_mib(mr: &dyn MemoryResource) {
    let p = mr.allocate(1 << 20, S).unwrap();
    fill(mr.backend().as_ref(), p, 1 << 20, 11);
    assert_eq!(mismatch(mr.backend().as_ref(), p, 1 << 20, 11), None);
    mr.deallocate(p, S).unwrap();
}

/// 1 GiB: first and last bytes reachable.
pub fn one_gib(mr: &dyn MemoryResource) {
    let size = 1u64 << 30;
    let p = mr.allocate(size, S).unwrap();
    let backend = mr.backend();
    backend.write(p, &[1, 2, 3]).unwrap();
    backend.write(p + size - 3, &[4, 5, 6]).unwrap();
    let mut head = [0u8; 3];
    let mut tail = [0u8; 3];
    backend.read(p, &mut head).unwrap();
    backend.read(p + size - 3, &mut tail).unwrap();
    assert_eq!((head, tail), ([1, 2, 3], [4, 5, 6]));
    mr.deallocate(p, S).unwrap();
}

/// Absurd sizes are out-of-memory errors, and the resource stays usable.
pub fn absurd(mr: &dyn MemoryResource) {
    for size in [u64::MAX, u64::MAX - 255, 1 << 62, 1 << 50] {
        let err = mr.allocate(size, S).expect_err("absurd size allocated");
        assert!(
            err.is_out_of_memory(),
            "size {size:#x}: expected out of memory, got {err}"
        );
    }
    tiny(mr);
}

/// Unknown and doubly freed pointers are errors, never corruption.
pub fn bad_free(mr: &dyn MemoryResource) {
    let keep = mr.allocate(4096, S).unwrap();
    fill(mr.backend().as_ref(), keep, 4096, 3);
    let p = mr.allocate(4096, S).unwrap();
    mr.deallocate(p, S).unwrap();
    match mr.deallocate(p, S) {
        Err(Error::DoubleFree(q)) => assert_eq!(q, p),
        other => panic!("double free gave {other:?}"),
    }
    for foreign in [0x10u64, 0x0dea_dbee_f000, keep + 256] {
        match mr.deallocate(foreign, S) {
            Err(Error::UnknownPointer(q)) => assert_eq!(q, foreign),
            other => panic!("foreign pointer {foreign:#x} gave {other:?}"),
        }
    }
    assert_eq!(
        mismatch(mr.backend().as_ref(), keep, 4096, 3),
        None,
        "bad frees corrupted a live block"
    );
    mr.deallocate(keep, S).unwrap();
}

/// Random alloc/free with fill patterns written on alloc and checked on free.
pub fn random_walk(mr: &dyn MemoryResource, seed: u64, steps: usize) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live: Vec<(u64, u64, u64)> = Vec::new();
    for step in 0..steps {
        if live.is_empty() || rng.random_bool(0.55) {
            let size = random_size(&mut rng);
            let p = mr.allocate(size, S).unwrap();
            assert_eq!(p % 256, 0);
            let tag = seed ^ step as u64;
            let probe = size.min(64 << 10);
            fill(mr.backend().as_ref(), p, probe, tag);
            live.push((p, size, tag));
        } else {
            let (p, size, tag) = live.swap_remove(rng.random_range(0..live.len()));
            let probe = size.min(64 << 10);
            assert_eq!(
                mismatch(mr.backend().as_ref(), p, probe, tag),
                None,
                "block {p:#x} corrupted"
            );
            mr.deallocate(p, S).unwrap();
        }
    }
    assert_disjoint(&live.iter().map(|&(p, s, _)| (p, s)).collect::<Vec<_>>());
    for (p, size, tag) in live {
        assert_eq!(
            mismatch(mr.backend().as_ref(), p, size.min(64 << 10), tag),
            None
        );
        mr.deallocate(p, S).unwrap();
    }
}

/// Several threads allocate at once: every live block is distinct, and walks stay correct.
pub fn threads(mr: Arc<dyn MemoryResource>) {
    let blocks: Vec<Vec<(u64, u64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let mr = Arc::clone(&mr);
                scope.spawn(move || {
                    random_walk(mr.as_ref(), 100 + t, 150);
                    let mut rng = SmallRng::seed_from_u64(t);
                    (0..64)
                        .map(|_| {
                            let size = random_size(&mut rng);
                            (mr.allocate(size, S).unwrap(), size)
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let all: Vec<(u64, u64)> = blocks.into_iter().flatten().collect();
    assert_disjoint(&all);
    for (p, _) in all {
        mr.deallocate(p, S).unwrap();
    }
}

/// Sizes from 1 B to 8 MiB, log-uniform, so every bin and the page path are exercised.
pub fn random_size(rng: &mut SmallRng) -> u64 {
    let bits = rng.random_range(0..23u32);
    rng.random_range((1u64 << bits)..=(2u64 << bits))
}

/// Panics when two blocks share a byte.
pub fn assert_disjoint(blocks: &[(u64, u64)]) {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        let ((a, a_len), (b, b_len)) = (pair[0], pair[1]);
        assert!(
            !overlaps(a, a_len, b, b_len),
            "blocks {a:#x}+{a_len} and {b:#x}+{b_len} overlap"
        );
    }
}

/// Instantiates the whole suite as `#[test]`s for a resource built by `$make` (a closure
/// returning `Arc<dyn MemoryResource>` over a backend with at least 2 GiB).
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $make:expr) => {
        mod $name {
            use super::*;
            use $crate::conformance as c;

            fn make() -> std::sync::Arc<dyn strata_allocator::MemoryResource> {
                ($make)()
            }

            #[test]
            fn zero_bytes() {
                c::zero_bytes(make().as_ref());
            }
            #[test]
            fn tiny() {
                c::tiny(make().as_ref());
            }
            #[test]
            fn one_mib() {
                c::one_mib(make().as_ref());
            }
            #[test]
            fn one_gib() {
                c::one_gib(make().as_ref());
            }
            #[test]
            fn absurd() {
                c::absurd(make().as_ref());
            }
            #[test]
            fn bad_free() {
                c::bad_free(make().as_ref());
            }
            #[test]
            fn random_walk() {
                c::random_walk(make().as_ref(), 7, 600);
            }
            #[test]
            fn threads() {
                c::threads(make());
            }
        }
    };
}
