//! MIRAGE on the strict host backend: reclaimed parameter pages become KV capacity (the same
//! physical pages), streamed layers reload bit-identical behind events, reversion restores all.

use std::sync::Arc;
use std::time::Duration;

use strata_allocator::{Kind, KvConfig, KvSpace, PagePool, PoolConfig};
use strata_kernels::pattern;
use strata_tiers::mirage::plan::ring_gaps;
use strata_tiers::mirage::{Buffering, Mirage, ModelId};
use strata_vmm::host::{Link, LinkModel};
use strata_vmm::{
    copy_async_in, Access, Backend, BackendKind, CopyDesc, CopyKind, CopyScope, CreateFlags, Error,
    Event, HostConfig, Location, Mapping, PhysHandle, PhysicalMemory, Reservation, Stream,
};

/// The host backend's page in these tests.
const HOST_PAGE: u64 = 64 << 10;

fn backend(link: Option<LinkModel>) -> Arc<dyn Backend> {
    strata_vmm::host_or_cuda(HostConfig {
        devices: vec![64 << 20],
        granularity: HOST_PAGE,
        strict: true,
        link,
    })
    .expect("host backend")
}

/// One page of `b`: 64 KiB on the host backend, the driver's granularity on CUDA (2 MiB on an
/// H200). Layers, KV tensors and limits are counted in pages.
fn page(b: &Arc<dyn Backend>) -> u64 {
    b.granularity(Location::Device(0)).expect("granularity")
}

fn pool(b: &Arc<dyn Backend>, limit_pages: Option<u64>) -> Arc<PagePool> {
    PagePool::new(
        Arc::clone(b),
        0,
        PoolConfig {
            low_watermark: 0,
            high_watermark: 0,
            limit: limit_pages.map(|p| p * page(b)),
            idle_trim_after: None,
            background: false,
        },
    )
    .expect("pool")
}

fn seed(model: ModelId, layer: u32) -> u64 {
    u64::from(model.0) * 1000 + u64::from(layer) + 1
}

fn register(m: &mut Mirage, layers: u32, cap: u32) -> ModelId {
    let next = ModelId(m.controller().remap_order().len() as u32);
    let page = page(m.engine().backend());
    m.register_model(layers, page, cap, |l, buf| {
        pattern::fill(buf, seed(next, l), 0)
    })
    .expect("register")
}

/// A Mirage with an active and an idle model of `layers` layers (caps `caps`), `T_c` = 50 ms.
fn active_and_idle(
    b: &Arc<dyn Backend>,
    kv_pool: &Arc<PagePool>,
    layers: u32,
    caps: (u32, u32),
) -> (Mirage, ModelId, ModelId) {
    let mut m = Mirage::new(pool(b, None), Arc::clone(kv_pool)).unwrap();
    let active = register(&mut m, layers, caps.0);
    let idle = register(&mut m, layers, caps.1);
    let c = m.controller_mut();
    c.set_active(active, true);
    c.report_compute(active, Duration::from_millis(50));
    c.report_compute(idle, Duration::from_millis(50));
    (m, active, idle)
}

fn check_bytes(b: &Arc<dyn Backend>, ptr: u64, seed: u64) {
    let mut buf = vec![0u8; page(b) as usize];
    b.read(ptr, &mut buf).unwrap();
    assert_eq!(
        pattern::first_mismatch(&buf, seed, 0),
        None,
        "bytes at {ptr:#x} are not pattern {seed}"
    );
}

/// A KV space of 1 layer whose slots take one page per tensor (2 pages per request).
fn kv(pool: &Arc<PagePool>) -> KvSpace {
    KvSpace::new(
        Arc::clone(pool),
        KvConfig {
            layers: 1,
            max_slots: 4,
            max_tokens: (pool.page_size() / 64) as u32,
            bytes_per_token: 64,
            zero_page: false,
        },
    )
    .unwrap()
}

/// Reads one page of `handle` through a second mapping of its own.
fn read_handle(b: &Arc<dyn Backend>, handle: PhysHandle) -> Vec<u8> {
    let va = b.reserve(page(b), 0).unwrap();
    b.map(va, page(b), handle, 0).unwrap();
    b.set_access(va, page(b), &[(Location::Device(0), Access::Read)])
        .unwrap();
    let mut buf = vec![0u8; page(b) as usize];
    b.read(va, &mut buf).unwrap();
    b.unmap(va, page(b)).unwrap();
    b.free_va(va, page(b)).unwrap();
    buf
}

#[test]
fn reclaimed_parameter_pages_are_the_kv_pages_and_revert_bit_identical() {
    let b = backend(None);
    let kv_pool = pool(&b, Some(4));
    let (mut m, active, idle) = active_and_idle(&b, &kv_pool, 8, (4, 4));
    let before: Vec<Vec<PhysHandle>> = (0..8)
        .map(|l| m.registry().layer_handles(idle, l).unwrap())
        .collect();

    // The KV pool is full after two requests.
    let mut space = kv(&kv_pool);
    let a = space.admit().unwrap();
    space.grow(a, 1).unwrap();
    let s2 = space.admit().unwrap();
    space.grow(s2, 1).unwrap();
    let s3 = space.admit().unwrap();
    let e = space.grow(s3, 1).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");

    // Two pages short: the inactive model gives two layers (α = 2, m = 3, one slot).
    let d = m.step(m.pressure(2)).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].model, idle, "the inactive model goes first");
    let plan = m.registry().plan(idle).unwrap().clone();
    assert_eq!((plan.alpha, plan.buffering), (2, Some(Buffering::Single)));
    assert_eq!(plan.streamed.len(), 3);
    let gaps = ring_gaps(8, &plan.streamed);
    assert!(
        gaps.iter().all(|&g| g == 2 || g == 3),
        "uniform over the 8-layer ring: {:?}",
        plan.streamed
    );
    assert_eq!(m.registry().gpu_pages(idle).unwrap(), 6);
    assert_eq!(m.registry().gpu_pages(active).unwrap(), 8);
    let st = kv_pool.stats();
    assert_eq!((st.free, st.adopted_total), (2, 2));

    // KvSpace grows again, on exactly those pages.
    space.grow(s3, 1).unwrap();
    assert_eq!(kv_pool.stats().free, 0);
    let s4 = space.admit().unwrap();
    assert!(space.grow(s4, 1).unwrap_err().is_out_of_memory());
    let mut k = vec![0u8; page(&b) as usize];
    let mut v = vec![0u8; page(&b) as usize];
    pattern::fill(&mut k, 77, 0);
    pattern::fill(&mut v, 88, 0);
    b.write(space.slot_ptr(s3, 0, Kind::K).unwrap(), &k)
        .unwrap();
    b.write(space.slot_ptr(s3, 0, Kind::V).unwrap(), &v)
        .unwrap();
    let streamed_handles: Vec<PhysHandle> = plan
        .streamed
        .iter()
        .flat_map(|&l| before[l as usize].clone())
        .collect();
    let seen: Vec<Vec<u8>> = streamed_handles
        .iter()
        .map(|&h| read_handle(&b, h))
        .collect();
    assert_eq!(seen.iter().filter(|buf| **buf == k).count(), 1);
    assert_eq!(seen.iter().filter(|buf| **buf == v).count(), 1);
    // Resident layers kept their pages and bytes.
    for l in (0..8).filter(|l| !plan.is_streamed(*l)) {
        assert_eq!(
            m.registry().layer_handles(idle, l).unwrap(),
            before[l as usize]
        );
        check_bytes(&b, m.layer_ptr(idle, l).unwrap(), seed(idle, l));
    }

    // One token of the idle model: every streamed layer reloads through the slot.
    let compute = Stream::new(&b, 0).unwrap();
    for l in 0..8 {
        run_layer(&mut m, &compute, idle, l, false);
    }
    compute.synchronize().unwrap();

    // Pressure falls: requests finish, their pages return, and reversion restores everything.
    space.free(s3).unwrap();
    space.free(s2).unwrap();
    space.reclaim_deferred();
    assert_eq!(kv_pool.stats().free, 4);
    let r = m.step(m.pressure(0)).unwrap();
    assert_eq!(r.len(), 1);
    assert!(!r[0].is_remap());
    assert_eq!(m.registry().plan(idle).unwrap().alpha, 0);
    assert_eq!(m.registry().gpu_pages(idle).unwrap(), 8);
    assert_eq!(kv_pool.stats().free, 2);
    for l in 0..8 {
        assert_eq!(m.registry().layer_handles(idle, l).unwrap().len(), 1);
        check_bytes(&b, m.layer_ptr(idle, l).unwrap(), seed(idle, l));
        check_bytes(&b, m.layer_ptr(active, l).unwrap(), seed(active, l));
    }
    drop(space);
}

#[test]
fn per_model_cap_then_active_models() {
    let b = backend(None);
    let kv_pool = pool(&b, Some(0));
    let (mut m, active, idle) = active_and_idle(&b, &kv_pool, 6, (2, 1));
    let d = m.step(m.pressure(3)).unwrap();
    let moved: Vec<_> = d.iter().map(|d| (d.model, d.plan.alpha)).collect();
    assert_eq!(moved, vec![(idle, 1), (active, 2)]);
    assert_eq!(kv_pool.stats().free, 3);
    // Everything capped: more pressure changes nothing.
    assert!(m.step(m.pressure(1)).unwrap().is_empty());
    let r = m.revert_all().unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(kv_pool.stats().free, 0);
    for id in [active, idle] {
        for l in 0..6 {
            check_bytes(&b, m.layer_ptr(id, l).unwrap(), seed(id, l));
        }
    }
}

#[test]
fn pools_of_two_devices_do_not_mix() {
    let b = strata_vmm::host::open(HostConfig {
        devices: vec![16 << 20, 16 << 20],
        granularity: HOST_PAGE,
        strict: true,
        link: None,
    })
    .unwrap();
    let p0 = pool(&b, None);
    let p1 = PagePool::new(
        Arc::clone(&b),
        1,
        PoolConfig {
            background: false,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    assert!(matches!(
        Mirage::new(Arc::clone(&p0), Arc::clone(&p1)),
        Err(Error::InvalidArgument(_))
    ));
    // One Mirage per device: device 1's parameters go to device 1's KV pool only.
    let kv1 = PagePool::new(
        Arc::clone(&b),
        1,
        PoolConfig {
            low_watermark: 0,
            high_watermark: 0,
            limit: Some(0),
            idle_trim_after: None,
            background: false,
        },
    )
    .unwrap();
    let mut m1 = Mirage::new(p1, Arc::clone(&kv1)).unwrap();
    let id = register(&mut m1, 4, 2);
    m1.controller_mut()
        .report_compute(id, Duration::from_millis(50));
    m1.step(m1.pressure(1)).unwrap();
    assert_eq!(kv1.stats().free, 1);
    assert_eq!(p0.stats().in_use, 0);
    for l in 0..4 {
        if !m1.registry().plan(id).unwrap().is_streamed(l) {
            check_bytes(&b, m1.layer_ptr(id, l).unwrap(), seed(id, l));
        }
    }
}

fn slow_link() -> LinkModel {
    LinkModel {
        // 64 KiB in ~20 ms host → device; device → device slower still.
        host_to_device: Link {
            bandwidth: 3.2e6,
            latency: Duration::from_millis(1),
        },
        device_to_host: Link {
            bandwidth: 3.2e6,
            latency: Duration::from_millis(1),
        },
        device_to_device: Link {
            bandwidth: 1.6e6,
            latency: Duration::from_millis(1),
        },
    }
}

#[test]
fn prepare_events_complete_only_after_the_bytes_and_wait_for_compute() {
    let b = backend(Some(slow_link()));
    if b.kind() != BackendKind::Host {
        // The controller measures T_T on streams of its own, slowed only by the host link model.
        strata_test_support::skip(
            "prepare_events_complete_only_after_the_bytes_and_wait_for_compute",
            "needs the host backend's link model (copies of 20 ms) to keep loads in flight",
        );
        return;
    }
    let params = pool(&b, None);
    let kv_pool = pool(&b, Some(0));
    let mut m = Mirage::new(params, Arc::clone(&kv_pool)).unwrap();
    let id = register(&mut m, 8, 4);
    let t_t = m.controller().transfer_time().unwrap();
    assert!(t_t >= Duration::from_millis(15), "T_T measured: {t_t:?}");
    m.controller_mut()
        .report_compute(id, Duration::from_millis(200));
    m.step(m.pressure(1)).unwrap();
    let plan = m.registry().plan(id).unwrap().clone();
    assert_eq!((plan.alpha, plan.streamed.clone()), (1, vec![0, 4]));

    // The first load: not complete right after submission, complete with the bytes.
    let ev0 = m.prepare_layer(id, 0).unwrap();
    assert!(
        !ev0.query().unwrap(),
        "complete before the copy could finish"
    );
    ev0.synchronize().unwrap();
    let slot = m.layer_ptr(id, 0).unwrap();
    check_bytes(&b, slot, seed(id, 0));
    assert!(matches!(m.layer_ptr(id, 4), Err(Error::InvalidState(_))));

    // Layer 4 needs the one slot: refused until layer 0 reported its compute done (Eq. 4's
    // case: the look-ahead has nothing to start either).
    assert!(m.prepare_next(id, 0).unwrap().is_none());
    assert!(matches!(
        m.prepare_layer(id, 4),
        Err(Error::InvalidState(_))
    ));

    // "Kernel" of layer 0: a slow device copy reading the slot on the compute stream.
    let compute = Stream::new(&b, 0).unwrap();
    let out = Arc::new(Reservation::new(&b, page(&b), 0).unwrap());
    let phys = Arc::new(
        PhysicalMemory::create(&b, Location::Device(0), page(&b), CreateFlags::empty()).unwrap(),
    );
    let _map = Mapping::new(
        &out,
        out.ptr(),
        phys,
        0,
        page(&b),
        &[(Location::Device(0), Access::ReadWrite)],
    )
    .unwrap();
    let res = Arc::clone(m.registry().reservation(id).unwrap());
    let done = copy_async_in(
        &b,
        compute.handle(),
        CopyKind::Batch(&[CopyDesc {
            dst: out.ptr(),
            src: slot,
            len: page(&b),
        }]),
        CopyScope {
            buffers: &[],
            reservations: &[&out, &res],
        },
    )
    .unwrap();
    m.layer_done(id, 0, Arc::clone(&done)).unwrap();
    let ev4 = m.prepare_layer(id, 4).unwrap();
    assert_eq!(m.layer_ptr(id, 4).unwrap(), slot, "the one shared slot");
    done.synchronize().unwrap();
    // The reload was queued behind the kernel: the kernel read layer 0, never layer 4.
    check_bytes(&b, out.ptr(), seed(id, 0));
    ev4.synchronize().unwrap();
    check_bytes(&b, slot, seed(id, 4));
    compute.synchronize().unwrap();
}

#[test]
fn double_buffering_alternates_two_slots() {
    let b = backend(None);
    let params = pool(&b, None);
    let kv_pool = pool(&b, Some(0));
    let mut m = Mirage::new(params, Arc::clone(&kv_pool)).unwrap();
    let id = register(&mut m, 8, 6);
    // Fix T_T and T_c so that α = 3 fails Eq. 4 (1.5×4 = 6 > 1×4) and passes Eq. 5
    // (1.5×5 = 7.5 ≤ 1×8), while α = 4 fails both (Eq. 5: 1.5×6 = 9 > 8).
    {
        let c = m.controller_mut();
        c.set_transfer_time(Duration::from_micros(1500));
        c.report_compute(id, Duration::from_millis(1));
        c.report_prefill(id, Duration::from_millis(100));
    }
    m.step(m.pressure(5)).unwrap();
    let plan = m.registry().plan(id).unwrap().clone();
    assert_eq!((plan.alpha, plan.buffering), (3, Some(Buffering::Double)));
    assert_eq!(plan.streamed.len(), 5);
    assert_eq!(m.registry().gpu_pages(id).unwrap(), 5);
    assert_eq!(kv_pool.stats().free, 3);
    let compute = Stream::new(&b, 0).unwrap();
    // Look-ahead: with two slots the next streamed layer loads while the current one would run.
    let first = plan.streamed[0];
    let (l0, ev0) = m.prepare_next(id, plan.streamed[4]).unwrap().unwrap();
    assert_eq!(
        l0, first,
        "the ring wraps to the next token's first streamed layer"
    );
    let (l1, ev1) = m.prepare_next(id, first).unwrap().unwrap();
    assert_eq!(l1, plan.streamed[1]);
    // Both slots taken and neither occupant done: no third load yet.
    assert!(m.prepare_next(id, l1).unwrap().is_none());
    ev0.synchronize().unwrap();
    ev1.synchronize().unwrap();
    check_bytes(&b, m.layer_ptr(id, l0).unwrap(), seed(id, l0));
    check_bytes(&b, m.layer_ptr(id, l1).unwrap(), seed(id, l1));
    let mut slots = Vec::new();
    for (i, &l) in plan.streamed.iter().enumerate() {
        let ev = m.prepare_layer(id, l).unwrap();
        // Double buffering: the next layer's load is queued before this one ran.
        if i > 0 {
            let prev = plan.streamed[i - 1];
            let done = Arc::new(Event::new(&b).unwrap());
            done.record(compute.handle()).unwrap();
            m.layer_done(id, prev, done).unwrap();
        }
        ev.synchronize().unwrap();
        let ptr = m.layer_ptr(id, l).unwrap();
        check_bytes(&b, ptr, seed(id, l));
        slots.push(ptr);
    }
    assert_ne!(slots[0], slots[1]);
    assert_eq!(slots[0], slots[2]);
    assert_eq!(slots[1], slots[3]);
    compute.synchronize().unwrap();
}

#[test]
fn unregistering_gives_every_page_back_and_waits_for_the_model_to_be_idle_and_done() {
    let b = backend(None);
    let kv_pool = pool(&b, Some(0));
    let (mut m, active, idle) = active_and_idle(&b, &kv_pool, 8, (2, 4));
    let params = Arc::clone(m.registry().pool());
    // Serving: refused, nothing changes.
    let refused = m.unregister_model(active).unwrap_err();
    assert!(
        matches!(refused, Error::InvalidState(ref msg) if msg.contains("active")),
        "{refused}"
    );
    // The idle model gives two layers to the KV pool and streams through a slot.
    m.step(m.pressure(2)).unwrap();
    assert_eq!(kv_pool.stats().free, 2);
    let streamed = m.registry().plan(idle).unwrap().streamed[0];
    m.prepare_layer(idle, streamed)
        .unwrap()
        .synchronize()
        .unwrap();
    // A slot holding a layer whose kernels were not reported done: refused.
    let refused = m.unregister_model(idle).unwrap_err();
    assert!(
        matches!(refused, Error::InvalidState(ref msg) if msg.contains("done")),
        "{refused}"
    );
    check_bytes(
        &b,
        m.layer_ptr(idle, streamed).unwrap(),
        seed(idle, streamed),
    );
    let compute = Stream::new(&b, 0).unwrap();
    let done = Arc::new(Event::new(&b).unwrap());
    done.record(compute.handle()).unwrap();
    m.layer_done(idle, streamed, done).unwrap();

    let held = m.registry().gpu_pages(idle).unwrap();
    let before = params.stats();
    assert_eq!(m.unregister_model(idle).unwrap(), held);
    let after = params.stats();
    assert_eq!(after.in_use, before.in_use - held);
    assert_eq!(after.free, before.free + held);
    assert_eq!(after.in_use, m.registry().gpu_pages(active).unwrap());
    // The pages it gave the KV pool stay there.
    assert_eq!(kv_pool.stats().free, 2);
    // Its id is never valid again, and the controller leaves it out.
    assert!(m.layer_ptr(idle, 0).is_err());
    assert!(m.unregister_model(idle).is_err());
    assert!(m.controller().plan(idle).is_none());
    assert_eq!(m.controller().remap_order(), vec![active]);
    assert!(m.revert_all().unwrap().is_empty());
    for l in 0..8 {
        check_bytes(&b, m.layer_ptr(active, l).unwrap(), seed(active, l));
    }
    compute.synchronize().unwrap();
}

/// One run of `layer`: asked for, its load waited on by the compute stream, its bytes checked in
/// the slot, its compute reported done, then the look-ahead fills what slots it can.
fn run_layer(m: &mut Mirage, compute: &Stream, id: ModelId, layer: u32, look_ahead: bool) {
    let b = Arc::clone(m.engine().backend());
    let ev = m.prepare_layer(id, layer).unwrap();
    b.stream_wait_event(compute.handle(), ev.handle()).unwrap();
    compute.synchronize().unwrap();
    check_bytes(&b, m.layer_ptr(id, layer).unwrap(), seed(id, layer));
    let done = Arc::new(Event::new(&b).unwrap());
    done.record(compute.handle()).unwrap();
    m.layer_done(id, layer, done).unwrap();
    if !look_ahead {
        return;
    }
    let mut after = layer;
    while let Some((next, _)) = m.prepare_next(id, after).unwrap() {
        if next == layer {
            break;
        }
        after = next;
    }
}

/// An idle 8-layer model with one layer remapped: layers 0 and 4 stream through one slot.
fn one_slot_model(b: &Arc<dyn Backend>) -> (Mirage, ModelId) {
    let kv_pool = pool(b, Some(0));
    let (mut m, _active, idle) = active_and_idle(b, &kv_pool, 8, (4, 4));
    m.controller_mut()
        .set_transfer_time(Duration::from_millis(1));
    m.step(m.pressure(1)).unwrap();
    let plan = m.registry().plan(idle).unwrap().clone();
    assert_eq!((plan.alpha, plan.streamed), (1, vec![0, 4]));
    assert_eq!(plan.buffering, Some(Buffering::Single));
    (m, idle)
}

#[test]
fn the_look_ahead_loads_the_next_streamed_layer_before_it_is_asked_for() {
    let b = backend(None);
    let compute = Stream::new(&b, 0).unwrap();
    for look_ahead in [false, true] {
        let (mut m, id) = one_slot_model(&b);
        for _token in 0..3 {
            for l in 0..8 {
                run_layer(&mut m, &compute, id, l, look_ahead);
            }
        }
        let s = m.stream_stats(id).unwrap();
        assert_eq!(s.streamed_runs, 6, "{s:?}");
        if look_ahead {
            // Layer 4 loads while layers 1-3 run, layer 0 of the next token while 5-7 run:
            // every run but the first finds its layer prepared (and the last token loaded the
            // next one's layer 0 ahead).
            assert_eq!(s.slot_loads, 7, "{s:?}");
            assert_eq!((s.loads_ahead, s.found_prepared), (6, 5), "{s:?}");
        } else {
            assert_eq!(
                s.slot_loads, 6,
                "each run of a streamed layer loads it: {s:?}"
            );
            assert_eq!((s.loads_ahead, s.found_prepared), (0, 0), "{s:?}");
        }
    }
}

#[test]
fn a_layer_loaded_ahead_gives_way_to_the_layer_asked_for() {
    let b = backend(None);
    let compute = Stream::new(&b, 0).unwrap();
    let (mut m, id) = one_slot_model(&b);
    run_layer(&mut m, &compute, id, 0, true);
    // Layer 4 was loaded ahead into the one slot; no kernel reads it yet, so a run that asks
    // for layer 0 again (a new forward) takes the slot instead of failing.
    assert_eq!(m.stream_stats(id).unwrap().loads_ahead, 1);
    run_layer(&mut m, &compute, id, 0, false);
    assert!(matches!(m.layer_ptr(id, 4), Err(Error::InvalidState(_))));
    // A look-ahead never evicts a layer loaded ahead and not yet run.
    m.prepare_next(id, 0).unwrap().unwrap();
    assert!(m.prepare_next(id, 4).unwrap().is_none());
    // Nor does a slot holding it keep the model from being unregistered.
    m.controller_mut().set_active(id, false);
    assert!(m.unregister_model(id).unwrap() > 0);
    compute.synchronize().unwrap();
}

#[test]
fn reversion_comes_when_the_device_has_room_after_the_pool_trimmed_its_free_pages() {
    let b = backend(None);
    let kv_pool = pool(&b, None);
    let (mut m, _active, idle) = active_and_idle(&b, &kv_pool, 8, (4, 4));
    m.step(m.pressure(2)).unwrap();
    assert_eq!(m.registry().plan(idle).unwrap().alpha, 2);
    assert_eq!(kv_pool.stats().free, 2);
    // The KV pool gives its free pages back to the driver (as its worker does above the high
    // watermark, or empty_cache): nothing is free, yet the device has room for every layer.
    assert_eq!(kv_pool.trim(0), 2);
    let device_free = b.mem_info(0).unwrap().free / page(&b);
    assert_eq!(m.available_pages() as u64, device_free);
    assert!(device_free >= 2);
    // No room under the pool's limit: the layers stay remapped.
    kv_pool.set_limit(Some(0));
    assert_eq!(m.available_pages(), 0);
    assert!(m.step(m.pressure(0)).unwrap().is_empty());
    // Room again: every layer comes back.
    kv_pool.set_limit(None);
    let r = m.step(m.pressure(0)).unwrap();
    assert_eq!((r.len(), r[0].from_alpha, r[0].plan.alpha), (1, 2, 0));
    for l in 0..8 {
        check_bytes(&b, m.layer_ptr(idle, l).unwrap(), seed(idle, l));
    }
}
