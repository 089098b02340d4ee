//! Host buffers (`host_alloc`), the safe copy scope, and the block-copy kernel's CPU twin on the
//! strict host backend.

use std::sync::Arc;

use strata_vmm::{
    copy_async_in, Access, Backend, CopyKind, CopyScope, CreateFlags, Error, HostBuffer,
    HostConfig, Location, Mapping, PhysicalMemory, Reservation, Stream,
};

fn strict() -> Arc<dyn Backend> {
    strata_vmm::host::open(HostConfig {
        devices: vec![64 << 20],
        granularity: 2 << 20,
        strict: true,
        link: None,
    })
    .unwrap()
}

#[test]
fn host_buffers_round_trip_and_free_exactly() {
    let b = strict();
    let buf = HostBuffer::new(&b, 1 << 20).unwrap();
    assert_eq!(buf.ptr() % 4096, 0);
    buf.write_at(4096, b"strata").unwrap();
    let mut out = [0u8; 6];
    buf.read_at(4096, &mut out).unwrap();
    assert_eq!(&out, b"strata");
    assert!(matches!(
        buf.write_at((1 << 20) - 2, b"abc"),
        Err(Error::InvalidArgument(_))
    ));
    // SAFETY: a pointer the backend never handed out: the backend rejects it.
    let bogus = unsafe { b.host_free(buf.ptr() + 4096, 4096) };
    assert!(matches!(bogus, Err(Error::UnknownPointer(_))));
    assert!(matches!(b.host_alloc(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        b.host_alloc(strata_vmm::MAX_HOST_CHUNK + 1),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn block_copies_gather_and_scatter_through_the_twin() {
    let b = strict();
    let work = strata_vmm::device_work(&b).unwrap();
    let g = 2 << 20;
    let res = Arc::new(Reservation::new(&b, g, 0).unwrap());
    let phys =
        Arc::new(PhysicalMemory::create(&b, Location::Device(0), g, CreateFlags::empty()).unwrap());
    let _map = Mapping::new(
        &res,
        res.ptr(),
        phys,
        0,
        g,
        &[(Location::Device(0), Access::ReadWrite)],
    )
    .unwrap();
    let stream = Stream::new(&b, 0).unwrap();
    let src = HostBuffer::new(&b, 64 << 10).unwrap();
    let dst = HostBuffer::new(&b, 64 << 10).unwrap();
    let mut pattern = vec![0u8; 64 << 10];
    strata_kernels::pattern::fill(&mut pattern, 9, 0);
    src.write_at(0, &pattern).unwrap();
    let len = 4096u64;
    // Scatter 16 host blocks to every other device block, reversed; gather them back in order.
    let scatter: Vec<_> = (0..16u64)
        .map(|i| (src.ptr() + i * len, res.ptr() + (30 - 2 * i) * len))
        .collect();
    let gather: Vec<_> = (0..16u64)
        .map(|i| (res.ptr() + (30 - 2 * i) * len, dst.ptr() + i * len))
        .collect();
    let scope = CopyScope {
        buffers: &[&src, &dst],
        reservations: &[&res],
    };
    copy_async_in(
        &b,
        stream.handle(),
        CopyKind::Blocks {
            work: &*work,
            len,
            pairs: &scatter,
        },
        scope,
    )
    .unwrap();
    let ev = copy_async_in(
        &b,
        stream.handle(),
        CopyKind::Blocks {
            work: &*work,
            len,
            pairs: &gather,
        },
        scope,
    )
    .unwrap();
    ev.synchronize().unwrap();
    stream.synchronize().unwrap();
    let mut out = vec![0u8; 64 << 10];
    dst.read_at(0, &mut out).unwrap();
    assert_eq!(out, pattern);
    // Overlapping destinations are refused at submission, with the typed error both backends
    // report (the shared rule), and nothing is queued.
    let overlap = [
        (src.ptr(), res.ptr()),
        (src.ptr() + len, res.ptr() + len / 2),
    ];
    let err = copy_async_in(
        &b,
        stream.handle(),
        CopyKind::Blocks {
            work: &*work,
            len,
            pairs: &overlap,
        },
        scope,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    stream.synchronize().unwrap();
    // A host range outside every buffer of the scope is refused before anything is queued.
    let stray = [0u8; 16];
    let bad = [(stray.as_ptr() as u64, res.ptr())];
    let err = copy_async_in(
        &b,
        stream.handle(),
        CopyKind::Blocks {
            work: &*work,
            len: 16,
            pairs: &bad,
        },
        scope,
    )
    .unwrap_err();
    assert!(matches!(err, Error::IllegalAccess { .. }), "{err}");
}
