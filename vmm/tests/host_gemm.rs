//! `DeviceWork::gemm_f32_async` on the strict host backend: the stream-ordered CPU twin, its
//! layout with leading dimensions, and every refused operand as a typed error.

use std::sync::Arc;

use strata_kernels::gemm::Gemm;
use strata_vmm::{
    device_work, Access, Backend, CreateFlags, Error, GemmF32, HostConfig, Location, StreamHandle,
};

const D0: Location = Location::Device(0);
const G: u64 = 2 << 20;

fn backend() -> Arc<dyn Backend> {
    strata_vmm::host::open(HostConfig {
        devices: vec![64 << 20, 64 << 20],
        granularity: G,
        strict: true,
        link: None,
    })
    .unwrap()
}

/// One granule of device 0 mapped at the start of a two-granule reservation, `access` for `D0`.
fn mapped(b: &Arc<dyn Backend>, access: Access) -> u64 {
    let va = b.reserve(2 * G, 0).unwrap();
    let h = b.create(D0, G, CreateFlags::empty()).unwrap();
    b.map(va, G, h, 0).unwrap();
    b.release(h).unwrap();
    b.set_access(va, G, &[(D0, access)]).unwrap();
    va
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
        .map(|v| v as f32 / 997.0 - 0.5)
        .collect()
}

#[test]
fn strided_product_on_a_stream_equals_the_twin_bit_for_bit() {
    let b = backend();
    let w = device_work(&b).unwrap();
    let s = b.stream_create(0).unwrap();
    let va = mapped(&b, Access::ReadWrite);
    let shape = Gemm {
        m: 5,
        n: 7,
        k: 3,
        lda: 4,
        ldb: 9,
        ldc: 8,
    };
    let [ea, eb, ec] = shape.extents().unwrap();
    let (a, bm) = (values(ea, 1), values(eb, 2));
    let (pa, pb, pc) = (va, va + 4096, va + 8192);
    b.write(pa, &bytes(&a)).unwrap();
    b.write(pb, &bytes(&bm)).unwrap();
    // C's gaps hold a sentinel the product must not touch.
    let mut expect = vec![-7.0f32; ec];
    b.write(pc, &bytes(&expect)).unwrap();
    shape.run(&a, &bm, &mut expect).unwrap();
    let g = GemmF32 {
        m: 5,
        n: 7,
        k: 3,
        a: pa,
        lda: 4,
        b: pb,
        ldb: 9,
        c: pc,
        ldc: 8,
    };
    w.gemm_f32_async(s, &g).unwrap();
    b.stream_synchronize(s).unwrap();
    let mut out = vec![0u8; ec * 4];
    b.read(pc, &mut out).unwrap();
    assert_eq!(floats(&out), expect);
    assert!(floats(&out).contains(&-7.0), "gaps kept");
    b.stream_destroy(s).unwrap();
}

#[test]
fn refused_operands_are_typed_errors() {
    let b = backend();
    let w = device_work(&b).unwrap();
    let d = StreamHandle::DEFAULT;
    let rw = mapped(&b, Access::ReadWrite);
    let ro = mapped(&b, Access::Read);
    let ok = GemmF32::packed(2, 2, 2, rw, rw + 64, rw + 128);
    w.gemm_f32_async(d, &ok).unwrap();
    // Read-only output, an input in the unmapped half, a stream of another device.
    let illegal =
        |g: &GemmF32, s| matches!(w.gemm_f32_async(s, g), Err(Error::IllegalAccess { .. }));
    assert!(illegal(&GemmF32 { c: ro, ..ok }, d));
    assert!(w.gemm_f32_async(d, &GemmF32 { a: ro, ..ok }).is_ok());
    assert!(illegal(&GemmF32 { b: rw + G, ..ok }, d));
    let s1 = b.stream_create(1).unwrap();
    assert!(illegal(&ok, s1));
    b.stream_destroy(s1).unwrap();
    // Overlap through the same VA, and through a second VA of the same memory (caught on the
    // memory itself).
    assert!(matches!(
        w.gemm_f32_async(d, &GemmF32 { c: rw + 8, ..ok }),
        Err(Error::InvalidArgument(_))
    ));
    let alias = b.reserve(G, 0).unwrap();
    let h = b.create(D0, G, CreateFlags::empty()).unwrap();
    b.map(alias, G, h, 0).unwrap();
    b.set_access(alias, G, &[(D0, Access::ReadWrite)]).unwrap();
    let other = b.reserve(G, 0).unwrap();
    b.map(other, G, h, 0).unwrap();
    b.set_access(other, G, &[(D0, Access::ReadWrite)]).unwrap();
    let aliased = GemmF32::packed(2, 2, 2, alias, alias + 64, other);
    assert!(matches!(
        w.gemm_f32_async(d, &aliased),
        Err(Error::InvalidArgument(_))
    ));
    // Empty products queue nothing, even with unusable pointers.
    assert!(w
        .gemm_f32_async(d, &GemmF32::packed(0, 2, 2, 0, 0, 0))
        .is_ok());
}
