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
//! keeps that slot (TierKV keeps the DRAM copy of an SSD → DRAM → HBM move) and its disk copy:
//! both hold the same bytes, so when the host copy goes again nothing is written.
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
//! never by luck.
//!
//! # Locking
//!
//! All bookkeeping sits behind one lock, held only for bookkeeping and for queueing copies.
//! An operation pins the objects it works on; file I/O, synchronous device reads and writes,
//! and host waits happen outside the lock on pinned objects, with the slots they fill held by
//! leases. Other operations wait for pinned objects and never pick them as victims, so a held
//! disk read of one object does not stop a read of another. A revocation retires its slots
//! under the lock (no new copy starts on them), waits for the operations on their objects,
//! and drains their copies with those objects pinned. The staging buffer of the disk paths has
//! a lock of its own, taken only while the state lock is not held.
//!
//! # Layout
//!
//! `slots.rs` (slot tables, leases), `state.rs` (what the lock guards, operations and pins),
//! `io.rs` (addresses, submission, batches), `demote.rs` (making room), `fetch.rs` (prefetch,
//! the two-hop path and its first hop ahead of need, reads, spills), `device.rs` (objects to and from device addresses the
//! store does not own), `revoke.rs`, `invariants.rs`.

mod demote;
mod device;
mod fetch;
mod invariants;
mod io;
mod revoke;
mod slots;
mod state;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};
use strata_allocator::{unmap_pages, MappedPage, MappedRun, Page, PagePool};
use strata_vmm::{
    Access, Backend, DevicePtr, Error, Event, HostBuffer, Location, Reservation, Result,
    MAX_HOST_CHUNK,
};

use crate::disk::{DiskFile, IoPool};
use crate::object::{Durability, ObjectId, Residency};
use crate::policy::PolicyKind;
use crate::transfer::{Submission, TransferEngine, TransferStats};
use io::sync;
use slots::{Returns, SlotTier, Slots};
use state::{stale, Op, State};

/// Blocks of `block` bytes in a `tier` of `bytes`: slot numbers are `u32`, so a tier of more
/// blocks is [`Error::InvalidArgument`] (never a count that wraps).
fn block_count(tier: &str, bytes: u64, block: u64) -> Result<u32> {
    u32::try_from(bytes / block).map_err(|_| {
        Error::InvalidArgument(format!(
            "a {tier} tier of {bytes} bytes is more than {} blocks of {block} bytes",
            u32::MAX
        ))
    })
}

/// A disk tier of `capacity` bytes must fit in what `dir`'s filesystem has available now
/// ([`Error::OutOfTierSpace`] otherwise), as host memory is allocated at creation: a spill
/// then finds the room the tier promised, short of other writers filling the disk meanwhile.
fn check_disk_room(dir: &std::path::Path, capacity: u64) -> Result<()> {
    let fs = rustix::fs::statvfs(dir).map_err(|e| Error::Os {
        call: "statvfs(disk tier directory)",
        source: e.into(),
    })?;
    let available = fs.f_bavail.saturating_mul(fs.f_frsize);
    if capacity > available {
        return Err(Error::OutOfTierSpace {
            tier: "disk",
            requested: capacity,
            available,
        });
    }
    Ok(())
}

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
    /// Objects moved up from disk to host memory ahead of need ([`TierStore::stage_to_host`]).
    pub staged: u64,
    /// Of those, objects whose host copy was dropped again before a restore or read used it.
    pub staged_evicted: u64,
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
    /// The pages, unmapped, for the lender. A page whose unmap failed is not here: it was
    /// released (it may still be mapped) and the error recorded for the next fallible call.
    pub pages: Vec<Page>,
    pub fell_back: Vec<ObjectId>,
    pub lost: Vec<ObjectId>,
}

type Callback = Box<dyn Fn(crate::object::Notice) + Send + Sync>;

/// Objects of one fixed size across HBM, host memory and disk. See the module documentation.
pub struct TierStore {
    config: StoreConfig,
    backend: Arc<dyn Backend>,
    pool: Arc<PagePool>,
    reservation: Arc<Reservation>,
    slots_per_page: u32,
    host_chunks: Vec<Arc<HostBuffer>>,
    blocks_per_chunk: u64,
    staging: Arc<HostBuffer>,
    /// Per staging block, the last copy that read or wrote it. Taken only without the state
    /// lock (an operation holding it may take the state lock, never the reverse).
    staging_fences: Mutex<Vec<Option<Arc<Event>>>>,
    disk: Option<Arc<DiskFile>>,
    io: Option<IoPool>,
    engine: TransferEngine,
    state: Mutex<State>,
    /// Slots of dropped leases, put back under the state lock.
    returns: Returns,
    /// Signalled when an operation unpins objects.
    idle: Condvar,
    next_op: AtomicU64,
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
        let host_blocks = block_count("host", config.host.capacity, b)?;
        let disk_blocks = match &config.disk {
            Some(d) => block_count("disk", d.spec.capacity, b)?,
            None => 0,
        };
        let hbm_slots = block_count("hbm", n_pages * page_size, b)?;
        if let Some(d) = &config.disk {
            check_disk_room(&d.dir, d.spec.capacity)?;
        }
        let reservation = Arc::new(Reservation::new(&backend, (n_pages.max(1)) * page_size, 0)?);
        // Until the state owns them page by page, an error returns every page to the pool.
        let hbm = MappedRun::take(
            &pool,
            &reservation,
            reservation.ptr(),
            n_pages as usize,
            &[(Location::Device(config.device), Access::ReadWrite)],
        )?;
        let blocks_per_chunk = (MAX_HOST_CHUNK / b).max(1);
        let mut host_chunks = Vec::new();
        let mut left = u64::from(host_blocks);
        while left > 0 {
            let n = left.min(blocks_per_chunk);
            host_chunks.push(Arc::new(HostBuffer::new(&backend, n * b)?));
            left -= n;
        }
        let staging_blocks = config.staging_blocks.max(2) & !1;
        let staging = Arc::new(HostBuffer::new(&backend, u64::from(staging_blocks) * b)?);
        let (disk, io) = match &config.disk {
            Some(d) => (
                Some(Arc::new(DiskFile::create(&d.dir, d.direct)?)),
                Some(IoPool::new(d.io_threads)?),
            ),
            None => (None, None),
        };
        let engine = TransferEngine::new(&backend, config.device)?;
        let state = State {
            objs: Vec::new(),
            free_objs: Vec::new(),
            hbm: Slots::covered(hbm_slots),
            host: Slots::new(host_blocks),
            disk: Slots::new(disk_blocks),
            pages: hbm.into_mapped_pages().into_iter().map(Some).collect(),
            hbm_policy: config.hbm_policy.build(),
            host_policy: config.host_policy.build(),
            step: 0,
            evictions_hbm: 0,
            evictions_host: 0,
            prefetched: 0,
            staged: 0,
            staged_evicted: 0,
            fell_back: 0,
            lost: 0,
            redundant_dropped: 0,
            pages_revoked: 0,
            ops_in_flight: 0,
        };
        Ok(TierStore {
            backend,
            pool,
            reservation,
            slots_per_page,
            host_chunks,
            blocks_per_chunk,
            staging,
            staging_fences: Mutex::new(vec![None; staging_blocks as usize]),
            disk,
            io,
            engine,
            state: Mutex::new(state),
            returns: Returns::default(),
            idle: Condvar::new(),
            next_op: AtomicU64::new(0),
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

    /// The disk tier's file, if the store has one.
    pub fn disk_file(&self) -> Option<&Arc<DiskFile>> {
        self.disk.as_ref()
    }

    /// The disk tier's I/O threads, if the store has a disk tier.
    pub fn io_pool(&self) -> Option<&IoPool> {
        self.io.as_ref()
    }

    pub fn block_size(&self) -> u64 {
        self.config.block_size
    }

    /// HBM pages the store holds (revoked ones included as `None` positions).
    pub fn page_count(&self) -> usize {
        self.lock().pages.len()
    }

    /// Sets the owner's callback: revocation notices ([`Notice`](crate::Notice)), run after residency is
    /// invalidated and before the pages return, outside the store's lock.
    pub fn set_callback(&self, f: impl Fn(crate::object::Notice) + Send + Sync + 'static) {
        *self.callback.lock() = Some(Arc::new(Box::new(f)));
    }

    /// The state, with the slots of dropped leases back on their free lists.
    fn lock(&self) -> MutexGuard<'_, State> {
        let mut st = self.state.lock();
        st.settle(&self.returns);
        st
    }

    fn op(&self) -> Op<'_> {
        let token = self.next_op.fetch_add(1, Ordering::Relaxed);
        Op::new(self.lock(), token, &self.idle, &self.returns)
    }

    /// An operation on the objects `resolve` names (its error ends the call), pinned once no
    /// other operation pins any of them.
    fn begin(&self, resolve: impl Fn(&State) -> Result<Vec<u32>>) -> Result<(Op<'_>, Vec<u32>)> {
        let mut op = self.op();
        loop {
            let idx = resolve(&op.st)?;
            if idx
                .iter()
                .all(|&i| op.st.objs[i as usize].pinned_by.is_none())
            {
                op.pin(&idx);
                return Ok((op, idx));
            }
            op.wait();
        }
    }

    /// Where an object's copies are.
    pub fn residency(&self, id: ObjectId) -> Result<Residency> {
        let st = self.lock();
        let i = st.check(id)?;
        Ok(st.objs[i as usize].res)
    }

    /// The HBM address of a resident object (for kernels; valid until it is evicted, revoked or
    /// released), and the event to wait for before reading it.
    pub fn hbm_ptr(&self, id: ObjectId) -> Result<(DevicePtr, Option<Arc<Event>>)> {
        let (op, idx) = self.begin(|st| Ok(vec![st.check(id)?]))?;
        let o = &op.st.objs[idx[0] as usize];
        match o.res.hbm {
            Some(s) => Ok((self.hbm_va(s), o.hbm_ready.clone())),
            None => Err(Error::InvalidState(format!("{id} is not resident in HBM"))),
        }
    }

    /// Moves the policies' clock to `step`.
    pub fn advance(&self, step: u64) {
        let mut st = self.lock();
        st.step = step;
        st.hbm_policy.advance(step);
        st.host_policy.advance(step);
    }

    /// Scheduler lookahead for the policies: owners that run in each of the next K steps.
    pub fn schedule(&self, next_steps: &[Vec<u64>]) {
        let mut st = self.lock();
        st.hbm_policy.schedule(next_steps);
        st.host_policy.schedule(next_steps);
    }

    /// The scheduler's queue for the policies: owners that run after the scheduled window, in
    /// the order they will run.
    pub fn queue(&self, waiting: &[u64]) {
        let mut st = self.lock();
        st.hbm_policy.queue(waiting);
        st.host_policy.queue(waiting);
    }

    fn check_len(&self, data: &[u8]) -> Result<u64> {
        let len = data.len() as u64;
        if len == 0 || len > self.config.block_size {
            return Err(Error::InvalidArgument(format!(
                "object of {len} bytes in a store of {}-byte blocks",
                self.config.block_size
            )));
        }
        Ok(len)
    }

    /// Stores a new object of `data.len() <= block_size` bytes in HBM (evicting as needed);
    /// `Backed` objects also get their authoritative copy in host memory (or on disk).
    pub fn put(&self, data: &[u8], durability: Durability, owner: u64) -> Result<ObjectId> {
        let len = self.check_len(data)?;
        let mut op = self.op();
        let index = op.st.new_object(durability, owner, len);
        op.pin(&[index]);
        let id = op.st.id(index);
        match self.store_contents(&mut op, index, data) {
            Ok(()) => Ok(id),
            Err(e) => {
                op.st.drop_object(index);
                Err(e)
            }
        }
    }

    /// Replaces an object's contents (lower copies are rewritten for `Backed`, dropped for
    /// `Lossy`).
    pub fn write(&self, id: ObjectId, data: &[u8]) -> Result<()> {
        let len = self.check_len(data)?;
        let (mut op, idx) = self.begin(|st| Ok(vec![st.check(id)?]))?;
        op.st.objs[idx[0] as usize].len = len;
        self.store_contents(&mut op, idx[0], data)
    }

    /// Writes `data` into the pinned object's HBM copy (taking a slot if needed), then replaces
    /// the lower copies: rewritten for `Backed` (new copy first, old one dropped after), dropped
    /// for `Lossy`. On failure the object keeps its previous contents and copies. The bytes are
    /// written outside the lock.
    fn store_contents(&self, op: &mut Op<'_>, index: u32, data: &[u8]) -> Result<()> {
        let protect: HashSet<u32> = [index].into();
        let had_hbm = op.st.objs[index as usize].res.hbm;
        let (slot, lease, ready) = match had_hbm {
            Some(s) => (s, None, op.st.objs[index as usize].hbm_ready.clone()),
            None => {
                self.make_room_hbm(op, 1, &protect)?;
                let lease = op
                    .st
                    .lease(SlotTier::Hbm, index, &self.returns)
                    .ok_or_else(|| self.hbm_oom(1))?;
                (lease.slot(), Some(lease), None)
            }
        };
        let fence = op.st.hbm.fence[slot as usize].clone();
        let va = self.hbm_va(slot);
        op.unlocked(|| {
            sync(&ready)?;
            sync(&fence)?;
            self.backend.write(va, data)
        })?;
        let st = &mut *op.st;
        if let Some(lease) = lease {
            st.objs[index as usize].res.hbm = Some(lease.keep());
        }
        st.objs[index as usize].hbm_ready = None;
        st.touch_hbm(index);
        st.objs[index as usize].staged = false;
        if st.objs[index as usize].durability == Durability::Lossy {
            st.drop_lower(index);
            return Ok(());
        }
        match self.back_up(op, index, data) {
            Ok(fresh) => {
                let st = &mut *op.st;
                st.drop_lower(index);
                let o = &mut st.objs[index as usize];
                o.res.host = fresh.host;
                o.res.disk = fresh.disk;
                if fresh.host.is_some() {
                    st.touch_host(index);
                }
                Ok(())
            }
            Err(e) => {
                // The HBM copy holds the new bytes but no authoritative copy does: drop it,
                // so the object keeps its previous contents (put removes a new object).
                op.st.drop_hbm_with_fence(index, None);
                Err(e)
            }
        }
    }

    /// Writes a fresh authoritative copy of a pinned `Backed` object in new slots: host memory
    /// if it has (or can make) room, else disk. The caller swaps it in for the old copies.
    fn back_up(&self, op: &mut Op<'_>, index: u32, data: &[u8]) -> Result<Residency> {
        let protect: HashSet<u32> = [index].into();
        if self.make_room_host(op, 1, &protect, 0).is_ok() {
            if let Some(lease) = op.st.lease(SlotTier::Host, index, &self.returns) {
                let fence = op.st.host.fence[lease.slot() as usize].clone();
                let (buf, off) = self.host_chunk(lease.slot());
                op.unlocked(|| {
                    sync(&fence)?;
                    buf.write_at(off, data)
                })?;
                return Ok(Residency {
                    host: Some(lease.keep()),
                    ..Residency::default()
                });
            }
        }
        let disk = self.overflow_disk()?;
        let lease = self.take_disk(op, index)?;
        let file_off = self.disk_offset(lease.slot());
        op.unlocked(|| {
            let staging = self.staging_fences.lock();
            sync(&staging[0])?;
            self.staging.write_at(0, data)?;
            disk.write_from(&self.staging, 0, file_off, self.config.block_size)
        })?;
        Ok(Residency {
            disk: Some(lease.keep()),
            ..Residency::default()
        })
    }

    /// Releases an object (stale or unknown ids are [`Error::StaleId`]; lost objects release).
    pub fn release(&self, id: ObjectId) -> Result<()> {
        let (mut op, idx) = self.begin(|st| match st.objs.get(id.index as usize) {
            Some(o) if o.live && o.generation == id.generation => Ok(vec![id.index]),
            _ => Err(stale(id)),
        })?;
        op.st.drop_object(idx[0]);
        Ok(())
    }

    /// Waits for every queued copy; reports asynchronous copy failures.
    pub fn synchronize(&self) -> Result<()> {
        self.engine.synchronize()
    }

    pub fn stats(&self) -> StoreStats {
        let st = self.lock();
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
            staged: st.staged,
            staged_evicted: st.staged_evicted,
            fell_back: st.fell_back,
            lost: st.lost,
            redundant_dropped: st.redundant_dropped,
            pages_revoked: st.pages_revoked,
            disk_direct: self.disk.as_ref().is_some_and(|d| d.is_direct()),
        }
    }
}

/// Unmaps `pages` and returns those whose unmap succeeded (still counted in use by `pool`).
/// A page whose unmap failed may still be mapped, so [`unmap_pages`] quarantines it (never
/// reused, never released, its mapping and so the store's address range kept), and the first
/// error is recorded for the next fallible call.
fn unmap_or_record(pool: &PagePool, pages: Vec<MappedPage>) -> Vec<Page> {
    let mut unmapped = Vec::with_capacity(pages.len());
    if let Err(stuck) = unmap_pages(pool, pages, &mut unmapped) {
        strata_vmm::record_deferred(stuck.first);
    }
    unmapped
}

impl Drop for TierStore {
    fn drop(&mut self) {
        let pages: Vec<MappedPage> = self.state.get_mut().pages.drain(..).flatten().collect();
        if strata_vmm::process_is_exiting() {
            // No driver calls once exit began: the mappings leak.
            std::mem::forget(pages);
            return;
        }
        if let Err(e) = self.engine.synchronize() {
            strata_vmm::record_deferred(e);
        }
        self.pool.give(unmap_or_record(&self.pool, pages));
    }
}
