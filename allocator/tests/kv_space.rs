//! `KvSpace` tests: page accounting, deferred reclamation, zero page, stale ids, out-of-memory,
//! contents across grows, fault rollback, and a random walk against a reference model.
//!
//! Every test runs on a small in-file fake backend (strict VMM preconditions, byte storage per
//! physical handle, map fault injection), and, where the host backend is available, on it too.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use proptest::prelude::*;
use strata_allocator::{Kind, KvConfig, KvSpace, PagePool, PoolConfig, SlotId};
use strata_kernels::pattern::{fill, first_mismatch};
use strata_vmm::{
    copy_async_in, Backend, CopyDesc, CopyKind, CopyScope, DevicePtr, Error, HostBuffer,
    HostConfig, Reservation, Stream,
};

/// A minimal, strict emulation of the VMM contract in plain Rust memory.
mod fake {
    use std::collections::{BTreeMap, HashMap};
    use std::os::fd::{BorrowedFd, OwnedFd};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    use strata_vmm::{
        Access, Backend, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr, Error,
        EventHandle, LiveCounts, Location, MemInfo, PhysHandle, Result, StreamHandle,
    };

    struct Phys {
        bytes: Vec<u8>,
        released: bool,
        maps: usize,
    }

    #[derive(Clone, Copy)]
    struct Map {
        size: u64,
        handle: u64,
        offset: u64,
        access: Access,
    }

    #[derive(Default)]
    struct State {
        next_va: u64,
        reservations: BTreeMap<u64, u64>,
        phys: HashMap<u64, Phys>,
        next_handle: u64,
        used: u64,
        maps: BTreeMap<u64, Map>,
        streams: u64,
        events: u64,
        next_id: u64,
    }

    impl State {
        fn drop_phys_if_dead(&mut self, handle: u64) {
            if let Some(p) = self.phys.get(&handle) {
                if p.released && p.maps == 0 {
                    self.used -= p.bytes.len() as u64;
                    self.phys.remove(&handle);
                }
            }
        }

        /// Start addresses of the whole mappings that cover `va..va+size` exactly.
        fn whole_maps(&self, va: u64, size: u64) -> Result<Vec<u64>> {
            let end = va + size;
            if let Some((&s, m)) = self.maps.range(..va).next_back() {
                if s + m.size > va {
                    return Err(Error::PartialUnmap { va, size });
                }
            }
            let mut cursor = va;
            let mut starts = Vec::new();
            for (&s, m) in self.maps.range(va..end) {
                if s != cursor {
                    return Err(Error::NotMapped { va, size });
                }
                if s + m.size > end {
                    return Err(Error::PartialUnmap { va, size });
                }
                starts.push(s);
                cursor = s + m.size;
            }
            if cursor != end {
                return Err(Error::NotMapped { va, size });
            }
            Ok(starts)
        }
    }

    pub struct Fake {
        gran: u64,
        capacity: u64,
        state: Mutex<State>,
        maps_done: AtomicU64,
        fail_map_at: AtomicU64,
    }

    impl Fake {
        pub fn new(gran: u64, capacity: u64) -> Fake {
            Fake {
                gran,
                capacity,
                state: Mutex::new(State {
                    next_va: 1 << 40,
                    next_id: 1,
                    ..State::default()
                }),
                maps_done: AtomicU64::new(0),
                fail_map_at: AtomicU64::new(0),
            }
        }

        /// Makes the `n`-th map call from now fail with an injected fault.
        pub fn fail_nth_map(&self, n: u64) {
            let done = self.maps_done.load(Ordering::SeqCst);
            self.fail_map_at.store(done + n, Ordering::SeqCst);
        }

        fn aligned(&self, what: &'static str, value: u64) -> Result<()> {
            if value % self.gran != 0 {
                return Err(Error::Misaligned {
                    what,
                    value,
                    granularity: self.gran,
                });
            }
            Ok(())
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, State> {
            self.state.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// Runs `f` over each piece of `va..va+len` with its physical bytes.
        fn with_bytes(
            &self,
            va: u64,
            len: u64,
            write: bool,
            mut f: impl FnMut(&mut [u8], usize),
        ) -> Result<()> {
            let mut st = self.lock();
            let end = va + len;
            let mut cursor = va;
            while cursor < end {
                let Some((&start, &m)) = st
                    .maps
                    .range(..=cursor)
                    .next_back()
                    .filter(|(&s, m)| cursor < s + m.size)
                else {
                    return Err(Error::IllegalAccess {
                        va,
                        size: len,
                        reason: "not mapped",
                    });
                };
                let allowed = match m.access {
                    Access::ReadWrite => true,
                    Access::Read => !write,
                    Access::None => false,
                };
                if !allowed {
                    return Err(Error::IllegalAccess {
                        va,
                        size: len,
                        reason: "access not granted",
                    });
                }
                let piece_end = end.min(start + m.size);
                let off = (m.offset + cursor - start) as usize;
                let n = (piece_end - cursor) as usize;
                let phys = st.phys.get_mut(&m.handle).expect("mapped handle is alive");
                f(&mut phys.bytes[off..off + n], (cursor - va) as usize);
                cursor = piece_end;
            }
            Ok(())
        }
    }

    impl Backend for Fake {
        fn kind(&self) -> BackendKind {
            BackendKind::Host
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn device_count(&self) -> u32 {
            1
        }
        fn device_info(&self, device: u32) -> Result<DeviceInfo> {
            if device != 0 {
                return Err(Error::NoDevice(device.into()));
            }
            Ok(DeviceInfo {
                ordinal: 0,
                name: "fake".into(),
                total_memory: self.capacity,
                granularity: self.gran,
            })
        }
        fn granularity(&self, _location: Location) -> Result<u64> {
            Ok(self.gran)
        }
        fn mem_info(&self, _device: u32) -> Result<MemInfo> {
            let used = self.lock().used;
            Ok(MemInfo {
                free: self.capacity - used,
                total: self.capacity,
            })
        }
        fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
            if size == 0 {
                return Err(Error::InvalidArgument("zero reservation".into()));
            }
            self.aligned("reservation size", size)?;
            let align = alignment.max(self.gran);
            let mut st = self.lock();
            let ptr = st.next_va.div_ceil(align) * align;
            st.next_va = ptr + size + self.gran;
            st.reservations.insert(ptr, size);
            Ok(ptr)
        }
        fn free_va(&self, ptr: DevicePtr, size: u64) -> Result<()> {
            let mut st = self.lock();
            if st.reservations.get(&ptr) != Some(&size) {
                return Err(Error::NotReserved { va: ptr, size });
            }
            if st.maps.range(ptr..ptr + size).next().is_some() {
                return Err(Error::StillMapped { va: ptr, size });
            }
            st.reservations.remove(&ptr);
            Ok(())
        }
        fn create(&self, location: Location, size: u64, _flags: CreateFlags) -> Result<PhysHandle> {
            if size == 0 {
                return Err(Error::InvalidArgument("zero create".into()));
            }
            self.aligned("create size", size)?;
            let mut st = self.lock();
            if st.used + size > self.capacity {
                return Err(Error::OutOfMemory {
                    location,
                    requested: size,
                    available: self.capacity - st.used,
                });
            }
            st.used += size;
            let h = st.next_handle + 1;
            st.next_handle = h;
            st.phys.insert(
                h,
                Phys {
                    bytes: vec![0xa5; size as usize],
                    released: false,
                    maps: 0,
                },
            );
            Ok(PhysHandle(h))
        }
        fn release(&self, handle: PhysHandle) -> Result<()> {
            let mut st = self.lock();
            match st.phys.get_mut(&handle.0) {
                Some(p) if !p.released => p.released = true,
                _ => {
                    return Err(Error::InvalidHandle {
                        kind: "physical",
                        id: handle.0,
                    })
                }
            }
            st.drop_phys_if_dead(handle.0);
            Ok(())
        }
        fn handle_size(&self, handle: PhysHandle) -> Result<u64> {
            let st = self.lock();
            match st.phys.get(&handle.0) {
                Some(p) if !p.released => Ok(p.bytes.len() as u64),
                _ => Err(Error::InvalidHandle {
                    kind: "physical",
                    id: handle.0,
                }),
            }
        }
        fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
            if size == 0 {
                return Err(Error::InvalidArgument("zero map".into()));
            }
            self.aligned("map va", va)?;
            self.aligned("map size", size)?;
            self.aligned("map offset", offset)?;
            let n = self.maps_done.fetch_add(1, Ordering::SeqCst) + 1;
            if self.fail_map_at.load(Ordering::SeqCst) == n {
                return Err(Error::InjectedFault("map"));
            }
            let mut st = self.lock();
            match st.phys.get(&handle.0) {
                Some(p) if !p.released && offset + size <= p.bytes.len() as u64 => {}
                _ => {
                    return Err(Error::InvalidHandle {
                        kind: "physical",
                        id: handle.0,
                    })
                }
            }
            let inside = st
                .reservations
                .range(..=va)
                .next_back()
                .is_some_and(|(&r, &rs)| va + size <= r + rs);
            if !inside {
                return Err(Error::NotReserved { va, size });
            }
            let overlaps = st
                .maps
                .range(..va + size)
                .next_back()
                .is_some_and(|(&s, m)| s + m.size > va);
            if overlaps {
                return Err(Error::AlreadyMapped { va, size });
            }
            st.maps.insert(
                va,
                Map {
                    size,
                    handle: handle.0,
                    offset,
                    access: Access::None,
                },
            );
            st.phys.get_mut(&handle.0).expect("checked").maps += 1;
            Ok(())
        }
        fn unmap(&self, va: DevicePtr, size: u64) -> Result<()> {
            self.aligned("unmap va", va)?;
            self.aligned("unmap size", size)?;
            let mut st = self.lock();
            for start in st.whole_maps(va, size)? {
                let m = st.maps.remove(&start).expect("listed");
                st.phys.get_mut(&m.handle).expect("mapped handle").maps -= 1;
                st.drop_phys_if_dead(m.handle);
            }
            Ok(())
        }
        fn set_access(
            &self,
            va: DevicePtr,
            size: u64,
            grants: &[(Location, Access)],
        ) -> Result<()> {
            self.aligned("access va", va)?;
            self.aligned("access size", size)?;
            let access = grants
                .iter()
                .find(|(l, _)| *l == Location::Device(0))
                .map_or(Access::None, |g| g.1);
            let mut st = self.lock();
            for start in st.whole_maps(va, size)? {
                st.maps.get_mut(&start).expect("listed").access = access;
            }
            Ok(())
        }
        fn export_fd(&self, _handle: PhysHandle) -> Result<OwnedFd> {
            Err(Error::Unsupported("fake export".into()))
        }
        fn import_fd(&self, _fd: BorrowedFd<'_>) -> Result<PhysHandle> {
            Err(Error::Unsupported("fake import".into()))
        }
        fn stream_create(&self, _device: u32) -> Result<StreamHandle> {
            let mut st = self.lock();
            st.streams += 1;
            st.next_id += 1;
            Ok(StreamHandle(st.next_id))
        }
        fn stream_destroy(&self, _stream: StreamHandle) -> Result<()> {
            self.lock().streams -= 1;
            Ok(())
        }
        fn stream_synchronize(&self, _stream: StreamHandle) -> Result<()> {
            Ok(())
        }
        fn event_create(&self) -> Result<EventHandle> {
            let mut st = self.lock();
            st.events += 1;
            st.next_id += 1;
            Ok(EventHandle(st.next_id))
        }
        fn event_destroy(&self, _event: EventHandle) -> Result<()> {
            self.lock().events -= 1;
            Ok(())
        }
        fn event_record(&self, _event: EventHandle, _stream: StreamHandle) -> Result<()> {
            Ok(())
        }
        fn event_query(&self, _event: EventHandle) -> Result<bool> {
            Ok(true)
        }
        fn event_synchronize(&self, _event: EventHandle) -> Result<()> {
            Ok(())
        }
        fn stream_wait_event(&self, _stream: StreamHandle, _event: EventHandle) -> Result<()> {
            Ok(())
        }
        unsafe fn copy_async(&self, _stream: StreamHandle, _copies: &[CopyDesc]) -> Result<()> {
            Err(Error::Unsupported(
                "fake copy_async (use write/read)".into(),
            ))
        }
        fn memset_async(
            &self,
            _stream: StreamHandle,
            dst: DevicePtr,
            value: u8,
            len: u64,
        ) -> Result<()> {
            self.with_bytes(dst, len, true, |bytes, _| bytes.fill(value))
        }
        fn live_counts(&self) -> LiveCounts {
            let st = self.lock();
            LiveCounts {
                reservations: st.reservations.len() as u64,
                handles: st.phys.values().filter(|p| !p.released).count() as u64,
                mappings: st.maps.len() as u64,
                streams: st.streams,
                events: st.events,
            }
        }
        fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
            self.with_bytes(dst, src.len() as u64, true, |bytes, at| {
                bytes.copy_from_slice(&src[at..at + bytes.len()])
            })
        }
        fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
            self.with_bytes(src, dst.len() as u64, false, |bytes, at| {
                dst[at..at + bytes.len()].copy_from_slice(bytes)
            })
        }
    }
}

/// Small pages keep the fill-pattern traffic of debug-build tests small; the host backend runs
/// both at a small granularity and at the 2 MiB of current GPUs.
const FAKE_PAGE: u64 = 4 << 10;
const HOST_SMALL_PAGE: u64 = 64 << 10;
const HOST_GPU_PAGE: u64 = 2 << 20;

/// A backend and a pool of its device 0 (no background thread, so counts are deterministic).
struct Rig {
    name: &'static str,
    backend: Arc<dyn Backend>,
    pool: Arc<PagePool>,
    page: u64,
}

fn pool_config(limit_pages: Option<u64>, page: u64) -> PoolConfig {
    PoolConfig {
        low_watermark: 0,
        high_watermark: 1 << 20,
        limit: limit_pages.map(|n| n * page),
        idle_trim_after: None,
        background: false,
    }
}

fn fake_rig(limit_pages: Option<u64>) -> (Rig, Arc<fake::Fake>) {
    let fake = Arc::new(fake::Fake::new(FAKE_PAGE, 1024 * FAKE_PAGE));
    let backend: Arc<dyn Backend> = fake.clone();
    let pool = PagePool::new(Arc::clone(&backend), 0, pool_config(limit_pages, FAKE_PAGE))
        .expect("fake pool");
    let rig = Rig {
        name: "fake",
        backend,
        pool,
        page: FAKE_PAGE,
    };
    (rig, fake)
}

/// The host backend, when it is built; `None` while it reports `Unsupported`.
fn host_rig(limit_pages: Option<u64>, granularity: u64) -> Option<Rig> {
    let config = HostConfig {
        devices: vec![256 << 20],
        granularity,
        strict: true,
        link: None,
    };
    let backend = match strata_vmm::host_or_cuda(config) {
        Ok(b) => b,
        Err(Error::Unsupported(why)) => {
            eprintln!("host backend unavailable ({why}); fake backend only");
            return None;
        }
        Err(e) => panic!("host backend failed to open: {e}"),
    };
    let page = backend
        .granularity(strata_vmm::Location::Device(0))
        .expect("granularity");
    let pool =
        PagePool::new(Arc::clone(&backend), 0, pool_config(limit_pages, page)).expect("host pool");
    Some(Rig {
        name: "host",
        backend,
        pool,
        page,
    })
}

/// The fake and the small-page host backend (for tests that move many bytes).
fn rigs(limit_pages: Option<u64>) -> Vec<Rig> {
    let mut rigs = vec![fake_rig(limit_pages).0];
    rigs.extend(host_rig(limit_pages, HOST_SMALL_PAGE));
    rigs
}

/// [`rigs`] plus the host backend at the GPU granularity.
fn all_rigs(limit_pages: Option<u64>) -> Vec<Rig> {
    let mut rigs = rigs(limit_pages);
    rigs.extend(host_rig(limit_pages, HOST_GPU_PAGE));
    rigs
}

/// 2 layers, 4 slots, 3/8 of a page per token (tokens straddle pages), 20 tokens = 7.5 pages
/// per slot → 8 pages per slot per tensor.
fn config(page: u64, zero_page: bool) -> KvConfig {
    KvConfig {
        layers: 2,
        max_slots: 4,
        max_tokens: 20,
        bytes_per_token: 3 * page / 8,
        zero_page,
    }
}

fn kinds() -> [Kind; 2] {
    [Kind::K, Kind::V]
}

fn seed_of(slot: SlotId, layer: u32, kind: Kind) -> u64 {
    (u64::from(slot.index()) << 40)
        ^ (u64::from(slot.generation()) << 16)
        ^ (u64::from(layer) << 2)
        ^ kind as u64
}

/// Writes the slot's pattern over tokens `from..to` of every tensor.
fn write_tokens(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, from: u32, to: u32) {
    if to <= from {
        return;
    }
    let bpt = space.config().bytes_per_token;
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            let offset = u64::from(from) * bpt;
            let mut buf = vec![0u8; (u64::from(to - from) * bpt) as usize];
            fill(&mut buf, seed_of(slot, layer, kind), offset);
            backend.write(base + offset, &buf).expect("write tokens");
        }
    }
}

/// Checks tokens `0..tokens` of every tensor of `slot` against its pattern.
fn check_tokens(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, tokens: u32) {
    let bpt = space.config().bytes_per_token;
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            let mut buf = vec![0u8; (u64::from(tokens) * bpt) as usize];
            backend.read(base, &mut buf).expect("read tokens");
            if let Some(at) = first_mismatch(&buf, seed_of(slot, layer, kind), 0) {
                panic!("slot {slot:?} layer {layer} {kind:?}: mismatch at byte {at}");
            }
        }
    }
}

fn read_bytes(backend: &Arc<dyn Backend>, va: DevicePtr, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    backend.read(va, &mut buf).expect("read");
    buf
}

fn ok(space: &KvSpace) {
    if let Err(e) = space.check_invariants() {
        panic!("invariant broken: {e}");
    }
}

#[test]
fn config_is_validated() {
    let (rig, _) = fake_rig(None);
    for bad in [
        KvConfig {
            layers: 0,
            ..config(rig.page, false)
        },
        KvConfig {
            max_slots: 0,
            ..config(rig.page, false)
        },
        KvConfig {
            max_tokens: 0,
            ..config(rig.page, false)
        },
        KvConfig {
            bytes_per_token: 0,
            ..config(rig.page, false)
        },
    ] {
        let err = KvSpace::new(Arc::clone(&rig.pool), bad).expect_err("invalid config");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    let huge = KvConfig {
        max_tokens: u32::MAX,
        bytes_per_token: u64::MAX / 2,
        ..config(rig.page, false)
    };
    let err = KvSpace::new(Arc::clone(&rig.pool), huge).expect_err("overflow");
    assert!(matches!(err, Error::Overflow(_)), "{err}");
    assert_eq!(rig.backend.live_counts().reservations, 0);
}

#[test]
fn layout_addresses() {
    for rig in all_rigs(None) {
        let space = KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let stride = space.slot_stride();
        assert_eq!(stride, 8 * rig.page, "{}", rig.name);
        assert_eq!(space.pages_per_slot(), 8);
        assert_eq!(space.tensor_count(), 4);
        let mut bases: Vec<DevicePtr> = (0..2)
            .flat_map(|l| kinds().map(|k| space.tensor_ptr(l, k)))
            .collect();
        bases.sort_unstable();
        bases.dedup();
        assert_eq!(bases.len(), 4);
        for pair in bases.windows(2) {
            assert!(pair[1] - pair[0] >= 4 * stride, "tensors overlap");
        }
        assert_eq!(space.pages_for(0), 0);
        assert_eq!(space.pages_for(1), 1);
        assert_eq!(space.pages_for(3), 2); // 9/8 of a page
        assert_eq!(space.pages_for(20), 8);
        ok(&space);
    }
}

#[test]
fn grow_shrink_free_account_pages() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().expect("admit");
        let b = space.admit().expect("admit");
        assert_ne!(a.index(), b.index());
        assert_eq!(
            space.slot_ptr(b, 1, Kind::V).unwrap(),
            space.tensor_ptr(1, Kind::V) + u64::from(b.index()) * space.slot_stride()
        );
        ok(&space);

        space.grow(a, 3).expect("grow a");
        let s = space.stats();
        assert_eq!(s.pages_mapped, 2 * 4, "{}", rig.name);
        assert_eq!(s.map_calls, 8);
        assert_eq!(s.set_access_calls, 4, "one set_access per tensor");
        assert_eq!(s.tokens, 3);
        assert_eq!(rig.pool.stats().in_use, 8);
        ok(&space);

        // Within the same page: no driver call.
        space.grow(a, 5).expect("grow within page");
        assert_eq!(space.stats().map_calls, 8);
        assert_eq!(space.stats().set_access_calls, 4);
        space.grow(a, 5).expect("same length is a no-op");

        space.grow(b, 20).expect("grow b to max");
        assert_eq!(space.stats().pages_mapped, 8 + 32);
        assert_eq!(space.mapped_pages(b).unwrap(), 8);
        ok(&space);

        space.shrink(b, 6).expect("shrink b");
        assert_eq!(space.mapped_pages(b).unwrap(), 3);
        assert_eq!(space.stats().pages_mapped, 8 + 12);
        assert_eq!(space.stats().pages_unmapped_total, 20);
        assert_eq!(rig.pool.stats().in_use, 20);
        assert_eq!(
            rig.pool.stats().free,
            20,
            "shrunk pages go back to the free list"
        );
        ok(&space);

        space.shrink(b, 0).expect("shrink to nothing");
        assert_eq!(space.mapped_pages(b).unwrap(), 0);
        ok(&space);

        space.free(b).expect("free empty b");
        assert_eq!(
            space.stats().slots_deferred,
            0,
            "an empty slot is free at once"
        );
        space.free(a).expect("free a");
        let s = space.stats();
        assert_eq!((s.slots_active, s.slots_deferred, s.tokens), (0, 1, 0));
        assert_eq!(s.pages_mapped, 8, "a freed slot keeps its pages (deferred)");
        ok(&space);

        assert_eq!(space.reclaim_deferred(), 8);
        assert_eq!(space.stats().pages_mapped, 0);
        assert_eq!(space.stats().slots_deferred, 0);
        assert_eq!(rig.pool.stats().in_use, 0);
        ok(&space);
    }
}

#[test]
fn argument_errors() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().unwrap();
        let err = space.grow(a, 21).expect_err("beyond max_tokens");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        space.grow(a, 10).unwrap();
        let err = space.grow(a, 9).expect_err("grow backwards");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = space.shrink(a, 11).expect_err("shrink forwards");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = space
            .slot_ptr(a, 2, Kind::K)
            .expect_err("layer out of range");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert_eq!(space.tokens(a).unwrap(), 10);
        for _ in 0..3 {
            space.admit().unwrap();
        }
        let err = space.admit().expect_err("all slots taken");
        assert!(matches!(err, Error::InvalidState(_)), "{err}");
        ok(&space);
    }
}

#[test]
fn stale_slot_ids_are_errors() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let old = space.admit().unwrap();
        space.grow(old, 4).unwrap();
        space.free(old).unwrap();
        let new = space.admit().unwrap();
        assert_eq!(new.index(), old.index(), "the deferred slot is reused");
        assert_ne!(new.generation(), old.generation());
        let stale = |e: Error| assert!(matches!(e, Error::StaleId { .. }), "{e}");
        stale(space.grow(old, 5).unwrap_err());
        stale(space.shrink(old, 0).unwrap_err());
        stale(space.free(old).unwrap_err());
        stale(space.slot_ptr(old, 0, Kind::K).unwrap_err());
        stale(space.tokens(old).unwrap_err());
        // The stale id did not touch the new request.
        assert_eq!(space.tokens(new).unwrap(), 0);
        space.free(new).unwrap();
        stale(space.free(new).unwrap_err());
        ok(&space);
    }
}

#[test]
fn deferred_slot_is_reused_without_map_calls() {
    for rig in all_rigs(None) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().unwrap();
        space.grow(a, 12).unwrap(); // 36/8 pages → 5
        let before = space.stats();
        space.free(a).unwrap();
        let b = space.admit().unwrap();
        assert_eq!(b.index(), a.index());
        assert_eq!(space.tokens(b).unwrap(), 0);
        assert_eq!(space.mapped_pages(b).unwrap(), 5, "capacity stays mapped");
        ok(&space);
        space.grow(b, 13).unwrap();
        let after = space.stats();
        assert_eq!(after.map_calls, before.map_calls, "reuse needs no map call");
        assert_eq!(after.set_access_calls, before.set_access_calls);
        assert_eq!(after.pages_mapped, before.pages_mapped);
        write_tokens(&space, &rig.backend, b, 0, 13);
        check_tokens(&space, &rig.backend, b, 13);
        ok(&space);
        // Beyond the reused capacity, just the missing pages are mapped.
        space.grow(b, 16).unwrap(); // 6 pages
        assert_eq!(space.stats().map_calls, before.map_calls + 4);
        check_tokens(&space, &rig.backend, b, 13);
        // A shrink drops the surplus as well.
        space.free(b).unwrap();
        let c = space.admit().unwrap();
        space.grow(c, 1).unwrap();
        assert_eq!(space.mapped_pages(c).unwrap(), 6);
        space.shrink(c, 1).unwrap();
        assert_eq!(space.mapped_pages(c).unwrap(), 1);
        ok(&space);
    }
}

#[test]
fn out_of_memory_leaves_the_slot_unchanged_and_reclaims_deferred() {
    // 24 pages: three slots of 2 pages per tensor (8 pages each), not more.
    for rig in all_rigs(Some(24)) {
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
        let a = space.admit().unwrap();
        let b = space.admit().unwrap();
        let c = space.admit().unwrap();
        for s in [a, b, c] {
            space.grow(s, 5).unwrap(); // 15/8 → 2 pages
            write_tokens(&space, &rig.backend, s, 0, 5);
        }
        let before = space.stats();
        let err = space.grow(a, 6).expect_err("pool exhausted");
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(space.tokens(a).unwrap(), 5);
        assert_eq!(space.mapped_pages(a).unwrap(), 2);
        assert_eq!(space.stats(), before, "nothing changed");
        ok(&space);
        // Still usable: growth within the mapped pages works.
        space.grow(a, 5).unwrap();
        // Free c (deferred) and grow a: the pool is short, so c's pages are reclaimed.
        space.free(c).unwrap();
        assert_eq!(space.stats().slots_deferred, 1);
        space.grow(a, 8).expect("grow after deferred reclaim"); // 3 pages
        write_tokens(&space, &rig.backend, a, 5, 8);
        let s = space.stats();
        assert_eq!(s.slots_deferred, 0, "the deferred slot was reclaimed");
        assert_eq!(s.pages_mapped, 3 * 4 + 2 * 4);
        check_tokens(&space, &rig.backend, a, 8);
        check_tokens(&space, &rig.backend, b, 5);
        ok(&space);
        // A request that cannot fit even after reclaiming fails cleanly.
        let err = space.grow(b, 20).expect_err("too large");
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(space.tokens(b).unwrap(), 5);
        check_tokens(&space, &rig.backend, b, 5);
        ok(&space);
    }
}

#[test]
fn contents_survive_grows_of_this_and_other_slots() {
    for rig in rigs(None) {
        for zero_page in [false, true] {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page)).expect("space");
            let slots: Vec<SlotId> = (0..4).map(|_| space.admit().unwrap()).collect();
            let mut len = [0u32; 4];
            for step in 1..=20u32 {
                for (i, &s) in slots.iter().enumerate() {
                    let to = (step * (i as u32 + 1)).min(12 + 2 * i as u32);
                    space.grow(s, to).unwrap();
                    write_tokens(&space, &rig.backend, s, len[i], to);
                    len[i] = to;
                }
                for (i, &s) in slots.iter().enumerate() {
                    check_tokens(&space, &rig.backend, s, len[i]);
                }
                ok(&space);
            }
        }
    }
}

#[test]
fn zero_page_backs_unmapped_va() {
    for rig in all_rigs(None) {
        let baseline = rig.backend.live_counts();
        {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, true)).expect("space");
            ok(&space);
            let page = rig.page;
            let stride = space.slot_stride();
            // Every tensor reads as zeros everywhere before any grow.
            for layer in 0..2 {
                for kind in kinds() {
                    let bytes = read_bytes(&rig.backend, space.tensor_ptr(layer, kind), 4 * stride);
                    assert!(
                        bytes.iter().all(|&b| b == 0),
                        "{}: zero page reads zeros",
                        rig.name
                    );
                }
            }
            assert_eq!(
                rig.pool.stats().in_use,
                0,
                "the zero page is not a pool page"
            );
            let a = space.admit().unwrap();
            let base = space.slot_ptr(a, 0, Kind::K).unwrap();
            let err = rig
                .backend
                .write(base, &[1u8; 16])
                .expect_err("zero page is read-only");
            assert!(matches!(err, Error::IllegalAccess { .. }), "{err}");

            space.grow(a, 3).unwrap(); // 2 pages
            write_tokens(&space, &rig.backend, a, 0, 3);
            check_tokens(&space, &rig.backend, a, 3);
            // Past the real pages the zero page still reads as zeros, and padding reads work.
            let tail = read_bytes(&rig.backend, base + 2 * page, stride - 2 * page);
            assert!(tail.iter().all(|&b| b == 0));
            // Writes into the real pages did not leak into the zero page (other slots).
            let other = read_bytes(&rig.backend, base + stride, stride);
            assert!(other.iter().all(|&b| b == 0));
            ok(&space);

            space.shrink(a, 1).unwrap(); // back to 1 page; page 2 is the zero page again
            let second = read_bytes(&rig.backend, base + page, page);
            assert!(second.iter().all(|&b| b == 0), "shrunk pages read zeros");
            check_tokens(&space, &rig.backend, a, 1);
            ok(&space);

            space.free(a).unwrap();
            space.reclaim_deferred();
            let first = read_bytes(&rig.backend, base, page);
            assert!(first.iter().all(|&b| b == 0), "reclaimed pages read zeros");
            ok(&space);
        }
        assert_eq!(
            rig.backend.live_counts().mappings,
            baseline.mappings,
            "drop unmaps all"
        );
        assert_eq!(
            rig.backend.live_counts().reservations,
            baseline.reservations
        );
        assert_eq!(rig.pool.stats().in_use, 0);
    }
}

/// Copies page `p` of `slot` out of every tensor (backend reads), in tensor order.
fn save_page(space: &KvSpace, backend: &Arc<dyn Backend>, slot: SlotId, p: usize) -> Vec<Vec<u8>> {
    let page = space.page_size();
    let mut out = Vec::new();
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            out.push(read_bytes(backend, base + p as u64 * page, page));
        }
    }
    out
}

fn load_page(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    slot: SlotId,
    p: usize,
    saved: &[Vec<u8>],
) {
    let page = space.page_size();
    let mut it = saved.iter();
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            let bytes = it.next().expect("one saved page per tensor");
            backend
                .write(base + p as u64 * page, bytes)
                .expect("write back");
        }
    }
}

#[test]
fn evict_and_restore_pages_keep_the_va_and_the_bytes_copied_back() {
    for zero_page in [false, true] {
        for rig in all_rigs(None) {
            let baseline = rig.backend.live_counts();
            {
                let mut space = KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page))
                    .expect("space");
                let page = rig.page;
                let a = space.admit().unwrap();
                let b = space.admit().unwrap();
                space.grow(a, 20).unwrap(); // 8 pages per tensor
                space.grow(b, 5).unwrap(); // 2 pages
                write_tokens(&space, &rig.backend, a, 0, 20);
                write_tokens(&space, &rig.backend, b, 0, 5);
                let ptr = space.slot_ptr(a, 1, Kind::V).unwrap();
                let saved: Vec<_> = (2..5)
                    .map(|p| save_page(&space, &rig.backend, a, p))
                    .collect();
                let in_use = rig.pool.stats().in_use;
                let s0 = space.stats();

                space.evict_pages(a, 2..4).unwrap();
                space.evict_page(a, 4).unwrap();
                ok(&space);
                assert_eq!(space.evicted_pages(a).unwrap(), vec![2, 3, 4]);
                assert!(!space.is_resident(a, 3).unwrap());
                assert!(space.is_resident(a, 5).unwrap());
                assert_eq!(space.tokens(a).unwrap(), 20, "tokens unchanged");
                assert_eq!(space.mapped_pages(a).unwrap(), 8, "extent unchanged");
                assert_eq!(rig.pool.stats().in_use, in_use - 3 * 4, "{}", rig.name);
                let s1 = space.stats();
                assert_eq!(s1.pages_mapped, s0.pages_mapped - 12);
                assert_eq!(s1.pages_evicted, 3);
                // The hole reads zeros behind the zero page, and faults without it.
                let hole = ptr + 3 * page;
                if zero_page {
                    assert!(read_bytes(&rig.backend, hole, page).iter().all(|&x| x == 0));
                    let e = rig
                        .backend
                        .write(hole, &[1])
                        .expect_err("zero page is read-only");
                    assert!(matches!(e, Error::IllegalAccess { .. }), "{e}");
                } else {
                    let mut one = [0u8; 1];
                    rig.backend
                        .read(hole, &mut one)
                        .expect_err("a hole is unmapped");
                }
                // Runs with a hole, past the extent or empty are refused and change nothing.
                for bad in [1..3, 7..9, 5..5] {
                    let e = space.evict_pages(a, bad.clone()).expect_err("bad evict");
                    assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
                }
                for bad in [1..3, 4..6, 3..3] {
                    let e = space
                        .restore_pages(a, bad.clone())
                        .expect_err("bad restore");
                    assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
                }
                assert_eq!(space.evicted_pages(a).unwrap(), vec![2, 3, 4]);
                ok(&space);
                // The other slot and the resident pages of this one are untouched.
                check_tokens(&space, &rig.backend, b, 5);
                let bpt = space.config().bytes_per_token;
                let head = read_bytes(
                    &rig.backend,
                    space.slot_ptr(a, 0, Kind::K).unwrap(),
                    2 * page,
                );
                assert_eq!(first_mismatch(&head, seed_of(a, 0, Kind::K), 0), None);
                let tail_from = 5 * page;
                let tail = read_bytes(&rig.backend, ptr + tail_from, 20 * bpt - tail_from);
                assert_eq!(
                    first_mismatch(&tail, seed_of(a, 1, Kind::V), tail_from),
                    None
                );

                let set_access = space.stats().set_access_calls;
                space.restore_pages(a, 2..5).unwrap();
                assert_eq!(
                    space.stats().set_access_calls - set_access,
                    space.tensor_count() as u64,
                    "one set_access per tensor over the run"
                );
                assert_eq!(space.slot_ptr(a, 1, Kind::V).unwrap(), ptr, "same VA");
                for (p, bytes) in (2..5).zip(&saved) {
                    load_page(&space, &rig.backend, a, p, bytes);
                }
                check_tokens(&space, &rig.backend, a, 20);
                assert_eq!(space.evicted_pages(a).unwrap(), Vec::<usize>::new());
                assert_eq!(rig.pool.stats().in_use, in_use);
                assert_eq!(space.stats().pages_evicted, 0);
                ok(&space);

                // Free truncates a slot with holes to its first hole.
                space.evict_page(a, 6).unwrap();
                space.evict_page(a, 3).unwrap();
                space.free(a).unwrap();
                ok(&space);
                assert_eq!(rig.pool.stats().in_use, (3 + 2) * 4);
                assert_eq!(space.stats().slots_deferred, 1);
                // Shrink forgets the holes it cuts off.
                space.evict_page(b, 1).unwrap();
                space.shrink(b, 2).unwrap(); // 1 page
                assert_eq!(space.evicted_pages(b).unwrap(), Vec::<usize>::new());
                check_tokens(&space, &rig.backend, b, 2);
                ok(&space);
            }
            let now = rig.backend.live_counts();
            assert_eq!(
                (now.mappings, now.reservations),
                (baseline.mappings, baseline.reservations)
            );
            assert_eq!(rig.pool.stats().in_use, 0);
        }
    }
}

/// Copies `descs` between `host` and the tensors of `space` and waits for them.
fn copy_between(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    stream: &Stream,
    host: &HostBuffer,
    descs: &[CopyDesc],
) {
    let reservations: Vec<&Reservation> = (0..space.config().layers)
        .flat_map(|l| kinds().map(move |k| (l, k)))
        .map(|(l, k)| &**space.tensor_reservation(l, k))
        .collect();
    let scope = CopyScope {
        buffers: &[host],
        reservations: &reservations,
    };
    copy_async_in(backend, stream.handle(), CopyKind::Batch(descs), scope)
        .expect("copy")
        .synchronize()
        .expect("wait for the copy");
}

/// What a tier manager does: the bytes of pages 2..5 go down to host memory with backend
/// copies, the pages are evicted (and reused by another slot), restored at the same addresses and
/// the bytes copied back; the slot then reads exactly as before (strict host backend: nothing
/// here touches device memory through the CPU).
#[test]
fn spill_and_restore_through_backend_copies_keep_every_byte() {
    for granularity in [HOST_SMALL_PAGE, HOST_GPU_PAGE] {
        let Some(rig) = host_rig(None, granularity) else {
            return;
        };
        for zero_page in [false, true] {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page)).expect("space");
            let page = rig.page;
            let a = space.admit().unwrap();
            space.grow(a, 20).unwrap();
            write_tokens(&space, &rig.backend, a, 0, 20);
            let run = 2..5usize;
            let run_bytes = run.len() as u64 * page;
            let tensors: Vec<(u32, Kind)> = (0..space.config().layers)
                .flat_map(|l| kinds().map(|k| (l, k)))
                .collect();
            let host = HostBuffer::new(&rig.backend, run_bytes * tensors.len() as u64)
                .expect("host buffer");
            let ptrs: Vec<DevicePtr> = tensors
                .iter()
                .map(|&(l, k)| space.slot_ptr(a, l, k).unwrap() + run.start as u64 * page)
                .collect();
            let stream = Stream::new(&rig.backend, 0).expect("stream");
            let down: Vec<CopyDesc> = ptrs
                .iter()
                .enumerate()
                .map(|(t, &va)| CopyDesc {
                    dst: host.ptr() + t as u64 * run_bytes,
                    src: va,
                    len: run_bytes,
                })
                .collect();
            copy_between(&space, &rig.backend, &stream, &host, &down);
            space.evict_pages(a, run.clone()).unwrap();
            // Another request takes the freed pool pages and writes its own bytes into them.
            let b = space.admit().unwrap();
            space.grow(b, 8).unwrap();
            write_tokens(&space, &rig.backend, b, 0, 8);
            let in_use = rig.pool.stats().in_use;
            space.restore_pages(a, run.clone()).unwrap();
            assert_eq!(rig.pool.stats().in_use, in_use + 3 * 4, "fresh pages");
            let up: Vec<CopyDesc> = down
                .iter()
                .map(|d| CopyDesc {
                    dst: d.src,
                    src: d.dst,
                    len: d.len,
                })
                .collect();
            copy_between(&space, &rig.backend, &stream, &host, &up);
            for (&(l, k), &va) in tensors.iter().zip(&ptrs) {
                assert_eq!(
                    space.slot_ptr(a, l, k).unwrap() + run.start as u64 * page,
                    va,
                    "same VA"
                );
            }
            check_tokens(&space, &rig.backend, a, 20);
            check_tokens(&space, &rig.backend, b, 8);
            ok(&space);
        }
    }
}

#[test]
fn restore_out_of_memory_leaves_the_hole() {
    let (rig, _) = fake_rig(Some(12));
    let mut space = KvSpace::new(Arc::clone(&rig.pool), config(rig.page, true)).expect("space");
    let a = space.admit().unwrap();
    let b = space.admit().unwrap();
    space.grow(a, 6).unwrap(); // 3 pages × 4 tensors = the whole limit
    space.evict_page(a, 1).unwrap();
    space.grow(b, 1).unwrap(); // takes the 4 freed pages
    let e = space.restore_page(a, 1).expect_err("pool is full");
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(space.evicted_pages(a).unwrap(), vec![1]);
    ok(&space);
    space.shrink(b, 0).unwrap();
    space
        .restore_page(a, 1)
        .expect("restore after room was made");
    ok(&space);
}

#[test]
fn drop_gives_every_page_back() {
    for rig in all_rigs(None) {
        let baseline = rig.backend.live_counts();
        {
            let mut space =
                KvSpace::new(Arc::clone(&rig.pool), config(rig.page, false)).expect("space");
            let a = space.admit().unwrap();
            let b = space.admit().unwrap();
            space.grow(a, 20).unwrap();
            space.grow(b, 7).unwrap();
            space.free(b).unwrap();
            assert_eq!(rig.pool.stats().in_use, 32 + 12);
        }
        let stats = rig.pool.stats();
        assert_eq!(stats.in_use, 0);
        assert_eq!(stats.free, 44);
        let now = rig.backend.live_counts();
        assert_eq!(
            (now.mappings, now.reservations),
            (baseline.mappings, baseline.reservations)
        );
    }
}

#[test]
fn map_fault_rolls_back_the_whole_grow() {
    for zero_page in [false, true] {
        let (rig, fake) = fake_rig(None);
        let mut space =
            KvSpace::new(Arc::clone(&rig.pool), config(rig.page, zero_page)).expect("space");
        let a = space.admit().unwrap();
        space.grow(a, 3).unwrap();
        write_tokens(&space, &rig.backend, a, 0, 3);
        let in_use = rig.pool.stats().in_use;
        let mapped = space.stats().pages_mapped;
        // 3 → 10 tokens is 2 → 4 pages: two maps per tensor; the 7th map is in the last tensor.
        fake.fail_nth_map(7);
        let err = space.grow(a, 10).expect_err("injected");
        assert!(matches!(err, Error::InjectedFault(_)), "{err}");
        assert_eq!(space.tokens(a).unwrap(), 3);
        assert_eq!(space.mapped_pages(a).unwrap(), 2);
        assert_eq!(space.stats().pages_mapped, mapped);
        assert_eq!(rig.pool.stats().in_use, in_use, "taken pages went back");
        check_tokens(&space, &rig.backend, a, 3);
        ok(&space);
        space.grow(a, 10).expect("grow after the fault");
        write_tokens(&space, &rig.backend, a, 3, 10);
        check_tokens(&space, &rig.backend, a, 10);
        ok(&space);
        strata_vmm::check_deferred().expect("rollback recorded no error");
    }
}

// ---- random walk against a reference model ----

#[derive(Clone, Debug)]
enum Op {
    Admit,
    Grow(usize, u32),
    Shrink(usize, u32),
    Free(usize),
    Reclaim,
    UseStale(usize),
    Evict(usize, usize, usize),
    Restore(usize, usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Admit),
        5 => (any::<usize>(), 0u32..12).prop_map(|(i, d)| Op::Grow(i, d)),
        2 => (any::<usize>(), 0u32..100).prop_map(|(i, p)| Op::Shrink(i, p)),
        2 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::Reclaim),
        1 => any::<usize>().prop_map(Op::UseStale),
        3 => (any::<usize>(), any::<usize>(), 1usize..4).prop_map(|(i, p, n)| Op::Evict(i, p, n)),
        3 => (any::<usize>(), any::<usize>(), 1usize..4).prop_map(|(i, p, n)| Op::Restore(i, p, n)),
    ]
}

/// Byte spans `from..to` of a slot (relative to its start) that avoid the pages in `holes`.
fn resident_spans(page: u64, from: u64, to: u64, holes: &BTreeSet<usize>) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = Vec::new();
    let mut at = from;
    while at < to {
        let p = (at / page) as usize;
        let end = ((p as u64 + 1) * page).min(to);
        if !holes.contains(&p) {
            match spans.last_mut() {
                Some(last) if last.1 == at => last.1 = end,
                _ => spans.push((at, end)),
            }
        }
        at = end;
    }
    spans
}

/// [`write_tokens`] that skips the slot's holes.
fn write_resident(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    slot: SlotId,
    from: u32,
    to: u32,
    holes: &BTreeSet<usize>,
) {
    let bpt = space.config().bytes_per_token;
    let spans = resident_spans(
        space.page_size(),
        u64::from(from) * bpt,
        u64::from(to) * bpt,
        holes,
    );
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            for &(a, b) in &spans {
                let mut buf = vec![0u8; (b - a) as usize];
                fill(&mut buf, seed_of(slot, layer, kind), a);
                backend.write(base + a, &buf).expect("write tokens");
            }
        }
    }
}

/// [`check_tokens`] over the resident pages; with a zero page, holes must read zeros.
fn check_resident(
    space: &KvSpace,
    backend: &Arc<dyn Backend>,
    slot: SlotId,
    tokens: u32,
    holes: &BTreeSet<usize>,
) {
    let bpt = space.config().bytes_per_token;
    let page = space.page_size();
    let spans = resident_spans(page, 0, u64::from(tokens) * bpt, holes);
    for layer in 0..space.config().layers {
        for kind in kinds() {
            let base = space.slot_ptr(slot, layer, kind).expect("slot ptr");
            for &(a, b) in &spans {
                let buf = read_bytes(backend, base + a, b - a);
                if let Some(at) = first_mismatch(&buf, seed_of(slot, layer, kind), a) {
                    panic!(
                        "slot {slot:?} layer {layer} {kind:?}: mismatch at byte {}",
                        a + at as u64
                    );
                }
            }
            if space.config().zero_page {
                for &p in holes {
                    let bytes = read_bytes(backend, base + p as u64 * page, page);
                    assert!(bytes.iter().all(|&x| x == 0), "hole {p} reads zeros");
                }
            }
        }
    }
}

/// `ahead`: the map-ahead budget in pages (with or without a zero page).
fn walk(rig: &Rig, cfg: KvConfig, ops: &[Op], ahead: Option<usize>) {
    let mut space = KvSpace::new(Arc::clone(&rig.pool), cfg).expect("space");
    if let Some(budget) = ahead {
        space.start_map_ahead(budget).expect("map ahead");
    }
    // Reference model: live slots and their token counts; ids freed so far.
    let mut live: Vec<(SlotId, u32)> = Vec::new();
    let mut dead: Vec<SlotId> = Vec::new();
    let mut holes: HashMap<SlotId, BTreeSet<usize>> = HashMap::new();
    for op in ops {
        match *op {
            Op::Admit => match space.admit() {
                Ok(id) => {
                    assert!(live.iter().all(|(s, _)| s.index() != id.index()));
                    assert!(!dead.contains(&id), "an id was handed out twice");
                    live.push((id, 0));
                    holes.insert(id, BTreeSet::new());
                }
                Err(e) => {
                    assert!(matches!(e, Error::InvalidState(_)), "{e}");
                    assert_eq!(live.len(), cfg.max_slots as usize);
                }
            },
            Op::Grow(i, delta) if !live.is_empty() => {
                let k = i % live.len();
                let (id, len) = live[k];
                let to = len + delta;
                match space.grow(id, to) {
                    Ok(()) => {
                        assert!(to <= cfg.max_tokens);
                        write_resident(&space, &rig.backend, id, len, to, &holes[&id]);
                        live[k].1 = to;
                    }
                    Err(e) if to > cfg.max_tokens => {
                        assert!(matches!(e, Error::InvalidArgument(_)), "{e}")
                    }
                    Err(e) => {
                        assert!(e.is_out_of_memory(), "{e}");
                        assert_eq!(space.tokens(id).unwrap(), len);
                    }
                }
                check_resident(&space, &rig.backend, id, live[k].1, &holes[&id]);
            }
            Op::Shrink(i, pct) if !live.is_empty() => {
                let k = i % live.len();
                let (id, len) = live[k];
                let to = len * pct / 100;
                space.shrink(id, to).expect("shrink");
                live[k].1 = to;
                let need = space.pages_for(to);
                holes.get_mut(&id).unwrap().retain(|&p| p < need);
                check_resident(&space, &rig.backend, id, to, &holes[&id]);
            }
            Op::Free(i) if !live.is_empty() => {
                let (id, _) = live.swap_remove(i % live.len());
                space.free(id).expect("free");
                holes.remove(&id);
                dead.push(id);
            }
            Op::Reclaim => {
                let deferred_pages = space.stats().pages_mapped
                    - live
                        .iter()
                        .map(|&(id, _)| (space.mapped_pages(id).unwrap() - holes[&id].len()) as u64)
                        .sum::<u64>()
                        * space.tensor_count() as u64;
                assert_eq!(space.reclaim_deferred() as u64, deferred_pages);
                assert_eq!(space.stats().slots_deferred, 0);
            }
            Op::UseStale(i) if !dead.is_empty() => {
                let id = dead[i % dead.len()];
                let e = space.grow(id, 1).expect_err("stale");
                assert!(matches!(e, Error::StaleId { .. }), "{e}");
            }
            Op::Evict(i, p, n) if !live.is_empty() => {
                let (id, t) = live[i % live.len()];
                let mapped = space.mapped_pages(id).unwrap();
                let start = p % (mapped + 1);
                let run = start..start + n;
                let h = holes.get_mut(&id).unwrap();
                let valid = run.end <= mapped && run.clone().all(|q| !h.contains(&q));
                match space.evict_pages(id, run.clone()) {
                    Ok(()) => {
                        assert!(valid, "evict of {run:?} (extent {mapped}, holes {h:?})");
                        h.extend(run);
                    }
                    Err(e) => {
                        assert!(!valid, "{e}");
                        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
                    }
                }
                check_resident(&space, &rig.backend, id, t, &holes[&id]);
            }
            Op::Restore(i, p, n) if !live.is_empty() => {
                let (id, t) = live[i % live.len()];
                let mapped = space.mapped_pages(id).unwrap();
                let h = holes.get_mut(&id).unwrap();
                // Aim at a hole when there is one.
                let start = if h.is_empty() {
                    p % (mapped + 1)
                } else {
                    *h.iter().nth(p % h.len()).unwrap()
                };
                let run = start..start + n;
                let valid = run.end <= mapped && run.clone().all(|q| h.contains(&q));
                match space.restore_pages(id, run.clone()) {
                    Ok(()) => {
                        assert!(valid, "restore of {run:?} (extent {mapped}, holes {h:?})");
                        for q in run.clone() {
                            h.remove(&q);
                        }
                        // The engine copies the saved bytes back; here: the pattern.
                        let bpt = space.config().bytes_per_token;
                        let page = space.page_size();
                        let first = (run.start as u64 * page / bpt) as u32;
                        let last = (run.end as u64 * page).div_ceil(bpt).min(u64::from(t)) as u32;
                        let others: BTreeSet<usize> =
                            (0..mapped).filter(|q| !run.contains(q)).collect();
                        write_resident(&space, &rig.backend, id, first.min(last), last, &others);
                    }
                    Err(e) if valid => {
                        assert!(e.is_out_of_memory(), "{e}");
                        assert!(run.clone().all(|q| !space.is_resident(id, q).unwrap()));
                    }
                    Err(e) => assert!(matches!(e, Error::InvalidArgument(_)), "{e}"),
                }
                check_resident(&space, &rig.backend, id, t, &holes[&id]);
            }
            _ => {}
        }
        ok(&space);
        for &(id, _) in &live {
            let want: Vec<usize> = holes[&id].iter().copied().collect();
            assert_eq!(space.evicted_pages(id).unwrap(), want);
        }
        assert_eq!(
            space.stats().pages_evicted,
            holes.values().map(|h| h.len() as u64).sum::<u64>()
        );
        let s = space.stats();
        assert_eq!(s.slots_active as usize, live.len());
        assert_eq!(
            s.tokens,
            live.iter().map(|&(_, t)| u64::from(t)).sum::<u64>()
        );
        for &(id, t) in &live {
            assert_eq!(space.tokens(id).unwrap(), t);
        }
    }
    for &(id, t) in &live {
        check_resident(&space, &rig.backend, id, t, &holes[&id]);
    }
    drop(space);
    assert_eq!(rig.pool.stats().in_use, 0);
}

fn walk_config(page: u64, bpt_eighths: u64, zero_page: bool) -> KvConfig {
    KvConfig {
        layers: 2,
        max_slots: 4,
        max_tokens: 24,
        bytes_per_token: bpt_eighths * page / 8,
        zero_page,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_walk_fake(
        ops in prop::collection::vec(op(), 1..80),
        bpt_eighths in 1u64..12,
        zero_page in any::<bool>(),
        limit in prop::option::of(16u64..120),
        ahead in prop::option::of(4usize..40),
    ) {
        let (rig, _) = fake_rig(limit);
        walk(&rig, walk_config(rig.page, bpt_eighths, zero_page), &ops, ahead);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn random_walk_host(
        ops in prop::collection::vec(op(), 1..60),
        bpt_eighths in 1u64..12,
        zero_page in any::<bool>(),
        limit in prop::option::of(16u64..100),
        ahead in prop::option::of(4usize..40),
    ) {
        if let Some(rig) = host_rig(limit, HOST_SMALL_PAGE) {
            walk(&rig, walk_config(rig.page, bpt_eighths, zero_page), &ops, ahead);
        }
    }
}
