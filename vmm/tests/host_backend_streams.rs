//! The host backend's streams and events: ordering, the link model, errors at synchronize,
//! fault injection, and use from many threads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_vmm::host::FaultOp;
use strata_vmm::{CopyDesc, CreateFlags, Error, LiveCounts, Location, StreamHandle};

mod host_support;
use host_support::*;

#[test]
fn streams_run_in_order() {
    let b = backend();
    let (va, h) = mapped(&b, G, &[(D0, RW)]);
    let s = b.stream_create(0).unwrap();
    let bufs: Vec<Vec<u8>> = (0..20).map(|i| vec![i as u8; 4096]).collect();
    for buf in &bufs {
        copy(&b, s, va, buf.as_ptr() as u64, 4096).unwrap();
    }
    let mut out = vec![0u8; 4096];
    // Device → host after the writes, same stream: sees the last one.
    copy(&b, s, out.as_mut_ptr() as u64, va, 4096).unwrap();
    b.stream_synchronize(s).unwrap();
    assert!(out.iter().all(|&x| x == 19));
    // A batch with several descriptors runs in order too.
    let src = pattern(4096, 5);
    let mut back = vec![0u8; 4096];
    let batch = [
        CopyDesc {
            dst: va + 8192,
            src: src.as_ptr() as u64,
            len: 4096,
        },
        CopyDesc {
            dst: va + 65536,
            src: va + 8192,
            len: 4096,
        },
        CopyDesc {
            dst: back.as_mut_ptr() as u64,
            src: va + 65536,
            len: 4096,
        },
    ];
    // SAFETY: `src` and `back` outlive the synchronize below and nobody else touches them.
    unsafe { b.copy_async(s, &batch).unwrap() };
    b.stream_synchronize(s).unwrap();
    assert_eq!(back, src);
    b.stream_destroy(s).unwrap();
    teardown(&b, va, G, h);
}

#[test]
fn events_order_work_across_streams() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let len = 8u64 << 20; // ~84 ms on the modelled link
    let (va, h) = mapped(&b, 4 * G, &[(D0, RW)]);
    let a = b.stream_create(0).unwrap();
    let s = b.stream_create(0).unwrap();
    let ev = b.event_create().unwrap();
    assert!(b.event_query(ev).unwrap(), "never recorded: complete");
    let src = pattern(len as usize, 77);
    let mut out = vec![0u8; len as usize];
    let start = Instant::now();
    copy(&b, a, va, src.as_ptr() as u64, len).unwrap();
    b.event_record(ev, a).unwrap();
    assert!(
        !b.event_query(ev).unwrap(),
        "the slow copy is still running"
    );
    b.stream_wait_event(s, ev).unwrap();
    copy(&b, s, out.as_mut_ptr() as u64, va, len).unwrap();
    b.stream_synchronize(s).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(160),
        "both copies took modelled time"
    );
    assert!(b.event_query(ev).unwrap());
    assert!(out == src, "stream s read only after the event");
    // Event synchronize and a wait on the default stream block the host.
    copy(&b, a, va, src.as_ptr() as u64, 1 << 20).unwrap();
    b.event_record(ev, a).unwrap();
    b.event_synchronize(ev).unwrap();
    assert!(b.event_query(ev).unwrap());
    b.event_record(ev, StreamHandle::DEFAULT).unwrap();
    assert!(b.event_query(ev).unwrap());
    b.stream_wait_event(StreamHandle::DEFAULT, ev).unwrap();
    b.event_destroy(ev).unwrap();
    assert!(matches!(
        b.event_query(ev),
        Err(Error::InvalidHandle { .. })
    ));
    assert!(matches!(
        b.event_destroy(ev),
        Err(Error::InvalidHandle { .. })
    ));
    b.stream_destroy(a).unwrap();
    b.stream_destroy(s).unwrap();
    teardown(&b, va, 4 * G, h);
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn link_model_applies_on_the_default_stream() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let (va, h) = mapped(&b, 2 * G, &[(D0, RW)]);
    let data = vec![1u8; 2 << 20];
    let start = Instant::now();
    b.write(va, &data).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(20));
    teardown(&b, va, 2 * G, h);
}

#[test]
fn execution_time_errors_surface_at_synchronize() {
    let b = strata_vmm::host::open(slow_config()).unwrap();
    let (va, h) = mapped(&b, 4 * G, &[(D0, RW)]);
    let (vb, hb) = mapped(&b, G, &[(D0, RW)]);
    let s = b.stream_create(0).unwrap();
    let ev = b.event_create().unwrap();
    let src = pattern(4 << 20, 1);
    let mut out = vec![0u8; 4096];
    copy(&b, s, va, src.as_ptr() as u64, 4 << 20).unwrap(); // ~43 ms
    copy(&b, s, out.as_mut_ptr() as u64, vb, 4096).unwrap(); // valid now...
    b.event_record(ev, s).unwrap();
    // ...but its source is gone by the time it runs (callers must sync before unmapping; this
    // one does not, which on a GPU is an illegal address).
    b.unmap(vb, G).unwrap();
    let err = b.stream_synchronize(s).unwrap_err();
    assert!(
        matches!(err, Error::Async { stream, .. } if stream == s.0),
        "{err}"
    );
    assert!(b.event_query(ev).unwrap(), "later events still complete");
    b.stream_synchronize(s).unwrap();
    // The stream still works.
    let mut back = vec![0u8; 4096];
    copy(&b, s, back.as_mut_ptr() as u64, va, 4096).unwrap();
    b.stream_synchronize(s).unwrap();
    assert_eq!(back, src[..4096]);
    // An error pending at destroy is reported there.
    b.map(vb, G, hb, 0).unwrap();
    b.set_access(vb, G, &[(D0, RW)]).unwrap();
    copy(&b, s, va, src.as_ptr() as u64, 4 << 20).unwrap();
    copy(&b, s, out.as_mut_ptr() as u64, vb, 4096).unwrap();
    b.unmap(vb, G).unwrap();
    assert!(matches!(b.stream_destroy(s), Err(Error::Async { .. })));
    assert_eq!(b.live_counts().streams, 0);
    b.event_destroy(ev).unwrap();
    b.release(hb).unwrap();
    b.free_va(vb, G).unwrap();
    teardown(&b, va, 4 * G, h);
    assert_eq!(b.live_counts(), LiveCounts::default());
}

#[test]
fn injected_faults_fail_the_nth_call_and_leak_nothing() {
    let b = backend();
    let hb = host(&b);
    let baseline = b.live_counts();
    let va = b.reserve(4 * G, 0).unwrap();

    hb.inject_fault(FaultOp::Create, 2);
    let h1 = b.create(D0, G, CreateFlags::empty()).unwrap();
    assert!(matches!(
        b.create(D0, G, CreateFlags::empty()),
        Err(Error::InjectedFault("create"))
    ));
    assert_eq!(
        b.mem_info(0).unwrap().free,
        DEV - G,
        "the failed create charged nothing"
    );
    let h2 = b.create(D0, G, CreateFlags::empty()).unwrap();

    hb.inject_fault(FaultOp::Map, 1);
    assert!(matches!(
        b.map(va, G, h1, 0),
        Err(Error::InjectedFault("map"))
    ));
    assert_eq!(b.live_counts().mappings, 0);
    b.map(va, G, h1, 0).unwrap();
    b.map(va + G, G, h2, 0).unwrap();

    hb.inject_fault(FaultOp::SetAccess, 2);
    b.set_access(va, G, &[(D0, RW)]).unwrap();
    assert!(matches!(
        b.set_access(va + G, G, &[(D0, RW)]),
        Err(Error::InjectedFault("set_access"))
    ));
    let mut buf = [0u8; 8];
    assert!(
        matches!(b.read(va + G, &mut buf), Err(Error::IllegalAccess { .. })),
        "no grant was made"
    );
    b.set_access(va + G, G, &[(D0, RW)]).unwrap();

    hb.inject_fault(FaultOp::Copy, 3);
    b.write(va, &[1; 8]).unwrap();
    b.write(va, &[2; 8]).unwrap();
    assert!(matches!(
        b.write(va, &[3; 8]),
        Err(Error::InjectedFault("copy"))
    ));
    b.read(va, &mut buf).unwrap();
    assert_eq!(buf, [2; 8], "the failed copy wrote nothing");

    hb.inject_fault(FaultOp::Create, 1);
    hb.clear_faults();
    let h3 = b.create(D0, G, CreateFlags::empty()).unwrap();

    b.unmap(va, 2 * G).unwrap();
    for h in [h1, h2, h3] {
        b.release(h).unwrap();
    }
    b.free_va(va, 4 * G).unwrap();
    assert_eq!(b.live_counts(), baseline);
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
}

#[test]
fn concurrent_use_from_many_threads() {
    let b = backend();
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let s = b.stream_create(u32::from(t % 2)).unwrap();
                for i in 0..20u8 {
                    let (va, h) = mapped(&b, G, &[(Location::Device(u32::from(t % 2)), RW)]);
                    let data = vec![t ^ i; 4096];
                    let mut out = vec![0u8; 4096];
                    copy(&b, s, va, data.as_ptr() as u64, 4096).unwrap();
                    copy(&b, s, out.as_mut_ptr() as u64, va, 4096).unwrap();
                    b.stream_synchronize(s).unwrap();
                    assert_eq!(out, data);
                    teardown(&b, va, G, h);
                }
                b.stream_destroy(s).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(b.live_counts(), LiveCounts::default());
    assert_eq!(b.mem_info(0).unwrap().free, DEV);
}
