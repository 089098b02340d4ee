//! `FaultyBackend` over the backend the environment selects (the strict host backend here, the
//! emulated driver or a GPU with `STRATA_BACKEND=cuda`): injected faults change nothing, gates
//! run before the call, slow streams are reported busy through events and synchronization.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_vmm::host::FaultOp;
use strata_vmm::{
    Access, Backend, CopyDesc, CreateFlags, Error, FaultyBackend, HostConfig, Location,
    StreamHandle,
};

const D0: Location = Location::Device(0);

fn faulty() -> Arc<FaultyBackend> {
    let inner = strata_vmm::host_or_cuda(HostConfig {
        devices: vec![64 << 20],
        granularity: 2 << 20,
        strict: true,
        link: None,
    })
    .expect("backend");
    FaultyBackend::new(inner)
}

#[test]
fn injected_faults_fail_once_and_change_nothing() {
    let f = faulty();
    let b: Arc<dyn Backend> = f.clone();
    let g = b.granularity(D0).unwrap();
    let before = b.live_counts();
    f.inject_fault(FaultOp::Create, 2);
    let h = b.create(D0, g, CreateFlags::empty()).unwrap();
    let err = b.create(D0, g, CreateFlags::empty()).unwrap_err();
    assert!(matches!(err, Error::InjectedFault("create")), "{err}");
    assert_eq!(b.live_counts().handles, before.handles + 1);
    let va = b.reserve(g, 0).unwrap();
    for op in [
        FaultOp::Map,
        FaultOp::SetAccess,
        FaultOp::Copy,
        FaultOp::Unmap,
    ] {
        f.inject_fault(op, 1);
        let err = match op {
            FaultOp::Map => b.map(va, g, h, 0),
            FaultOp::SetAccess => {
                b.map(va, g, h, 0).unwrap();
                b.set_access(va, g, &[(D0, Access::ReadWrite)])
            }
            FaultOp::Copy => {
                b.set_access(va, g, &[(D0, Access::ReadWrite)]).unwrap();
                b.write(va, &[7u8; 64])
            }
            _ => b.unmap(va, g),
        }
        .unwrap_err();
        assert!(
            matches!(err, Error::InjectedFault(n) if n == op.name()),
            "{op:?}: {err}"
        );
    }
    // The failed unmap left the mapping and its bytes; the failed copy wrote nothing.
    let mut back = [1u8; 64];
    b.read(va, &mut back).unwrap();
    assert_ne!(back, [7u8; 64]);
    b.write(va, &[9u8; 64]).unwrap();
    b.read(va, &mut back).unwrap();
    assert_eq!(back, [9u8; 64]);
    b.unmap(va, g).unwrap();
    b.free_va(va, g).unwrap();
    b.release(h).unwrap();
    assert_eq!(b.live_counts(), before);
}

#[test]
fn a_gate_runs_before_its_call_on_the_calling_thread() {
    let f = faulty();
    let b: Arc<dyn Backend> = f.clone();
    let g = b.granularity(D0).unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls);
    let counts = Arc::clone(&f);
    f.set_op_gate(
        FaultOp::Create,
        Some(Arc::new(move |op| {
            assert_eq!(op, FaultOp::Create);
            // Before the call: the handle does not exist yet.
            assert_eq!(counts.live_counts().handles, 0);
            seen.fetch_add(1, Ordering::SeqCst);
        })),
    );
    let h = b.create(D0, g, CreateFlags::empty()).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    f.set_op_gate(FaultOp::Create, None);
    b.release(h).unwrap();
}

#[test]
fn a_slow_stream_is_busy_until_its_latency_passed_and_orders_waiting_streams() {
    const LATENCY: Duration = Duration::from_millis(200);
    let f = faulty();
    let b: Arc<dyn Backend> = f.clone();
    let g = b.granularity(D0).unwrap();
    let h = b.create(D0, g, CreateFlags::empty()).unwrap();
    let va = b.reserve(g, 0).unwrap();
    b.map(va, g, h, 0).unwrap();
    b.set_access(va, g, &[(D0, Access::ReadWrite)]).unwrap();
    let (slow, other) = (b.stream_create(0).unwrap(), b.stream_create(0).unwrap());
    let (on_slow, on_other) = (b.event_create().unwrap(), b.event_create().unwrap());
    f.set_stream_latency(slow, Some(LATENCY));
    let start = Instant::now();
    // SAFETY: both ranges are device memory mapped read-write above.
    unsafe {
        b.copy_async(
            slow,
            &[CopyDesc {
                dst: va + g / 2,
                src: va,
                len: g / 2,
            }],
        )
        .unwrap()
    };
    b.event_record(on_slow, slow).unwrap();
    // Work on another stream behind the slow one's event is not done before it either.
    b.stream_wait_event(other, on_slow).unwrap();
    b.memset_async(other, va, 1, 64).unwrap();
    b.event_record(on_other, other).unwrap();
    assert!(!b.event_query(on_slow).unwrap());
    assert!(!b.event_query(on_other).unwrap());
    b.event_synchronize(on_other).unwrap();
    assert!(start.elapsed() >= LATENCY);
    assert!(b.event_query(on_slow).unwrap());
    // Back to the inner backend's speed: new work adds no latency.
    f.set_stream_latency(slow, None);
    let start = Instant::now();
    b.memset_async(slow, va, 2, 64).unwrap();
    b.event_record(on_slow, slow).unwrap();
    b.event_synchronize(on_slow).unwrap();
    assert!(b.event_query(on_slow).unwrap());
    assert!(start.elapsed() < LATENCY, "{:?}", start.elapsed());
    for e in [on_slow, on_other] {
        b.event_destroy(e).unwrap();
    }
    for s in [slow, other] {
        b.stream_destroy(s).unwrap();
    }
    b.stream_synchronize(StreamHandle::DEFAULT).unwrap();
    b.unmap(va, g).unwrap();
    b.free_va(va, g).unwrap();
    b.release(h).unwrap();
}
