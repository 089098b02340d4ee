//! Harvest on a real GPU. GPU-only: `#[ignore]`d so it shows as skipped where there is no GPU;
//! on a GPU machine run `cargo test -p strata-tiers --test harvest_gpu -- --include-ignored`.
//! With one GPU the device lends to itself (the path, not the bandwidth, is what is checked);
//! with two or more, device 1 lends to device 0 over real peer copies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use strata_tiers::harvest::{Endpoint, HarvestConfig, HarvestController, HarvestHints};
use strata_tiers::Durability;
use strata_vmm::{Backend, CudaBackend, Error, HostBuffer};

#[test]
#[ignore = "needs a CUDA device: run with --include-ignored on a GPU machine"]
fn harvest_on_a_gpu_copies_and_revokes_in_order() {
    let backend: Arc<dyn Backend> = match CudaBackend::new() {
        Ok(b) => Arc::new(b),
        Err(Error::NoDriver(why)) => return println!("skipped: no CUDA device ({why})"),
        Err(Error::NoDevice(d)) => return println!("skipped: no CUDA device ({d})"),
        Err(other) => panic!("CudaBackend::new failed unexpectedly: {other}"),
    };
    let n = backend.device_count() as usize;
    let mut config = HarvestConfig::new(n);
    config.allow_self = n == 1;
    let c = HarvestController::new(Arc::clone(&backend), config).unwrap();
    let len: u64 = 64 << 20;
    let h = c
        .harvest_alloc(len, &HarvestHints::new(0, Durability::Lossy))
        .unwrap();
    assert_eq!(h.device, if n == 1 { 0 } else { 1 });
    let data: Vec<u8> = (0..len as usize).map(|i| (i % 251) as u8).collect();
    let src = HostBuffer::new(&backend, len).unwrap();
    src.write_at(0, &data).unwrap();
    c.copy_in(
        &h,
        0,
        Endpoint::Host {
            buffer: &src,
            offset: 0,
        },
        len,
    )
    .unwrap()
    .synchronize()
    .unwrap();
    let out = HostBuffer::new(&backend, len).unwrap();
    let ev = c
        .copy_out(
            &h,
            0,
            Endpoint::Host {
                buffer: &out,
                offset: 0,
            },
            len,
        )
        .unwrap();
    let drained = Arc::new(AtomicBool::new(false));
    let (flag, ev2) = (Arc::clone(&drained), Arc::clone(&ev));
    c.harvest_on_revoke(
        &h,
        Box::new(move |r| {
            assert!(r.lost());
            flag.store(ev2.query().unwrap(), Ordering::SeqCst);
        }),
    )
    .unwrap();
    let report = c.reclaim(h.device, len).unwrap();
    assert_eq!(report.revoked, vec![h]);
    assert!(
        drained.load(Ordering::SeqCst),
        "callback ran before the copy drained"
    );
    let mut back = vec![0u8; len as usize];
    out.read_at(0, &mut back).unwrap();
    assert!(back == data, "the drained copy delivered every byte");
    assert!(matches!(
        c.copy_out(
            &h,
            0,
            Endpoint::Host {
                buffer: &out,
                offset: 0
            },
            1
        ),
        Err(Error::StaleId { .. })
    ));
}
