//! The Harvest controller: capacity tracking, best-fit placement, copies and revocation.

use std::sync::Arc;

use parking_lot::Mutex;
use strata_allocator::{MappedRun, PageLease, PagePool, PageSource, PoolConfig, Return};
use strata_vmm::{
    copy_async_in, Access, Backend, CopyDesc, CopyKind, CopyScope, DevicePtr, Error, Event,
    HostBuffer, Location, Reservation, Result, Stream, StreamHandle,
};

use super::config::{HarvestConfig, HarvestHints, PeerLimits};
use super::fit::{self, Candidate};
use crate::object::Durability;

mod revoke;

/// What `harvest_alloc` returns: the peer device, the base of the VA range (mapped with access
/// for the requester and the peer), its size, and an id with a generation (a revoked or freed
/// handle is stale: every later use is [`Error::StaleId`], never someone else's memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HarvestHandle {
    pub device: u32,
    pub ptr: DevicePtr,
    pub size: u64,
    pub id: u64,
}

impl HarvestHandle {
    fn index(&self) -> u32 {
        (self.id >> 32) as u32
    }
    fn generation(&self) -> u32 {
        self.id as u32
    }
}

/// Why a placement was revoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RevokeReason {
    /// The peer's free memory fell below its owner's reserve ([`HarvestController::check_pressure`]).
    Pressure,
    /// The peer's owner asked for bytes back ([`HarvestController::reclaim`], a lowered quota).
    Reclaim,
    /// A policy evicted this one placement ([`HarvestController::revoke`]).
    Policy,
}

/// What a revocation callback hears. Called once per registered callback, after the copies
/// that touched the range drained and after the handle went stale, before the pages return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Revoked {
    pub handle: HarvestHandle,
    pub durability: Durability,
    pub reason: RevokeReason,
    /// In-flight copies waited for before invalidation.
    pub drained: usize,
}

impl Revoked {
    /// True for lossy placements: the data is gone and must be reconstructed.
    pub fn lost(&self) -> bool {
        self.durability == Durability::Lossy
    }
}

/// A revocation callback. It runs on the thread that revoked, with no controller lock held
/// (it may call the controller).
pub type RevokeCallback = Box<dyn FnOnce(&Revoked) + Send>;

/// One side of a copy that is not the harvested range.
#[derive(Clone, Copy, Debug)]
pub enum Endpoint<'a> {
    /// Host memory of the backend (`HostBuffer`), at `offset`.
    Host { buffer: &'a HostBuffer, offset: u64 },
    /// Device VA inside `reservation` (mapped with access for the requester).
    Device {
        reservation: &'a Reservation,
        va: DevicePtr,
    },
}

/// Capacity of one peer as the controller sees it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCapacity {
    pub device: u32,
    pub free: u64,
    pub reserve: u64,
    pub quota: u64,
    /// Bytes lent from this device now.
    pub lent: u64,
    /// `min(free − reserve, quota − lent)`, in whole pages.
    pub harvestable: u64,
}

/// What one reclaim revoked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReclaimReport {
    pub revoked: Vec<HarvestHandle>,
    pub bytes: u64,
}

/// Counters of a controller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HarvestStats {
    pub allocs: u64,
    pub frees: u64,
    pub failed_allocs: u64,
    pub revoked_backed: u64,
    pub revoked_lossy: u64,
    pub copies: u64,
    pub live: u64,
}

/// A placement's memory. Dropping it unmaps the run and releases every page to its pool (the
/// memory goes back to the lender).
struct Placement {
    /// Pages from the lender's pool (its accounting), mapped at `reservation` ...
    _run: MappedRun,
    /// ... and the same memory adopted by the requester's pool as `Borrowed { lender }`.
    _borrowed: PageLease,
    reservation: Arc<Reservation>,
}

struct Live {
    handle: HarvestHandle,
    requester: u32,
    durability: Durability,
    revoking: bool,
    inflight: Vec<Arc<Event>>,
    callbacks: Vec<RevokeCallback>,
    placement: Placement,
}

#[derive(Default)]
struct Slot {
    generation: u32,
    live: Option<Live>,
}

struct State {
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    lent: Vec<u64>,
    config: HarvestConfig,
    stats: HarvestStats,
}

/// Places opportunistic allocations in peer HBM and revokes them when the peers need it back.
pub struct HarvestController {
    backend: Arc<dyn Backend>,
    pools: Vec<Arc<PagePool>>,
    streams: Vec<Stream>,
    page_size: u64,
    state: Mutex<State>,
}

impl HarvestController {
    /// A standalone controller over every device of `backend`, each with a page pool of its
    /// own (no background refill: pages are created when lent and released when returned, so
    /// memory really goes back to the peer). In a process with other users of the devices,
    /// share their pools instead ([`HarvestController::with_pools`]; `strata_runtime::Runtime`
    /// does), so that a page is counted once.
    pub fn new(backend: Arc<dyn Backend>, config: HarvestConfig) -> Result<Arc<Self>> {
        let pool_config = PoolConfig {
            low_watermark: 0,
            high_watermark: 0,
            limit: None,
            idle_trim_after: None,
            background: false,
        };
        let pools = (0..backend.device_count())
            .map(|d| PagePool::new(Arc::clone(&backend), d, pool_config.clone()))
            .collect::<Result<Vec<_>>>()?;
        Self::with_pools(pools, config)
    }

    /// A controller lending pages of `pools` (one per device, in device order, over one
    /// backend) — the pools the devices' other users (caching allocator, KV spaces) draw on.
    /// Lent pages are counted in use and `lent` by their pool, borrowed ones `borrowed` by the
    /// requester's; a device's free memory, for its reserve, includes its pool's idle pages
    /// (they are lent first).
    pub fn with_pools(pools: Vec<Arc<PagePool>>, config: HarvestConfig) -> Result<Arc<Self>> {
        let first = pools.first().ok_or(Error::NoDevice(0))?;
        let backend = Arc::clone(first.backend());
        let page_size = first.page_size();
        let n = backend.device_count();
        for (d, pool) in pools.iter().enumerate() {
            if pool.device() != d as u32 || !Arc::ptr_eq(pool.backend(), &backend) {
                return Err(Error::InvalidArgument(format!(
                    "pool {d} is device {} of another backend or out of order",
                    pool.device()
                )));
            }
        }
        if pools.len() != n as usize {
            return Err(Error::InvalidArgument(format!(
                "{} pools for {n} devices",
                pools.len()
            )));
        }
        let streams = (0..n)
            .map(|d| Stream::new(&backend, d))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(HarvestController {
            backend,
            pools,
            streams,
            page_size,
            state: Mutex::new(State {
                slots: Vec::new(),
                free_slots: Vec::new(),
                lent: vec![0; n as usize],
                config,
                stats: HarvestStats::default(),
            }),
        }))
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The page pool of `device` (lent pages are counted in use there).
    pub fn pool(&self, device: u32) -> Result<&Arc<PagePool>> {
        self.pools
            .get(device as usize)
            .ok_or(Error::NoDevice(device.into()))
    }

    /// The controller's copy stream on `device`.
    pub fn stream(&self, device: u32) -> Result<StreamHandle> {
        self.streams
            .get(device as usize)
            .map(Stream::handle)
            .ok_or(Error::NoDevice(device.into()))
    }

    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    pub fn stats(&self) -> HarvestStats {
        self.state.lock().stats
    }

    /// Capacity of `device` as a lender.
    pub fn capacity(&self, device: u32) -> Result<PeerCapacity> {
        let st = self.state.lock();
        self.capacity_locked(&st, device)
    }

    fn capacity_locked(&self, st: &State, device: u32) -> Result<PeerCapacity> {
        let lent = *st
            .lent
            .get(device as usize)
            .ok_or(Error::NoDevice(device.into()))?;
        let PeerLimits { reserve, quota } = st.config.limits_of(device);
        let free = self.device_free(device)?;
        let room = free.saturating_sub(reserve).min(quota.saturating_sub(lent));
        Ok(PeerCapacity {
            device,
            free,
            reserve,
            quota,
            lent,
            harvestable: room - room % self.page_size,
        })
    }

    /// Free memory of `device` as its owner sees it: the device's free memory plus the idle
    /// pages of its pool (lent first, before new ones are created).
    fn device_free(&self, device: u32) -> Result<u64> {
        let idle = self.pool(device)?.stats();
        let idle = idle.free as u64 * idle.page_size;
        Ok(self.backend.mem_info(device)?.free.saturating_add(idle))
    }

    /// Allocates `size` bytes (rounded up to pages) on the best-fit peer of `hints.requester`.
    /// Out of harvestable memory everywhere is [`Error::OutOfMemory`], a normal outcome.
    pub fn harvest_alloc(&self, size: u64, hints: &HarvestHints) -> Result<HarvestHandle> {
        let n = self.backend.device_count();
        if hints.requester >= n {
            return Err(Error::NoDevice(hints.requester.into()));
        }
        if size == 0 {
            return Err(Error::InvalidArgument("harvest_alloc of 0 bytes".into()));
        }
        let bytes = strata_vmm::round_up(size, self.page_size).ok_or(Error::Overflow("size"))?;
        let pages =
            usize::try_from(bytes / self.page_size).map_err(|_| Error::Overflow("pages"))?;
        // Rank and charge under the lock, so concurrent allocations never overshoot a quota.
        let order = {
            let st = self.state.lock();
            let mut candidates = Vec::new();
            for d in 0..n {
                if d == hints.requester && !st.config.allow_self {
                    continue;
                }
                candidates.push(Candidate {
                    device: d,
                    harvestable: self.capacity_locked(&st, d)?.harvestable,
                    direct: st.config.links.direct(hints.requester, d),
                    preferred: hints.preferred.contains(&d),
                });
            }
            fit::rank(&candidates, bytes, hints.direct_only)
        };
        let mut last = None;
        for peer in order {
            {
                let mut st = self.state.lock();
                // Re-check under the lock: another allocation may have taken the room.
                if self.capacity_locked(&st, peer)?.harvestable < bytes {
                    continue;
                }
                st.lent[peer as usize] += bytes;
            }
            match self.place(peer, bytes, pages, hints) {
                Ok(handle) => return Ok(handle),
                Err(e) => {
                    let mut st = self.state.lock();
                    st.lent[peer as usize] -= bytes;
                    if !e.is_out_of_memory() {
                        st.stats.failed_allocs += 1;
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        self.state.lock().stats.failed_allocs += 1;
        Err(last.unwrap_or(Error::OutOfMemory {
            location: Location::Device(hints.requester),
            requested: bytes,
            available: 0,
        }))
    }

    /// Takes pages on `peer`, maps them and registers the placement (charged already).
    fn place(
        &self,
        peer: u32,
        bytes: u64,
        n: usize,
        hints: &HarvestHints,
    ) -> Result<HarvestHandle> {
        let lender = &self.pools[peer as usize];
        let requester_pool = &self.pools[hints.requester as usize];
        let reservation = Arc::new(Reservation::new(&self.backend, bytes, 0)?);
        let grants = [
            (Location::Device(hints.requester), Access::ReadWrite),
            (Location::Device(peer), Access::ReadWrite),
        ];
        let grants = if peer == hints.requester {
            &grants[..1]
        } else {
            &grants[..]
        };
        // On any error below, what was built drops: unmapped, pages released to their pools.
        let lease = PageLease::lend(lender, n)?.returning(Return::Release);
        let run = MappedRun::map(lease, &reservation, reservation.ptr(), grants)?;
        let mut borrowed = PageLease::empty(requester_pool).returning(Return::Release);
        if peer != hints.requester {
            // A device lending to itself (`allow_self`) counts its pages once, as lent.
            for page in run.pages() {
                borrowed.push(requester_pool.adopt(
                    Arc::clone(page.phys()),
                    PageSource::Borrowed { lender: peer },
                )?);
            }
        }
        let mut st = self.state.lock();
        let index = match st.free_slots.pop() {
            Some(i) => i,
            None => {
                st.slots.push(Slot::default());
                (st.slots.len() - 1) as u32
            }
        };
        let slot = &mut st.slots[index as usize];
        let handle = HarvestHandle {
            device: peer,
            ptr: reservation.ptr(),
            size: bytes,
            id: (u64::from(index) << 32) | u64::from(slot.generation),
        };
        slot.live = Some(Live {
            handle,
            requester: hints.requester,
            durability: hints.durability,
            revoking: false,
            inflight: Vec::new(),
            callbacks: Vec::new(),
            placement: Placement {
                reservation,
                _run: run,
                _borrowed: borrowed,
            },
        });
        st.stats.allocs += 1;
        st.stats.live += 1;
        Ok(handle)
    }

    fn live_mut<'a>(st: &'a mut State, handle: &HarvestHandle) -> Result<&'a mut Live> {
        let stale = || Error::StaleId {
            kind: "harvest",
            index: handle.index(),
            generation: handle.generation(),
        };
        let slot = st
            .slots
            .get_mut(handle.index() as usize)
            .ok_or_else(stale)?;
        if slot.generation != handle.generation() {
            return Err(stale());
        }
        match slot.live.as_mut() {
            Some(live) if live.handle == *handle => Ok(live),
            _ => Err(stale()),
        }
    }

    /// [`Self::live_mut`], refusing a placement whose revocation began.
    fn live_unrevoked<'a>(st: &'a mut State, handle: &HarvestHandle) -> Result<&'a mut Live> {
        let live = Self::live_mut(st, handle)?;
        if live.revoking {
            return Err(Error::StaleId {
                kind: "harvest (being revoked)",
                index: handle.index(),
                generation: handle.generation(),
            });
        }
        Ok(live)
    }

    /// Registers a callback for the revocation of `handle` (several may be registered; each
    /// runs once). A freed or revoked handle is [`Error::StaleId`].
    pub fn harvest_on_revoke(
        &self,
        handle: &HarvestHandle,
        callback: RevokeCallback,
    ) -> Result<()> {
        let mut st = self.state.lock();
        Self::live_mut(&mut st, handle)?.callbacks.push(callback);
        Ok(())
    }

    /// True while `handle` is placed and not being revoked.
    pub fn is_live(&self, handle: &HarvestHandle) -> bool {
        let mut st = self.state.lock();
        Self::live_mut(&mut st, handle).is_ok_and(|l| !l.revoking)
    }

    /// Frees a placement: waits for its in-flight copies, unmaps, returns the pages. No
    /// callback runs. A stale handle (freed, revoked, or being revoked) is [`Error::StaleId`].
    pub fn harvest_free(&self, handle: &HarvestHandle) -> Result<()> {
        let events = {
            let mut st = self.state.lock();
            let live = Self::live_unrevoked(&mut st, handle)?;
            live.revoking = true;
            std::mem::take(&mut live.inflight)
        };
        let drained = drain(&events);
        let live = self.invalidate(handle);
        if let Some(live) = live {
            self.state.lock().stats.frees += 1;
            self.give_back(live);
        }
        drained
    }

    /// Queues a copy of `len` bytes from `from` into the placement at `offset`, on the
    /// requester's stream. Returns the completion event. Refused once a revocation began.
    pub fn copy_in(
        &self,
        handle: &HarvestHandle,
        offset: u64,
        from: Endpoint<'_>,
        len: u64,
    ) -> Result<Arc<Event>> {
        self.copy(handle, offset, from, len, true)
    }

    /// Queues a copy of `len` bytes of the placement at `offset` into `to`.
    pub fn copy_out(
        &self,
        handle: &HarvestHandle,
        offset: u64,
        to: Endpoint<'_>,
        len: u64,
    ) -> Result<Arc<Event>> {
        self.copy(handle, offset, to, len, false)
    }

    fn copy(
        &self,
        handle: &HarvestHandle,
        offset: u64,
        other: Endpoint<'_>,
        len: u64,
        inbound: bool,
    ) -> Result<Arc<Event>> {
        let mut st = self.state.lock();
        let live = Self::live_unrevoked(&mut st, handle)?;
        let end = offset
            .checked_add(len)
            .ok_or(Error::Overflow("offset + len"))?;
        if len == 0 || end > handle.size {
            return Err(Error::InvalidArgument(format!(
                "copy of {offset:#x}+{len:#x} outside a {:#x}-byte harvest placement",
                handle.size
            )));
        }
        let here = handle.ptr + offset;
        let (there, buffers, reservations): (DevicePtr, Vec<&HostBuffer>, Vec<&Reservation>) =
            match other {
                Endpoint::Host { buffer, offset } => (
                    buffer
                        .ptr()
                        .checked_add(offset)
                        .ok_or(Error::Overflow("offset"))?,
                    vec![buffer],
                    vec![&*live.placement.reservation],
                ),
                Endpoint::Device { reservation, va } => (
                    va,
                    Vec::new(),
                    vec![&*live.placement.reservation, reservation],
                ),
            };
        let desc = if inbound {
            CopyDesc {
                dst: here,
                src: there,
                len,
            }
        } else {
            CopyDesc {
                dst: there,
                src: here,
                len,
            }
        };
        let event = copy_async_in(
            &self.backend,
            self.streams[live.requester as usize].handle(),
            CopyKind::Batch(&[desc]),
            CopyScope {
                buffers: &buffers,
                reservations: &reservations,
            },
        )?;
        live.inflight.retain(|e| !matches!(e.query(), Ok(true)));
        live.inflight.push(Arc::clone(&event));
        st.stats.copies += 1;
        Ok(event)
    }
}

fn drain(events: &[Arc<Event>]) -> Result<()> {
    let mut first = Ok(());
    for e in events {
        if let Err(err) = e.synchronize() {
            if first.is_ok() {
                first = Err(err);
            }
        }
    }
    first
}

impl Drop for HarvestController {
    fn drop(&mut self) {
        // In-flight copies finish before the mappings go (unmap does not wait for them).
        let st = self.state.get_mut();
        for live in st.slots.iter().filter_map(|s| s.live.as_ref()) {
            if let Err(e) = drain(&live.inflight) {
                strata_vmm::record_deferred(e);
            }
        }
    }
}
