//! KVPR's device runtime on the strict host backend: the merged KV read back equals the fully
//! transferred KV bit for bit (the data are small integers, so every FP32 partial sum is exact
//! and the "transferred" KV is computed by the same GEMM twin), for split points at both ends,
//! in between, and where the planner puts them; also under a slow link, where only events order
//! the recompute after `X` and the merge after the copy.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::kvpr::Data;
use strata_tiers::kvpr::{
    plan_split, transfer_recompute_device, HostLayer, KvprDevice, PinnedLayer, Schedule,
    SplitInputs,
};
use strata_vmm::host::{Link, LinkModel};
use strata_vmm::{Backend, Error, GemmF32};

/// `bandwidth` and `latency` towards the device; reads back are free, so a result read before
/// its copies landed would show.
fn link(bandwidth: f64, latency: Duration) -> LinkModel {
    let free = Link {
        bandwidth: f64::INFINITY,
        latency: Duration::ZERO,
    };
    LinkModel {
        host_to_device: Link { bandwidth, latency },
        device_to_host: free,
        device_to_device: free,
    }
}

/// Where the planner splits `d` (Table 1's link and GPU, scaled so that the split lands
/// strictly inside for the sizes here).
fn planned_l(d: &Data) -> usize {
    let inputs = SplitInputs {
        batch: 1,
        seq: d.seq as u64,
        hidden: d.hidden as u64,
        bytes_per_elem: 4,
        v_com: 32e9,
        v_gpu: 312e12 * d.hidden as f64 / 4096.0 / 64.0,
    };
    plan_split(&inputs, Schedule::RowByRow).l as usize
}

fn assert_merged(backend: &Arc<dyn Backend>, d: &Data, l: usize) {
    let kv = transfer_recompute_device(backend, 0, &d.layer(), l).unwrap();
    let (k, v) = kv.read_back().unwrap();
    assert!(k == d.k, "K differs at s' = {}, l = {l}", d.seq);
    assert!(v == d.v, "V differs at s' = {}, l = {l}", d.seq);
}

#[test]
fn merged_kv_equals_the_transferred_kv_for_every_kind_of_split() {
    let b = common::backend(None);
    for (seq, hidden) in [(1, 8), (37, 16), (64, 32)] {
        let d = Data::integers(seq, hidden);
        let planned = planned_l(&d);
        assert!(planned <= seq);
        for l in [0, 1.min(seq), seq / 2, planned, seq] {
            assert_merged(&b, &d, l);
        }
    }
    let d = Data::integers(64, 32);
    let planned = planned_l(&d);
    assert!(planned > 0 && planned < 64, "planner picked l = {planned}");
    assert_eq!(b.live_counts().mappings, 0, "device memory returned");
}

#[test]
fn a_slow_link_still_gives_the_transferred_kv() {
    // 25 GB/s and 5 µs (STRATA_HOST_LINK=25GB,5us), then a link so slow that the recompute
    // would read zeros if it did not wait for X's event, and a read after `ready` would see a
    // half-empty merge if `ready` did not wait for the KV copy. Results are read as soon as
    // `ready` completes, with the streams still running.
    for model in [
        link(25e9, Duration::from_micros(5)),
        link(20e6, Duration::from_millis(3)),
    ] {
        let b = common::backend(Some(model));
        let d = Data::integers(48, 32);
        let runtime = KvprDevice::new(&b, 0, &d.w_k, &d.w_v, d.hidden).unwrap();
        let pinned = PinnedLayer::new(&b, &d.layer()).unwrap();
        for l in [0, 5, planned_l(&d), 40, 48] {
            let (k, v) = runtime.run(&pinned, l).unwrap().read_back().unwrap();
            assert!(k == d.k && v == d.v, "merge differs at l = {l}");
        }
        runtime.synchronize().unwrap();
    }
}

#[test]
fn one_runtime_serves_many_layers_and_results_wait_only_on_events() {
    let b = common::backend(Some(link(50e6, Duration::from_millis(1))));
    let d = Data::integers(40, 16);
    let runtime = KvprDevice::new(&b, 0, &d.w_k, &d.w_v, d.hidden).unwrap();
    let pinned = PinnedLayer::new(&b, &d.layer()).unwrap();
    // Queue several loads before reading any: each result is ordered by its own events.
    let loads: Vec<_> = [3, 0, 40, 17]
        .into_iter()
        .map(|l| runtime.run(&pinned, l).unwrap())
        .collect();
    for kv in &loads {
        let (k, v) = kv.read_back().unwrap();
        assert!(k == d.k && v == d.v);
    }
    runtime.synchronize().unwrap();
}

#[test]
fn bad_input_is_a_typed_error() {
    let b = common::backend(None);
    let d = Data::integers(8, 4);
    let invalid = |r: Result<(), Error>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(invalid(
        transfer_recompute_device(&b, 0, &d.layer(), 9).map(drop)
    ));
    let short_x = HostLayer {
        x: &d.x[..7 * 4],
        ..d.layer()
    };
    assert!(invalid(
        transfer_recompute_device(&b, 0, &short_x, 2).map(drop)
    ));
    let wrong_hidden = HostLayer {
        hidden: 3,
        ..d.layer()
    };
    assert!(invalid(
        transfer_recompute_device(&b, 0, &wrong_hidden, 2).map(drop)
    ));
    assert!(invalid(
        KvprDevice::new(&b, 0, &d.w_k[1..], &d.w_v, 4).map(drop)
    ));
    // A runtime for hidden 4 refuses a layer of hidden 8, and a split beyond s'.
    let runtime = KvprDevice::new(&b, 0, &d.w_k, &d.w_v, 4).unwrap();
    let wide = Data::integers(8, 8);
    let pinned = PinnedLayer::new(&b, &wide.layer()).unwrap();
    assert!(invalid(runtime.run(&pinned, 1).map(drop)));
    let pinned = PinnedLayer::new(&b, &d.layer()).unwrap();
    assert!(invalid(runtime.run(&pinned, 9).map(drop)));
    assert!(matches!(
        KvprDevice::new(&b, 7, &d.w_k, &d.w_v, 4).map(drop),
        Err(Error::NoDevice(7))
    ));
}

#[test]
fn gemm_on_host_memory_or_a_wrong_shape_is_refused() {
    let b = strata_vmm::device_work(&common::backend(None)).unwrap();
    let host = vec![0f32; 64];
    let p = host.as_ptr() as u64;
    assert!(matches!(
        b.gemm_f32_async(
            strata_vmm::StreamHandle::DEFAULT,
            &GemmF32::packed(2, 2, 2, p, p + 16, p + 32)
        ),
        Err(Error::IllegalAccess { .. })
    ));
    assert!(matches!(
        b.gemm_f32_async(
            strata_vmm::StreamHandle::DEFAULT,
            &GemmF32::packed(2, 2, 0, p, p + 16, p + 32)
        ),
        Err(Error::InvalidArgument(_))
    ));
}
