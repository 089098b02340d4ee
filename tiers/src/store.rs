//! [`TierStore`]: fixed-size objects across HBM (pool pages), host memory and disk, with a
//! residency table, durability, eviction/prefetch, events ordering every reader after the last
//! write, and revocation of HBM pages in Harvest's order. Objects can also be filled from, and
//! emptied into, device addresses the store does not own (a `KvSpace`'s tensors, for the
//! [`KvBlockManager`](crate::KvBlockManager)): [`TierStore::put_from_device`],
//! [`TierStore::take_to_device`] (restore and release) and [`TierStore::copy_to_device`]
//! (restore and keep).
//!
//! # Redundant objects
//!
//! An object is *redundant* while its owner holds the same bytes outside the store (a
//! [`TierStore::copy_to_device`] restore marks it; [`TierStore::set_redundant`] changes it).
//! Such a restore reads a disk object into a free host slot rather than staging, and the object
//! keeps that slot and leaves the disk (TierKV keeps the DRAM copy of an SSD → DRAM → HBM move).
//! Redundant objects go first under pressure: a full host tier drops them (whole: every copy)
//! before it moves any other host copy to disk or fails, and a full disk tier drops them before
//! it fails. A dropped object stays live but lost (like a revoked one: [`TierStore::residency`]
//! is [`Error::InvalidState`], [`TierStore::release`] works) and no notice is sent: its owner
//! still has the bytes, and learns of the drop when `set_redundant(ids, false)` returns `false`.
//!
//! # Ordering
//!
//! Every HBM copy carries the event of the copy that last wrote it (`hbm_ready`), every host copy
//! the event of the device→host copy that filled it (`host_ready`). Each slot keeps a `fence`:
//! the event of the last copy that read or wrote it. A copy into a slot first makes its stream
//! wait for the slot's fence (device side) or synchronizes it (CPU side: `pread`, `memcpy`); a
//! copy out of a copy waits for its ready event. Readers are ordered after writers by events,
//! never by luck. All bookkeeping sits behind one lock; host-side waits happen under it, so a
//! revocation that holds it stops every new copy onto its pages.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_allocator::{Page, PagePool};
use strata_vmm::{
    Access, Backend, CopyScope, DevicePtr, Error, Event, HostBuffer, Location, Mapping,
    Reservation, Result, MAX_HOST_CHUNK,
};

use crate::disk::{DiskFile, IoPool};
use crate::object::{Durability, Notice, ObjectId, Residency};
use crate::policy::{EvictionPolicy, PolicyKind, Tier};
use crate::transfer::{Direction, Submission, TransferEngine, TransferStats};

/// Capacity, bandwidth and latency of a tier: configured, or measured at start
/// ([`crate::calibrate`], [`StoreConfig::with_measured_links`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierSpec {
    /// Bytes.
    pub capacity: u64,
    /// Bytes per second towards the tier above (HBM: its own).
    pub bandwidth: f64,
    /// Per-transfer latency.
    pub latency: Duration,
}

/// The disk tier's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct DiskConfig {
    /// Directory for the tier's file (must exist and be writable).
    pub dir: PathBuf,
    pub spec: TierSpec,
    pub io_threads: usize,
    /// Try `O_DIRECT` (falls back to buffered I/O where the filesystem refuses it).
    pub direct: bool,
}

/// Shape of a [`TierStore`].
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub device: u32,
    /// Bytes of every object (a multiple of 4096 that divides the page size, or a multiple of it).
    pub block_size: u64,
    /// HBM: `capacity` bytes of pool pages taken at start.
    pub hbm: TierSpec,
    pub host: TierSpec,
    pub disk: Option<DiskConfig>,
    /// Host blocks for staging disk transfers (two halves: one fills from disk while the other
    /// drains to HBM).
    pub staging_blocks: u32,
    pub hbm_policy: PolicyKind,
    pub host_policy: PolicyKind,
    pub submission: Submission,
}

impl StoreConfig {
    /// A store of `block_size` blocks with the given capacities, LRU everywhere, no disk.
    pub fn new(block_size: u64, hbm_bytes: u64, host_bytes: u64) -> Self {
        StoreConfig {
            device: 0,
            block_size,
            hbm: TierSpec {
                capacity: hbm_bytes,
                bandwidth: 3350e9,
                latency: Duration::ZERO,
            },
            host: TierSpec {
                capacity: host_bytes,
                bandwidth: 50e9,
                latency: Duration::from_micros(5),
            },
            disk: None,
            staging_blocks: 16,
            hbm_policy: PolicyKind::Lru,
            host_policy: PolicyKind::Lru,
            submission: Submission::Auto,
        }
    }
}

/// Occupancy and traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreStats {
    pub block_size: u64,
    /// Used / total slots per tier (HBM total excludes revoked pages).
    pub hbm_used: u64,
    pub hbm_slots: u64,
    pub host_used: u64,
    pub host_slots: u64,
    pub disk_used: u64,
    pub disk_slots: u64,
    pub objects: u64,
    pub transfers: TransferStats,
    pub disk_read_bytes: u64,
    pub disk_write_bytes: u64,
    pub evictions_hbm: u64,
    pub evictions_host: u64,
    pub prefetched_blocks: u64,
    pub fell_back: u64,
    pub lost: u64,
    /// Redundant objects dropped for room, ever (see the module documentation).
    pub redundant_dropped: u64,
    pub pages_revoked: u64,
    pub disk_direct: bool,
}

/// What a revocation did.
#[derive(Debug, Default)]
pub struct Revocation {
    /// The pages, unmapped, for the lender.
    pub pages: Vec<Page>,
    pub fell_back: Vec<ObjectId>,
    pub lost: Vec<ObjectId>,
}

type Callback = Box<dyn Fn(Notice) + Send + Sync>;
type SlotOf = fn(&Residency) -> Option<u32>;

/// Where the two-hop disk path writes.
#[derive(Clone, Copy)]
enum HopTarget<'a> {
    /// New HBM slots of the store.
    Hbm,
    /// Device addresses of another owner (`dsts[k]` for the k-th object), inside `scope`.
    /// An object whose `keep[k]` is set is read into a free host slot instead of staging and
    /// stays there, leaving the disk (TierKV keeps the DRAM copy of an SSD → DRAM → HBM move).
    Outside {
        dsts: &'a [DevicePtr],
        scope: &'a [&'a Reservation],
        keep: &'a [bool],
    },
}

#[derive(Clone)]
struct Obj {
    generation: u32,
    live: bool,
    lost: bool,
    /// The owner holds these bytes too: dropped first under pressure.
    redundant: bool,
    durability: Durability,
    owner: u64,
    len: u64,
    res: Residency,
    hbm_ready: Option<Arc<Event>>,
    host_ready: Option<Arc<Event>>,
}

struct Slots {
    free: Vec<u32>,
    owner: Vec<Option<u32>>,
    fence: Vec<Option<Arc<Event>>>,
    retired: Vec<bool>,
}

impl Slots {
    fn new(n: u32) -> Self {
        Slots {
            free: (0..n).rev().collect(),
            owner: vec![None; n as usize],
            fence: vec![None; n as usize],
            retired: vec![false; n as usize],
        }
    }
    fn total(&self) -> u64 {
        self.owner.len() as u64 - self.retired.iter().filter(|&&r| r).count() as u64
    }
    fn used(&self) -> u64 {
        self.owner.iter().filter(|o| o.is_some()).count() as u64
    }
    fn take(&mut self, obj: u32) -> Option<u32> {
        let s = self.free.pop()?;
        self.owner[s as usize] = Some(obj);
        Some(s)
    }
    fn put_back(&mut self, s: u32, fence: Option<Arc<Event>>) {
        self.owner[s as usize] = None;
        if fence.is_some() {
            self.fence[s as usize] = fence;
        }
        if !self.retired[s as usize] {
            self.free.push(s);
        }
    }
}

struct HbmPage {
    mapping: Mapping,
    page: Page,
}

struct State {
    objs: Vec<Obj>,
    free_objs: Vec<u32>,
    hbm: Slots,
    host: Slots,
    disk: Slots,
    pages: Vec<Option<HbmPage>>,
    staging_fence: Vec<Option<Arc<Event>>>,
    hbm_policy: Box<dyn EvictionPolicy>,
    host_policy: Box<dyn EvictionPolicy>,
    step: u64,
    evictions_hbm: u64,
    evictions_host: u64,
    prefetched: u64,
    fell_back: u64,
    lost: u64,
    redundant_dropped: u64,
    pages_revoked: u64,
}

impl State {
    /// A live object with no copy yet (a retired index when one is free).
    fn new_object(&mut self, durability: Durability, owner: u64, len: u64) -> u32 {
        let fresh = Obj {
            generation: 0,
            live: true,
            lost: false,
            redundant: false,
            durability,
            owner,
            len,
            res: Residency::default(),
            hbm_ready: None,
            host_ready: None,
        };
        match self.free_objs.pop() {
            Some(i) => {
                let generation = self.objs[i as usize].generation;
                self.objs[i as usize] = Obj {
                    generation,
                    ..fresh
                };
                i
            }
            None => {
                self.objs.push(fresh);
                (self.objs.len() - 1) as u32
            }
        }
    }

    /// Gives back the HBM slots reserved for `ids` by a submission that failed (they hold no data).
    fn unreserve_hbm(&mut self, ids: &[u32]) {
        for &i in ids {
            if let Some(s) = self.objs[i as usize].res.hbm.take() {
                self.hbm.put_back(s, None);
            }
        }
    }

    /// Gives back the host slots reserved for `ids` by a submission that failed.
    fn unreserve_host(&mut self, ids: &[u32]) {
        for &i in ids {
            if let Some(h) = self.objs[i as usize].res.host.take() {
                self.host.put_back(h, None);
            }
        }
    }
}

/// Objects of one fixed size across HBM, host memory and disk. See the module documentation.
pub struct TierStore {
    config: StoreConfig,
    backend: Arc<dyn Backend>,
    pool: Arc<PagePool>,
    reservation: Arc<Reservation>,
    page_size: u64,
    slots_per_page: u32,
    host_chunks: Vec<Arc<HostBuffer>>,
    blocks_per_chunk: u64,
    staging: Arc<HostBuffer>,
    disk: Option<Arc<DiskFile>>,
    io: Option<IoPool>,
    engine: TransferEngine,
    state: Mutex<State>,
    callback: Mutex<Option<Arc<Callback>>>,
}

impl std::fmt::Debug for TierStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierStore")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

fn stale(id: ObjectId) -> Error {
    Error::StaleId {
        kind: "tier object",
        index: id.index,
        generation: id.generation,
    }
}

fn sync(ev: &Option<Arc<Event>>) -> Result<()> {
    match ev {
        Some(e) => e.synchronize(),
        None => Ok(()),
    }
}

impl TierStore {
    /// Takes the HBM pages from `pool`, maps them, allocates host memory (in chunks of at most
    /// [`MAX_HOST_CHUNK`]) and creates the disk file.
    pub fn new(pool: Arc<PagePool>, config: StoreConfig) -> Result<TierStore> {
        let backend = Arc::clone(pool.backend());
        let page_size = pool.page_size();
        let b = config.block_size;
        if b == 0 || b % 4096 != 0 || (page_size % b != 0 && b % page_size != 0) {
            return Err(Error::InvalidArgument(format!(
                "block size {b} must be a non-zero multiple of 4096 that divides or is a multiple of the page size {page_size}"
            )));
        }
        if b > page_size {
            return Err(Error::Unsupported(format!(
                "blocks above one page ({b} > {page_size}) are not supported yet"
            )));
        }
        let slots_per_page = (page_size / b) as u32;
        let n_pages = config.hbm.capacity / page_size;
        let pages = pool.take(n_pages as usize)?;
        let reservation = Arc::new(Reservation::new(&backend, (n_pages.max(1)) * page_size, 0)?);
        let grant = [(Location::Device(config.device), Access::ReadWrite)];
        let mut mapped = Vec::with_capacity(pages.len());
        let mut pages = pages.into_iter();
        for i in 0..n_pages {
            let Some(page) = pages.next() else { break };
            let va = reservation.ptr() + i * page_size;
            match Mapping::new(
                &reservation,
                va,
                Arc::clone(page.phys()),
                0,
                page_size,
                &grant,
            ) {
                Ok(mapping) => mapped.push(Some(HbmPage { mapping, page })),
                Err(e) => {
                    let mut back: Vec<Page> = vec![page];
                    back.extend(pages);
                    for p in mapped.into_iter().flatten() {
                        drop(p.mapping);
                        back.push(p.page);
                    }
                    pool.give(back);
                    return Err(e);
                }
            }
        }
        let host_blocks = config.host.capacity / b;
        let blocks_per_chunk = (MAX_HOST_CHUNK / b).max(1);
        let mut host_chunks = Vec::new();
        let mut left = host_blocks;
        while left > 0 {
            let n = left.min(blocks_per_chunk);
            host_chunks.push(Arc::new(HostBuffer::new(&backend, n * b)?));
            left -= n;
        }
        let staging_blocks = config.staging_blocks.max(2) & !1;
        let staging = Arc::new(HostBuffer::new(&backend, u64::from(staging_blocks) * b)?);
        let (disk, io, disk_blocks) = match &config.disk {
            Some(d) => (
                Some(Arc::new(DiskFile::create(&d.dir, d.direct)?)),
                Some(IoPool::new(d.io_threads)?),
                d.spec.capacity / b,
            ),
            None => (None, None, 0),
        };
        let engine = TransferEngine::new(&backend, config.device)?;
        let hbm_slots = (mapped.len() as u64 * u64::from(slots_per_page)) as u32;
        let state = State {
            objs: Vec::new(),
            free_objs: Vec::new(),
            hbm: Slots::new(hbm_slots),
            host: Slots::new(host_blocks as u32),
            disk: Slots::new(disk_blocks as u32),
            pages: mapped,
            staging_fence: vec![None; staging_blocks as usize],
            hbm_policy: config.hbm_policy.build(),
            host_policy: config.host_policy.build(),
            step: 0,
            evictions_hbm: 0,
            evictions_host: 0,
            prefetched: 0,
            fell_back: 0,
            lost: 0,
            redundant_dropped: 0,
            pages_revoked: 0,
        };
        Ok(TierStore {
            backend,
            pool,
            reservation,
            page_size,
            slots_per_page,
            host_chunks,
            blocks_per_chunk,
            staging,
            disk,
            io,
            engine,
            state: Mutex::new(state),
            callback: Mutex::new(None),
            config,
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The page pool the HBM tier takes its pages from (and a lender may give them back to).
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    pub fn block_size(&self) -> u64 {
        self.config.block_size
    }

    /// HBM pages the store holds (revoked ones included as `None` positions).
    pub fn page_count(&self) -> usize {
        self.state.lock().pages.len()
    }

    /// Sets the owner's callback: revocation notices ([`Notice`]), run after residency is
    /// invalidated and before the pages return, outside the store's lock.
    pub fn set_callback(&self, f: impl Fn(Notice) + Send + Sync + 'static) {
        *self.callback.lock() = Some(Arc::new(Box::new(f)));
    }

    /// Queues block copies on the `dir` stream through the transfer engine, with the store's
    /// host buffers, its HBM reservation and `outside` (device ranges of other owners, e.g. a
    /// `KvSpace`'s tensors) as the copy scope.
    fn submit(
        &self,
        dir: Direction,
        pairs: &[(DevicePtr, DevicePtr)],
        len: u64,
        how: Submission,
        outside: &[&Reservation],
    ) -> Result<Arc<Event>> {
        let mut buffers: Vec<&HostBuffer> = self.host_chunks.iter().map(|b| &**b).collect();
        buffers.push(&self.staging);
        let mut reservations = vec![&*self.reservation];
        reservations.extend_from_slice(outside);
        let scope = CopyScope {
            buffers: &buffers,
            reservations: &reservations,
        };
        self.engine.submit(dir, pairs, len, how, scope)
    }

    fn hbm_va(&self, slot: u32) -> DevicePtr {
        self.reservation.ptr() + u64::from(slot) * self.config.block_size
    }

    fn host_chunk(&self, slot: u32) -> (&Arc<HostBuffer>, u64) {
        let s = u64::from(slot);
        let chunk = (s / self.blocks_per_chunk) as usize;
        let off = (s % self.blocks_per_chunk) * self.config.block_size;
        (&self.host_chunks[chunk], off)
    }

    fn host_loc(&self, slot: u32) -> (&HostBuffer, u64) {
        let (buf, off) = self.host_chunk(slot);
        (buf, off)
    }

    fn host_ptr(&self, slot: u32) -> DevicePtr {
        let (buf, off) = self.host_loc(slot);
        buf.ptr() + off
    }

    fn staging_ptr(&self, i: usize) -> DevicePtr {
        self.staging.ptr() + i as u64 * self.config.block_size
    }

    fn disk(&self) -> Result<(&Arc<DiskFile>, &IoPool)> {
        match (&self.disk, &self.io) {
            (Some(d), Some(io)) => Ok((d, io)),
            _ => Err(Error::InvalidState("the store has no disk tier".into())),
        }
    }

    fn check(&self, st: &State, id: ObjectId) -> Result<usize> {
        match st.objs.get(id.index as usize) {
            Some(o) if o.live && o.generation == id.generation => {
                if o.lost {
                    Err(Error::InvalidState(format!(
                        "{id} was lost to a revocation (release it and rebuild)"
                    )))
                } else {
                    Ok(id.index as usize)
                }
            }
            _ => Err(stale(id)),
        }
    }

    /// Where an object's copies are.
    pub fn residency(&self, id: ObjectId) -> Result<Residency> {
        let st = self.state.lock();
        let i = self.check(&st, id)?;
        Ok(st.objs[i].res)
    }

    /// The HBM address of a resident object (for kernels; valid until it is evicted, revoked or
    /// released), and the event to wait for before reading it.
    pub fn hbm_ptr(&self, id: ObjectId) -> Result<(DevicePtr, Option<Arc<Event>>)> {
        let st = self.state.lock();
        let i = self.check(&st, id)?;
        let o = &st.objs[i];
        match o.res.hbm {
            Some(s) => Ok((self.hbm_va(s), o.hbm_ready.clone())),
            None => Err(Error::InvalidState(format!("{id} is not resident in HBM"))),
        }
    }

    /// Moves the policies' clock to `step`.
    pub fn advance(&self, step: u64) {
        let mut st = self.state.lock();
        st.step = step;
        st.hbm_policy.advance(step);
        st.host_policy.advance(step);
    }

    /// Scheduler lookahead for the policies: owners that run in each of the next K steps.
    pub fn schedule(&self, next_steps: &[Vec<u64>]) {
        let mut st = self.state.lock();
        st.hbm_policy.schedule(next_steps);
        st.host_policy.schedule(next_steps);
    }

    /// The scheduler's queue for the policies: owners that run after the scheduled window, in
    /// the order they will run.
    pub fn queue(&self, waiting: &[u64]) {
        let mut st = self.state.lock();
        st.hbm_policy.queue(waiting);
        st.host_policy.queue(waiting);
    }

    /// Stores a new object of `data.len() <= block_size` bytes in HBM (evicting as needed);
    /// `Backed` objects also get their authoritative copy in host memory (or on disk).
    pub fn put(&self, data: &[u8], durability: Durability, owner: u64) -> Result<ObjectId> {
        let len = data.len() as u64;
        if len == 0 || len > self.config.block_size {
            return Err(Error::InvalidArgument(format!(
                "object of {len} bytes in a store of {}-byte blocks",
                self.config.block_size
            )));
        }
        let mut st = self.state.lock();
        let index = st.new_object(durability, owner, len);
        let id = ObjectId {
            index,
            generation: st.objs[index as usize].generation,
        };
        match self.store_contents(&mut st, index, data) {
            Ok(()) => Ok(id),
            Err(e) => {
                self.drop_object(&mut st, index);
                Err(e)
            }
        }
    }

    /// Replaces an object's contents (lower copies are rewritten for `Backed`, dropped for
    /// `Lossy`).
    pub fn write(&self, id: ObjectId, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        if len == 0 || len > self.config.block_size {
            return Err(Error::InvalidArgument(format!(
                "object of {len} bytes in a store of {}-byte blocks",
                self.config.block_size
            )));
        }
        let mut st = self.state.lock();
        let i = self.check(&st, id)?;
        st.objs[i].len = len;
        self.store_contents(&mut st, i as u32, data)
    }

    /// Writes `data` into the object's HBM copy (taking a slot if needed), then replaces the
    /// lower copies: rewritten for `Backed` (new copy first, old one dropped after), dropped for
    /// `Lossy`. On failure the object keeps its previous contents and copies.
    fn store_contents(&self, st: &mut State, index: u32, data: &[u8]) -> Result<()> {
        let protect: HashSet<u32> = [index].into();
        let had_hbm = st.objs[index as usize].res.hbm;
        let slot = match had_hbm {
            Some(s) => {
                sync(&st.objs[index as usize].hbm_ready)?;
                s
            }
            None => {
                self.make_room_hbm(st, 1, &protect)?;
                let s = st.hbm.take(index).ok_or_else(|| self.hbm_oom(1))?;
                st.objs[index as usize].res.hbm = Some(s);
                s
            }
        };
        let written = sync(&st.hbm.fence[slot as usize])
            .and_then(|()| self.backend.write(self.hbm_va(slot), data));
        if let Err(e) = written {
            if had_hbm.is_none() {
                st.objs[index as usize].res.hbm = None;
                st.hbm.put_back(slot, None);
            }
            return Err(e);
        }
        st.objs[index as usize].hbm_ready = None;
        let (owner, step) = (st.objs[index as usize].owner, st.step);
        let key = self.key(st, index);
        st.hbm_policy.touch(key, owner, step);
        if st.objs[index as usize].durability == Durability::Backed {
            match self.back_up(st, index, data) {
                Ok(fresh) => {
                    self.drop_lower(st, index);
                    let o = &mut st.objs[index as usize];
                    o.res.host = fresh.host;
                    o.res.disk = fresh.disk;
                    if fresh.host.is_some() {
                        st.host_policy.touch(key, owner, step);
                    }
                }
                Err(e) => {
                    // The HBM copy holds the new bytes but no authoritative copy does: drop it,
                    // so the object keeps its previous contents (put removes a new object).
                    self.drop_hbm_with_fence(st, index, None);
                    return Err(e);
                }
            }
        } else {
            self.drop_lower(st, index);
        }
        Ok(())
    }

    fn key(&self, st: &State, index: u32) -> u64 {
        ObjectId {
            index,
            generation: st.objs[index as usize].generation,
        }
        .key()
    }

    /// Writes a fresh authoritative copy of a `Backed` object in new slots: host memory if it
    /// has (or can make) room, else disk. The caller swaps it in for the old copies.
    fn back_up(&self, st: &mut State, index: u32, data: &[u8]) -> Result<Residency> {
        let protect: HashSet<u32> = [index].into();
        if self.make_room_host(st, 1, &protect).is_ok() {
            if let Some(s) = st.host.take(index) {
                let (buf, off) = self.host_loc(s);
                if let Err(e) =
                    sync(&st.host.fence[s as usize]).and_then(|()| buf.write_at(off, data))
                {
                    st.host.put_back(s, None);
                    return Err(e);
                }
                return Ok(Residency {
                    host: Some(s),
                    ..Residency::default()
                });
            }
        }
        let (disk, _) = self.disk().map_err(|_| Error::OutOfMemory {
            location: Location::Host,
            requested: self.config.block_size,
            available: 0,
        })?;
        let d = self.take_disk(st, index)?;
        let r = sync(&st.staging_fence[0])
            .and_then(|()| self.staging.write_at(0, data))
            .and_then(|()| {
                disk.write_from(
                    &self.staging,
                    0,
                    self.disk_offset(d),
                    self.config.block_size,
                )
            });
        if let Err(e) = r {
            st.disk.put_back(d, None);
            return Err(e);
        }
        Ok(Residency {
            disk: Some(d),
            ..Residency::default()
        })
    }

    fn disk_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.config.block_size
    }

    /// A free disk slot for object `index`, dropping a redundant object for it when the tier
    /// is full.
    fn take_disk(&self, st: &mut State, index: u32) -> Result<u32> {
        let Some(cfg) = &self.config.disk else {
            return Err(Error::InvalidState("the store has no disk tier".into()));
        };
        if st.disk.free.is_empty() {
            self.drop_redundant(st, |r| r.disk, &HashSet::from([index]));
        }
        st.disk.take(index).ok_or(Error::LimitExceeded {
            requested: self.config.block_size,
            used: st.disk.used() * self.config.block_size,
            limit: cfg.spec.capacity,
        })
    }

    fn hbm_oom(&self, n: u64) -> Error {
        Error::OutOfMemory {
            location: Location::Device(self.config.device),
            requested: n * self.config.block_size,
            available: 0,
        }
    }

    fn drop_lower(&self, st: &mut State, index: u32) {
        let key = self.key(st, index);
        let o = &mut st.objs[index as usize];
        o.host_ready = None;
        // The slot's fence already names the last copy that read or wrote it.
        if let Some(h) = o.res.host.take() {
            st.host.put_back(h, None);
            st.host_policy.remove(key);
        }
        if let Some(d) = st.objs[index as usize].res.disk.take() {
            st.disk.put_back(d, None);
        }
    }

    /// Frees an object's slots and retires its id.
    fn drop_object(&self, st: &mut State, index: u32) {
        let key = self.key(st, index);
        self.drop_lower(st, index);
        let o = &mut st.objs[index as usize];
        let ready = o.hbm_ready.take();
        if let Some(h) = o.res.hbm.take() {
            st.hbm.put_back(h, ready);
        }
        st.hbm_policy.remove(key);
        let o = &mut st.objs[index as usize];
        o.live = false;
        o.lost = false;
        o.redundant = false;
        o.generation = o.generation.wrapping_add(1);
        st.free_objs.push(index);
    }

    /// Releases an object (stale or unknown ids are [`Error::StaleId`]; lost objects release).
    pub fn release(&self, id: ObjectId) -> Result<()> {
        let mut st = self.state.lock();
        match st.objs.get(id.index as usize) {
            Some(o) if o.live && o.generation == id.generation => {}
            _ => return Err(stale(id)),
        }
        self.drop_object(&mut st, id.index);
        Ok(())
    }

    /// Ensures `n` free HBM slots, evicting unprotected objects by the HBM policy.
    fn make_room_hbm(&self, st: &mut State, n: usize, protect: &HashSet<u32>) -> Result<()> {
        if st.hbm.free.len() >= n {
            return Ok(());
        }
        let mut victims = Vec::new();
        let need = n - st.hbm.free.len();
        let mut chosen: HashSet<u32> = HashSet::new();
        while victims.len() < need {
            let objs = &st.objs;
            let v = st.hbm_policy.victim(&mut |k| {
                let id = ObjectId::from_key(k);
                let i = id.index;
                !protect.contains(&i)
                    && !chosen.contains(&i)
                    && objs.get(i as usize).is_some_and(|o| {
                        o.live && o.generation == id.generation && o.res.hbm.is_some()
                    })
            });
            match v {
                Some(k) => {
                    let i = ObjectId::from_key(k).index;
                    chosen.insert(i);
                    victims.push(i);
                }
                None => break,
            }
        }
        self.demote_hbm(st, &victims)?;
        if st.hbm.free.len() >= n {
            Ok(())
        } else {
            Err(self.hbm_oom(n as u64))
        }
    }

    /// Moves HBM copies down: objects with a lower copy just drop theirs; the others go to host
    /// memory in one coalesced batch (or, when the host tier is full, to disk through staging).
    fn demote_hbm(&self, st: &mut State, victims: &[u32]) -> Result<()> {
        let mut to_host = Vec::new();
        let mut to_disk = Vec::new();
        for &i in victims {
            let o = &st.objs[i as usize];
            if o.res.host.is_some() || o.res.disk.is_some() {
                self.drop_hbm(st, i);
                st.evictions_hbm += 1;
            } else {
                to_host.push(i);
            }
        }
        if !to_host.is_empty() {
            let protect: HashSet<u32> = victims.iter().copied().collect();
            let _ = self.make_room_host(st, to_host.len(), &protect);
            let fit = st.host.free.len().min(to_host.len());
            to_disk = to_host.split_off(fit);
        }
        if !to_host.is_empty() {
            let mut pairs = Vec::with_capacity(to_host.len());
            for &i in &to_host {
                let h = st.host.take(i).ok_or_else(|| self.hbm_oom(1))?;
                sync(&st.host.fence[h as usize])?;
                let o = &st.objs[i as usize];
                if let Some(ev) = &o.hbm_ready {
                    self.engine.wait(Direction::DeviceToHost, ev)?;
                }
                let src = self.hbm_va(o.res.hbm.unwrap_or_default());
                pairs.push((src, self.host_ptr(h)));
                st.objs[i as usize].res.host = Some(h);
            }
            let ev = match self.submit(
                Direction::DeviceToHost,
                &pairs,
                self.config.block_size,
                self.config.submission,
                &[],
            ) {
                Ok(ev) => ev,
                Err(e) => {
                    st.unreserve_host(&to_host);
                    return Err(e);
                }
            };
            for &i in &to_host {
                st.objs[i as usize].host_ready = Some(Arc::clone(&ev));
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                st.host.fence[h as usize] = Some(Arc::clone(&ev));
                let (owner, step, key) = (st.objs[i as usize].owner, st.step, self.key(st, i));
                st.host_policy.touch(key, owner, step);
                self.drop_hbm_with_fence(st, i, Some(Arc::clone(&ev)));
                st.evictions_hbm += 1;
            }
        }
        for &i in &to_disk {
            self.hbm_to_disk(st, i)?;
            st.evictions_hbm += 1;
        }
        Ok(())
    }

    fn hbm_to_disk(&self, st: &mut State, i: u32) -> Result<()> {
        let o = &st.objs[i as usize];
        let src = self.hbm_va(o.res.hbm.unwrap_or_default());
        let after = o.hbm_ready.clone();
        self.device_to_disk(st, i, src, after.as_deref(), &[])?;
        self.drop_hbm(st, i);
        Ok(())
    }

    /// Writes the block at device address `src` (after `after`) to a new disk copy of object
    /// `i`, through staging: one device→host copy, waited for, then one file write.
    fn device_to_disk(
        &self,
        st: &mut State,
        i: u32,
        src: DevicePtr,
        after: Option<&Event>,
        outside: &[&Reservation],
    ) -> Result<()> {
        let (disk, _) = self.disk().map_err(|_| Error::OutOfMemory {
            location: Location::Host,
            requested: self.config.block_size,
            available: 0,
        })?;
        let d = self.take_disk(st, i)?;
        let result = (|| {
            sync(&st.staging_fence[0])?;
            if let Some(ev) = after {
                self.engine.wait(Direction::DeviceToHost, ev)?;
            }
            let ev = self.submit(
                Direction::DeviceToHost,
                &[(src, self.staging_ptr(0))],
                self.config.block_size,
                Submission::Coalesced,
                outside,
            )?;
            ev.synchronize()?;
            disk.write_from(
                &self.staging,
                0,
                self.disk_offset(d),
                self.config.block_size,
            )
        })();
        match result {
            Ok(()) => {
                st.objs[i as usize].res.disk = Some(d);
                Ok(())
            }
            Err(e) => {
                st.disk.put_back(d, None);
                Err(e)
            }
        }
    }

    fn drop_hbm(&self, st: &mut State, i: u32) {
        let ready = st.objs[i as usize].hbm_ready.clone();
        self.drop_hbm_with_fence(st, i, ready);
    }

    fn drop_hbm_with_fence(&self, st: &mut State, i: u32, fence: Option<Arc<Event>>) {
        let key = self.key(st, i);
        let o = &mut st.objs[i as usize];
        o.hbm_ready = None;
        if let Some(h) = o.res.hbm.take() {
            st.hbm.put_back(h, fence);
        }
        st.hbm_policy.remove(key);
    }

    /// Drops one unprotected redundant object that holds a slot of the tier `slot_of` reads
    /// (the host policy's victim first), whole: it becomes lost. False when there is none.
    fn drop_redundant(&self, st: &mut State, slot_of: SlotOf, protect: &HashSet<u32>) -> bool {
        let droppable = |i: u32, o: &Obj| {
            o.live && o.redundant && !protect.contains(&i) && slot_of(&o.res).is_some()
        };
        let objs = &st.objs;
        let by_policy = st.host_policy.victim(&mut |k| {
            let id = ObjectId::from_key(k);
            objs.get(id.index as usize)
                .is_some_and(|o| o.generation == id.generation && droppable(id.index, o))
        });
        let Some(i) = by_policy
            .map(|k| ObjectId::from_key(k).index)
            .or_else(|| (0..objs.len() as u32).find(|&i| droppable(i, &objs[i as usize])))
        else {
            return false;
        };
        self.drop_lower(st, i);
        self.drop_hbm(st, i);
        let o = &mut st.objs[i as usize];
        o.lost = true;
        o.redundant = false;
        st.redundant_dropped += 1;
        true
    }

    /// Ensures `n` free host slots: drops unprotected redundant objects first, then moves
    /// host copies to disk (or drops copies that are not the last one).
    fn make_room_host(&self, st: &mut State, n: usize, protect: &HashSet<u32>) -> Result<()> {
        let mut tried: HashSet<u32> = HashSet::new();
        while st.host.free.len() < n {
            if self.drop_redundant(st, |r| r.host, protect) {
                continue;
            }
            let has_disk = self.disk.is_some() && !st.disk.free.is_empty();
            let objs = &st.objs;
            let v = st.host_policy.victim(&mut |k| {
                let id = ObjectId::from_key(k);
                let i = id.index;
                !protect.contains(&i)
                    && !tried.contains(&i)
                    && objs.get(i as usize).is_some_and(|o| {
                        o.live
                            && o.generation == id.generation
                            && o.res.host.is_some()
                            && (o.res.disk.is_some()
                                || (o.durability == Durability::Lossy && o.res.hbm.is_some())
                                || has_disk)
                    })
            });
            let Some(k) = v else {
                return Err(Error::OutOfMemory {
                    location: Location::Host,
                    requested: n as u64 * self.config.block_size,
                    available: st.host.free.len() as u64 * self.config.block_size,
                });
            };
            let i = ObjectId::from_key(k).index;
            tried.insert(i);
            self.demote_host(st, i)?;
            st.evictions_host += 1;
        }
        Ok(())
    }

    fn demote_host(&self, st: &mut State, i: u32) -> Result<()> {
        let o = &st.objs[i as usize];
        let keep_elsewhere =
            o.res.disk.is_some() || (o.durability == Durability::Lossy && o.res.hbm.is_some());
        if !keep_elsewhere {
            let (disk, _) = self.disk()?;
            let d = self.take_disk(st, i)?;
            let h = st.objs[i as usize].res.host.unwrap_or_default();
            let r = sync(&st.objs[i as usize].host_ready).and_then(|()| {
                let (buf, off) = self.host_loc(h);
                disk.write_from(buf, off, self.disk_offset(d), self.config.block_size)
            });
            if let Err(e) = r {
                st.disk.put_back(d, None);
                return Err(e);
            }
            st.objs[i as usize].res.disk = Some(d);
        }
        let key = self.key(st, i);
        let o = &mut st.objs[i as usize];
        o.host_ready = None;
        if let Some(h) = o.res.host.take() {
            st.host.put_back(h, None);
        }
        st.host_policy.remove(key);
        Ok(())
    }

    /// Makes objects resident in HBM asynchronously and returns the event to wait for (on the
    /// compute stream: `stream_wait_event`; on the CPU: `synchronize`). Host copies move in one
    /// coalesced batch (or one block-copy kernel launch); disk copies take the two-hop path
    /// disk → host staging → HBM, pipelined over the two staging halves. A full HBM tier whose
    /// objects are all in `ids` is [`Error::OutOfMemory`].
    pub fn prefetch(&self, ids: &[ObjectId]) -> Result<Arc<Event>> {
        let mut st = self.state.lock();
        let mut idx = Vec::with_capacity(ids.len());
        for &id in ids {
            idx.push(self.check(&st, id)? as u32);
        }
        let protect: HashSet<u32> = idx.iter().copied().collect();
        let mut missing: Vec<u32> = protect
            .iter()
            .copied()
            .filter(|&i| st.objs[i as usize].res.hbm.is_none())
            .collect();
        missing.sort_unstable();
        self.make_room_hbm(&mut st, missing.len(), &protect)?;
        self.check_not_dropped(&st, &idx)?;
        let (from_host, from_disk): (Vec<u32>, Vec<u32>) = missing
            .iter()
            .partition(|&&i| st.objs[i as usize].res.host.is_some());
        // Host → HBM, one batch.
        if !from_host.is_empty() {
            let mut pairs = Vec::with_capacity(from_host.len());
            let mut waited: HashSet<*const Event> = HashSet::new();
            for &i in &from_host {
                let s = st.hbm.take(i).ok_or_else(|| self.hbm_oom(1))?;
                if let Some(f) = st.hbm.fence[s as usize].clone() {
                    if waited.insert(Arc::as_ptr(&f)) {
                        self.engine.wait(Direction::HostToDevice, &f)?;
                    }
                }
                if let Some(ev) = st.objs[i as usize].host_ready.clone() {
                    if waited.insert(Arc::as_ptr(&ev)) {
                        self.engine.wait(Direction::HostToDevice, &ev)?;
                    }
                }
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                pairs.push((self.host_ptr(h), self.hbm_va(s)));
                st.objs[i as usize].res.hbm = Some(s);
            }
            let r = self.submit(
                Direction::HostToDevice,
                &pairs,
                self.config.block_size,
                self.config.submission,
                &[],
            );
            let ev = match r {
                Ok(ev) => ev,
                Err(e) => {
                    st.unreserve_hbm(&from_host);
                    return Err(e);
                }
            };
            for &i in &from_host {
                st.objs[i as usize].hbm_ready = Some(Arc::clone(&ev));
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                st.host.fence[h as usize] = Some(Arc::clone(&ev));
            }
        }
        // Disk → staging → HBM, pipelined over two halves.
        if !from_disk.is_empty() {
            self.two_hop(&mut st, &from_disk, HopTarget::Hbm)?;
        }
        let step = st.step;
        for &i in &idx {
            let (owner, key) = (st.objs[i as usize].owner, self.key(&st, i));
            st.hbm_policy.touch(key, owner, step);
        }
        st.prefetched += missing.len() as u64;
        drop(st);
        self.submit(Direction::HostToDevice, &[], 0, Submission::Coalesced, &[])
    }

    /// Object `i`'s bytes now sit in host slot `h` (read there from disk; `ev` reads them):
    /// the host slot becomes its copy and its disk slot is freed.
    fn move_disk_to_host(&self, st: &mut State, i: u32, h: u32, ev: &Arc<Event>) {
        st.host.fence[h as usize] = Some(Arc::clone(ev));
        let (owner, step, key) = (st.objs[i as usize].owner, st.step, self.key(st, i));
        let o = &mut st.objs[i as usize];
        o.res.host = Some(h);
        o.host_ready = None;
        if let Some(d) = o.res.disk.take() {
            st.disk.put_back(d, None);
        }
        st.host_policy.touch(key, owner, step);
    }

    /// Disk → staging → `target`, pipelined over the two staging halves: one half fills from
    /// disk (parallel reads on the I/O pool) while the other drains to the device.
    fn two_hop(&self, st: &mut State, objs: &[u32], target: HopTarget<'_>) -> Result<()> {
        let (disk, io) = self.disk()?;
        let half = st.staging_fence.len() / 2;
        let b = self.config.block_size;
        for (round, chunk) in objs.chunks(half).enumerate() {
            let base = (round % 2) * half;
            // The half is free once its previous H2D drained.
            for f in &st.staging_fence[base..base + half] {
                sync(f)?;
            }
            // Where each object is read to: a free host slot it keeps, or staging.
            let keeps = |j: usize| match target {
                HopTarget::Outside { keep, .. } => keep[round * half + j],
                HopTarget::Hbm => false,
            };
            let mut disk_slots = Vec::with_capacity(chunk.len());
            for &i in chunk {
                let d = st.objs[i as usize].res.disk.ok_or_else(|| {
                    Error::InvalidState(format!("object #{i} has no disk copy to read"))
                })?;
                disk_slots.push(d);
            }
            let mut kept: Vec<Option<u32>> = Vec::with_capacity(chunk.len());
            for (j, &i) in chunk.iter().enumerate() {
                let slot = if keeps(j) { st.host.take(i) } else { None };
                if let Some(h) = slot {
                    // A free slot's fence names the last copy that read it.
                    if let Err(e) = sync(&st.host.fence[h as usize]) {
                        st.host.put_back(h, None);
                        for h in kept.into_iter().flatten() {
                            st.host.put_back(h, None);
                        }
                        return Err(e);
                    }
                }
                kept.push(slot);
            }
            // Hop 1: parallel reads on the I/O pool (the other half's H2D is still running).
            let mut tickets = Vec::with_capacity(chunk.len());
            let mut first_err = None;
            for (j, &d) in disk_slots.iter().enumerate() {
                let disk = Arc::clone(disk);
                let file_off = self.disk_offset(d);
                let (buf, off) = match kept[j] {
                    Some(h) => {
                        let (buf, off) = self.host_chunk(h);
                        (Arc::clone(buf), off)
                    }
                    None => (Arc::clone(&self.staging), (base + j) as u64 * b),
                };
                match io.submit(move || disk.read_into(&buf, off, file_off, b)) {
                    Ok(t) => tickets.push(t),
                    Err(e) => {
                        first_err = Some(e);
                        break;
                    }
                }
            }
            // Every submitted read finishes before its buffer can be reused.
            for t in tickets {
                if let Err(e) = t.wait() {
                    first_err.get_or_insert(e);
                }
            }
            if let Some(e) = first_err {
                for h in kept.into_iter().flatten() {
                    st.host.put_back(h, None);
                }
                return Err(e);
            }
            // Hop 2: one H2D batch for the chunk.
            let mut pairs = Vec::with_capacity(chunk.len());
            for (j, &i) in chunk.iter().enumerate() {
                let dst = match target {
                    HopTarget::Hbm => {
                        let s = st.hbm.take(i).ok_or_else(|| self.hbm_oom(1))?;
                        if let Some(f) = st.hbm.fence[s as usize].clone() {
                            self.engine.wait(Direction::HostToDevice, &f)?;
                        }
                        st.objs[i as usize].res.hbm = Some(s);
                        self.hbm_va(s)
                    }
                    HopTarget::Outside { dsts, .. } => dsts[round * half + j],
                };
                let src = kept[j].map_or_else(|| self.staging_ptr(base + j), |h| self.host_ptr(h));
                pairs.push((src, dst));
            }
            let outside = match target {
                HopTarget::Hbm => &[][..],
                HopTarget::Outside { scope, .. } => scope,
            };
            let ev = match self.submit(
                Direction::HostToDevice,
                &pairs,
                b,
                self.config.submission,
                outside,
            ) {
                Ok(ev) => ev,
                Err(e) => {
                    // Nothing of this chunk was queued: its HBM slots hold no data, and the
                    // host slots read for keeping are not the objects' yet.
                    if matches!(target, HopTarget::Hbm) {
                        st.unreserve_hbm(chunk);
                    }
                    for h in kept.into_iter().flatten() {
                        st.host.put_back(h, None);
                    }
                    return Err(e);
                }
            };
            for (j, &i) in chunk.iter().enumerate() {
                if matches!(target, HopTarget::Hbm) {
                    st.objs[i as usize].hbm_ready = Some(Arc::clone(&ev));
                }
                match kept[j] {
                    Some(h) => self.move_disk_to_host(st, i, h, &ev),
                    None => st.staging_fence[base + j] = Some(Arc::clone(&ev)),
                }
            }
        }
        Ok(())
    }
}

impl TierStore {
    /// Reads an object (exactly its length) from its fastest copy, after the copy's last write.
    pub fn read(&self, id: ObjectId, out: &mut [u8]) -> Result<Tier> {
        let mut st = self.state.lock();
        let i = self.check(&st, id)?;
        let o = st.objs[i].clone();
        if out.len() as u64 != o.len {
            return Err(Error::InvalidArgument(format!(
                "{id} holds {} bytes, read buffer has {}",
                o.len,
                out.len()
            )));
        }
        let (step, key) = (st.step, id.key());
        if let Some(s) = o.res.hbm {
            sync(&o.hbm_ready)?;
            self.backend.read(self.hbm_va(s), out)?;
            st.hbm_policy.touch(key, o.owner, step);
            Ok(Tier::Hbm)
        } else if let Some(h) = o.res.host {
            sync(&o.host_ready)?;
            let (buf, off) = self.host_loc(h);
            buf.read_at(off, out)?;
            st.host_policy.touch(key, o.owner, step);
            Ok(Tier::Host)
        } else if let Some(d) = o.res.disk {
            let (disk, _) = self.disk()?;
            sync(&st.staging_fence[0])?;
            disk.read_into(
                &self.staging,
                0,
                self.disk_offset(d),
                self.config.block_size,
            )?;
            self.staging.read_at(0, out)?;
            Ok(Tier::Disk)
        } else {
            Err(Error::InvalidState(format!("{id} has no copy")))
        }
    }

    /// Moves objects down to `to` (`Host` or `Disk`), freeing their HBM copies (and, for `Disk`,
    /// their host copies). Objects already at or below `to` stay.
    pub fn spill(&self, ids: &[ObjectId], to: Tier) -> Result<()> {
        if to == Tier::Hbm {
            return Err(Error::InvalidArgument(
                "spill goes down: to Host or Disk".into(),
            ));
        }
        if to == Tier::Disk && self.disk.is_none() {
            return Err(Error::InvalidState("the store has no disk tier".into()));
        }
        let mut st = self.state.lock();
        let mut idx = Vec::with_capacity(ids.len());
        for &id in ids {
            idx.push(self.check(&st, id)? as u32);
        }
        idx.sort_unstable();
        idx.dedup();
        let in_hbm: Vec<u32> = idx
            .iter()
            .copied()
            .filter(|&i| st.objs[i as usize].res.hbm.is_some())
            .collect();
        self.demote_hbm(&mut st, &in_hbm)?;
        if to == Tier::Disk {
            for &i in &idx {
                if st.objs[i as usize].res.host.is_some() {
                    self.demote_host(&mut st, i)?;
                }
            }
        }
        self.check_not_dropped(&st, &idx)
    }

    /// Making room may drop redundant objects (see the module docs), the call's own included:
    /// then the call did not do what it was asked for them, which is an error, not a silent
    /// loss. (`idx` were all live and not lost when the call checked them.)
    fn check_not_dropped(&self, st: &State, idx: &[u32]) -> Result<()> {
        match idx.iter().find(|&&i| st.objs[i as usize].lost) {
            Some(i) => Err(Error::InvalidState(format!(
                "object #{i} was a redundant copy and was dropped to make room"
            ))),
            None => Ok(()),
        }
    }

    /// Takes HBM pages back (their indices in `0..page_count()`), in Harvest's order: no new
    /// copy starts on them (their slots are retired while the store's lock is held) → in-flight
    /// copies touching them drain (events) → residency is invalidated (objects with a copy in
    /// host memory or on disk fall back to it; lossy objects with none are lost, exactly once) →
    /// the owner's callback runs for each → the pages are unmapped and returned.
    pub fn revoke_pages(&self, pages: &[u32]) -> Result<Revocation> {
        let mut st = self.state.lock();
        let mut set: Vec<u32> = pages.to_vec();
        set.sort_unstable();
        set.dedup();
        for &p in &set {
            if st.pages.get(p as usize).is_none_or(|x| x.is_none()) {
                return Err(Error::InvalidArgument(format!(
                    "HBM page {p} is not held by the store (revoked already, or out of range)"
                )));
            }
        }
        let spp = self.slots_per_page;
        let slots: Vec<u32> = set.iter().flat_map(|&p| p * spp..(p + 1) * spp).collect();
        // 1. No new copies onto them.
        for &s in &slots {
            st.hbm.retired[s as usize] = true;
        }
        let retired: HashSet<u32> = slots.iter().copied().collect();
        st.hbm.free.retain(|s| !retired.contains(s));
        // 2. Drain in-flight copies.
        for &s in &slots {
            sync(&st.hbm.fence[s as usize])?;
            if let Some(i) = st.hbm.owner[s as usize] {
                sync(&st.objs[i as usize].hbm_ready)?;
            }
        }
        // 3. Invalidate residency.
        let mut notices = Vec::new();
        let mut out = Revocation::default();
        for &s in &slots {
            let Some(i) = st.hbm.owner[s as usize].take() else {
                continue;
            };
            st.hbm.fence[s as usize] = None;
            let key = self.key(&st, i);
            st.hbm_policy.remove(key);
            let id = ObjectId::from_key(key);
            let o = &mut st.objs[i as usize];
            o.res.hbm = None;
            o.hbm_ready = None;
            if o.res.host.is_some() || o.res.disk.is_some() {
                notices.push(Notice::FellBack { id, owner: o.owner });
                out.fell_back.push(id);
                st.fell_back += 1;
            } else {
                o.lost = true;
                notices.push(Notice::Lost { id, owner: o.owner });
                out.lost.push(id);
                st.lost += 1;
            }
        }
        let taken: Vec<HbmPage> = set
            .iter()
            .filter_map(|&p| st.pages[p as usize].take())
            .collect();
        st.pages_revoked += taken.len() as u64;
        drop(st);
        // 4. Callbacks (outside the lock: they may call back into the store).
        let cb = self.callback.lock().clone();
        if let Some(cb) = cb {
            for n in notices {
                cb(n);
            }
        }
        // 5. Return the pages.
        let mut first_err = None;
        for hp in taken {
            if let Err(e) = hp.mapping.unmap() {
                first_err.get_or_insert(e);
            }
            out.pages.push(hp.page);
        }
        match first_err {
            Some(e) => {
                strata_vmm::record_deferred(e);
                Ok(out)
            }
            None => Ok(out),
        }
    }

    /// Waits for every queued copy; reports asynchronous copy failures.
    pub fn synchronize(&self) -> Result<()> {
        self.engine.synchronize()
    }

    pub fn stats(&self) -> StoreStats {
        let st = self.state.lock();
        StoreStats {
            block_size: self.config.block_size,
            hbm_used: st.hbm.used(),
            hbm_slots: st.hbm.total(),
            host_used: st.host.used(),
            host_slots: st.host.total(),
            disk_used: st.disk.used(),
            disk_slots: st.disk.total(),
            objects: st.objs.iter().filter(|o| o.live).count() as u64,
            transfers: self.engine.stats(),
            disk_read_bytes: self
                .disk
                .as_ref()
                .map_or(0, |d| d.bytes_read.load(Ordering::Relaxed)),
            disk_write_bytes: self
                .disk
                .as_ref()
                .map_or(0, |d| d.bytes_written.load(Ordering::Relaxed)),
            evictions_hbm: st.evictions_hbm,
            evictions_host: st.evictions_host,
            prefetched_blocks: st.prefetched,
            fell_back: st.fell_back,
            lost: st.lost,
            redundant_dropped: st.redundant_dropped,
            pages_revoked: st.pages_revoked,
            disk_direct: self.disk.as_ref().is_some_and(|d| d.is_direct()),
        }
    }

    /// Checks the residency table against the slot tables; run after every step in tests.
    pub fn check_invariants(&self) -> Result<()> {
        let st = self.state.lock();
        let bad = |m: String| Err(Error::InvalidState(format!("tier invariant: {m}")));
        let tiers: [(&str, &Slots, SlotOf); 3] = [
            ("hbm", &st.hbm, |r| r.hbm),
            ("host", &st.host, |r| r.host),
            ("disk", &st.disk, |r| r.disk),
        ];
        for (name, slots, get) in tiers {
            let mut seen = HashSet::new();
            for &f in &slots.free {
                if !seen.insert(f) {
                    return bad(format!("{name} slot {f} twice on the free list"));
                }
                if slots.owner[f as usize].is_some() || slots.retired[f as usize] {
                    return bad(format!("{name} slot {f} free but owned or retired"));
                }
            }
            for (s, owner) in slots.owner.iter().enumerate() {
                match owner {
                    Some(i) => {
                        let o = &st.objs[*i as usize];
                        if !o.live || get(&o.res) != Some(s as u32) {
                            return bad(format!("{name} slot {s} owned by {i}, which disagrees"));
                        }
                        if slots.retired[s] {
                            return bad(format!("{name} slot {s} retired but owned"));
                        }
                    }
                    None => {
                        if !slots.retired[s] && !seen.contains(&(s as u32)) {
                            return bad(format!("{name} slot {s} neither owned nor free"));
                        }
                    }
                }
            }
            for (i, o) in st.objs.iter().enumerate() {
                if let Some(s) = get(&o.res) {
                    if !o.live || slots.owner.get(s as usize) != Some(&Some(i as u32)) {
                        return bad(format!("object {i} claims {name} slot {s}"));
                    }
                }
            }
        }
        for (i, o) in st.objs.iter().enumerate() {
            if !o.live {
                if o.res != Residency::default() {
                    return bad(format!("dead object {i} holds copies"));
                }
                continue;
            }
            if o.lost {
                if o.res != Residency::default() || o.redundant {
                    return bad(format!("lost object {i} holds copies or is redundant"));
                }
                continue;
            }
            if o.res.fastest().is_none() {
                return bad(format!("live object {i} has no copy"));
            }
            if o.durability == Durability::Backed && o.res.host.is_none() && o.res.disk.is_none() {
                return bad(format!("backed object {i} lacks its authoritative copy"));
            }
        }
        for (p, page) in st.pages.iter().enumerate() {
            if page.is_none() {
                let spp = self.slots_per_page as usize;
                if (p * spp..(p + 1) * spp).any(|s| !st.hbm.retired[s]) {
                    return bad(format!("revoked page {p} has live slots"));
                }
            }
        }
        Ok(())
    }
}

/// Objects whose other copy lives at device addresses the store does not own (a `KvSpace`'s
/// tensors): the bytes move with backend copies, never through a CPU view of device memory.
impl TierStore {
    /// Stores one new block-sized object per address of `srcs`, copied from the device: into
    /// host memory (making room by moving host copies to disk), the rest to disk through
    /// staging. Every `srcs[k]..+block_size` must lie inside a reservation of `scope`, and the
    /// caller's writes to it must be complete. The returned event completes once every byte has
    /// left the device: only then may the caller unmap the sources. The objects never get an
    /// HBM copy here. All or nothing: on error no new object remains (out of host and disk
    /// space is [`Error::OutOfMemory`] or [`Error::LimitExceeded`]).
    pub fn put_from_device(
        &self,
        srcs: &[DevicePtr],
        durability: Durability,
        owner: u64,
        scope: &[&Reservation],
    ) -> Result<(Vec<ObjectId>, Arc<Event>)> {
        let mut st = self.state.lock();
        let block = self.config.block_size;
        let idx: Vec<u32> = srcs
            .iter()
            .map(|_| st.new_object(durability, owner, block))
            .collect();
        if let Err(e) = self.fill_from_device(&mut st, &idx, srcs, scope) {
            for &i in &idx {
                self.drop_object(&mut st, i);
            }
            return Err(e);
        }
        let ids = idx
            .iter()
            .map(|&index| ObjectId {
                index,
                generation: st.objs[index as usize].generation,
            })
            .collect();
        drop(st);
        let done = self.submit(Direction::DeviceToHost, &[], 0, Submission::Coalesced, &[])?;
        Ok((ids, done))
    }

    fn fill_from_device(
        &self,
        st: &mut State,
        idx: &[u32],
        srcs: &[DevicePtr],
        scope: &[&Reservation],
    ) -> Result<()> {
        let protect: HashSet<u32> = idx.iter().copied().collect();
        // Best effort: what does not fit in host memory goes to disk.
        let _ = self.make_room_host(st, idx.len(), &protect);
        let fit = st.host.free.len().min(idx.len());
        let (to_host, to_disk) = idx.split_at(fit);
        if !to_host.is_empty() {
            let mut pairs = Vec::with_capacity(to_host.len());
            let mut waited: HashSet<*const Event> = HashSet::new();
            for (&i, &src) in to_host.iter().zip(srcs) {
                let h = st.host.take(i).ok_or(Error::OutOfMemory {
                    location: Location::Host,
                    requested: self.config.block_size,
                    available: 0,
                })?;
                st.objs[i as usize].res.host = Some(h);
                if let Some(f) = st.host.fence[h as usize].clone() {
                    if waited.insert(Arc::as_ptr(&f)) {
                        self.engine.wait(Direction::DeviceToHost, &f)?;
                    }
                }
                pairs.push((src, self.host_ptr(h)));
            }
            let ev = self.submit(
                Direction::DeviceToHost,
                &pairs,
                self.config.block_size,
                self.config.submission,
                scope,
            )?;
            let step = st.step;
            for &i in to_host {
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                st.host.fence[h as usize] = Some(Arc::clone(&ev));
                st.objs[i as usize].host_ready = Some(Arc::clone(&ev));
                let (owner, key) = (st.objs[i as usize].owner, self.key(st, i));
                st.host_policy.touch(key, owner, step);
            }
        }
        for (&i, &src) in to_disk.iter().zip(&srcs[fit..]) {
            self.device_to_disk(st, i, src, None, scope)?;
        }
        Ok(())
    }

    /// Copies each object of `pairs` (from host memory, or from disk by the two-hop path) to its
    /// device address and releases it: its ids become stale, and its host and disk slots are
    /// reused only after the copies that read them (fences). Every destination must lie inside
    /// a reservation of `scope` and be mapped read-write. Returns the event to wait for before
    /// reading the destinations. An id that is stale, lost, given twice or has no host or disk
    /// copy changes nothing; a failed copy leaves every object live (some destinations may
    /// hold their bytes already).
    pub fn take_to_device(
        &self,
        pairs: &[(ObjectId, DevicePtr)],
        scope: &[&Reservation],
    ) -> Result<Arc<Event>> {
        self.restore_to_device(pairs, &vec![false; pairs.len()], scope)
    }

    /// As [`TierStore::take_to_device`], but the objects stay, marked redundant: the caller now
    /// holds their bytes at the destinations, so they are the first to go under pressure (see
    /// the module documentation). Before the caller's copy goes away it calls
    /// `set_redundant(ids, false)`, and only on `true` may it rely on them.
    pub fn copy_to_device(
        &self,
        pairs: &[(ObjectId, DevicePtr)],
        scope: &[&Reservation],
    ) -> Result<Arc<Event>> {
        self.restore_to_device(pairs, &vec![true; pairs.len()], scope)
    }

    /// Marks `ids` redundant (`true`: their owner holds the bytes too, so they go first under
    /// pressure) or the owner's only copy again (`false`: it is about to drop its own). Returns
    /// `false` and changes nothing when one of them was dropped already; a stale id is
    /// [`Error::StaleId`].
    pub fn set_redundant(&self, ids: &[ObjectId], redundant: bool) -> Result<bool> {
        let mut st = self.state.lock();
        let mut idx = Vec::with_capacity(ids.len());
        for &id in ids {
            match self.check(&st, id) {
                Ok(i) => idx.push(i),
                Err(Error::InvalidState(_)) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        for i in idx {
            st.objs[i].redundant = redundant;
        }
        Ok(true)
    }

    /// Both in one call, with one event: pair `k` is kept (as by
    /// [`TierStore::copy_to_device`]) when `keep[k]`, else released (as by
    /// [`TierStore::take_to_device`]). `keep` has one entry per pair.
    pub fn restore_to_device(
        &self,
        pairs: &[(ObjectId, DevicePtr)],
        keep: &[bool],
        scope: &[&Reservation],
    ) -> Result<Arc<Event>> {
        if keep.len() != pairs.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keep flags for {} objects",
                keep.len(),
                pairs.len()
            )));
        }
        let mut st = self.state.lock();
        let mut idx = Vec::with_capacity(pairs.len());
        let mut seen = HashSet::new();
        for &(id, _) in pairs {
            let i = self.check(&st, id)? as u32;
            if !seen.insert(i) {
                return Err(Error::InvalidArgument(format!(
                    "{id} is taken twice in one call"
                )));
            }
            let res = st.objs[i as usize].res;
            if res.host.is_none() && res.disk.is_none() {
                return Err(Error::InvalidState(format!(
                    "{id} has no host or disk copy to take"
                )));
            }
            idx.push(i);
        }
        type Moves = Vec<(u32, DevicePtr, bool)>;
        let (from_host, from_disk): (Moves, Moves) = idx
            .iter()
            .zip(pairs)
            .zip(keep)
            .map(|((&i, &(_, dst)), &k)| (i, dst, k))
            .partition(|&(i, _, _)| st.objs[i as usize].res.host.is_some());
        if !from_host.is_empty() {
            let mut copies = Vec::with_capacity(from_host.len());
            let mut waited: HashSet<*const Event> = HashSet::new();
            for &(i, dst, _) in &from_host {
                if let Some(ev) = st.objs[i as usize].host_ready.clone() {
                    if waited.insert(Arc::as_ptr(&ev)) {
                        self.engine.wait(Direction::HostToDevice, &ev)?;
                    }
                }
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                copies.push((self.host_ptr(h), dst));
            }
            let ev = self.submit(
                Direction::HostToDevice,
                &copies,
                self.config.block_size,
                self.config.submission,
                scope,
            )?;
            for &(i, _, _) in &from_host {
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                st.host.fence[h as usize] = Some(Arc::clone(&ev));
            }
        }
        if !from_disk.is_empty() {
            let objs: Vec<u32> = from_disk.iter().map(|m| m.0).collect();
            let dsts: Vec<DevicePtr> = from_disk.iter().map(|m| m.1).collect();
            let keeps: Vec<bool> = from_disk.iter().map(|m| m.2).collect();
            self.two_hop(
                &mut st,
                &objs,
                HopTarget::Outside {
                    dsts: &dsts,
                    scope,
                    keep: &keeps,
                },
            )?;
        }
        for (&i, &k) in idx.iter().zip(keep) {
            if k {
                st.objs[i as usize].redundant = true;
            } else {
                self.drop_object(&mut st, i);
            }
        }
        drop(st);
        self.submit(Direction::HostToDevice, &[], 0, Submission::Coalesced, &[])
    }
}

impl Drop for TierStore {
    fn drop(&mut self) {
        let _ = self.engine.synchronize();
        let pages: Vec<HbmPage> = self.state.get_mut().pages.drain(..).flatten().collect();
        let mut back = Vec::with_capacity(pages.len());
        for hp in pages {
            drop(hp.mapping);
            back.push(hp.page);
        }
        self.pool.give(back);
        let _ = self.page_size;
    }
}
