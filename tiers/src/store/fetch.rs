//! Bringing objects up: prefetch into HBM (host copies in one batch, disk copies by the
//! two-hop path disk → staging → device, pipelined over two staging halves), the first hop alone
//! ahead of need (disk → host memory), reads, and spills down. File reads and host waits happen outside the lock, on pinned objects.

use std::collections::HashSet;
use std::sync::Arc;

use strata_vmm::{DevicePtr, Error, Event, HostBuffer, Reservation, Result};

use super::io::{sync, Batch};
use super::slots::{SlotLease, SlotTier};
use super::state::Op;
use super::TierStore;
use crate::disk::{DiskFile, IoPool, Lane};
use crate::object::ObjectId;
use crate::policy::Tier;
use crate::transfer::Direction;

/// Where the two-hop disk path writes.
#[derive(Clone, Copy)]
pub(super) enum HopTarget<'a> {
    /// New HBM slots of the store.
    Hbm,
    /// Device addresses of another owner (`dsts[k]` for the k-th object), inside `scope`.
    /// An object whose `keep[k]` is set is read into a free host slot instead of staging and
    /// stays there as a second copy (TierKV keeps the DRAM copy of an SSD → DRAM → HBM move; the
    /// disk copy stays, so a later eviction of the host copy writes nothing).
    Outside {
        dsts: &'a [DevicePtr],
        scope: &'a [&'a Reservation],
        keep: &'a [bool],
    },
}

/// What one copy of a two-hop round stamps once queued: the object, its staging block (when
/// not read into a kept host slot), its new HBM slot and the host slot it keeps.
type Hop<'s> = (u32, usize, Option<SlotLease<'s>>, Option<SlotLease<'s>>);

impl TierStore {
    /// Makes objects resident in HBM asynchronously and returns the event to wait for (on the
    /// compute stream: `stream_wait_event`; on the CPU: `synchronize`). Host copies move in one
    /// coalesced batch (or one block-copy kernel launch); disk copies take the two-hop path
    /// disk → host staging → HBM, pipelined over the two staging halves. A full HBM tier whose
    /// objects are all in `ids` is [`Error::OutOfMemory`].
    pub fn prefetch(&self, ids: &[ObjectId]) -> Result<Arc<Event>> {
        let (mut op, idx) = self.begin(|st| ids.iter().map(|&id| st.check(id)).collect())?;
        let protect: HashSet<u32> = idx.iter().copied().collect();
        let mut missing: Vec<u32> = protect
            .iter()
            .copied()
            .filter(|&i| op.st.objs[i as usize].res.hbm.is_none())
            .collect();
        missing.sort_unstable();
        self.make_room_hbm(&mut op, missing.len(), &protect)?;
        op.st.check_not_dropped(&idx)?;
        let (from_host, from_disk): (Vec<u32>, Vec<u32>) = missing
            .iter()
            .partition(|&&i| op.st.objs[i as usize].res.host.is_some());
        if !from_host.is_empty() {
            let st = &mut *op.st;
            let mut batch = Batch::new(Direction::HostToDevice);
            for &i in &from_host {
                let lease = st
                    .lease(SlotTier::Hbm, i, &self.returns)
                    .ok_or_else(|| self.hbm_oom(1))?;
                batch.after(st.hbm.fence[lease.slot() as usize].as_ref());
                batch.after(st.objs[i as usize].host_ready.as_ref());
                let h = st.objs[i as usize].res.host.unwrap_or_default();
                batch.push(self.host_ptr(h), self.hbm_va(lease.slot()), (i, lease));
            }
            self.queue_batch(st, batch, &[], |st, (i, lease), ev| {
                let o = &mut st.objs[i as usize];
                o.res.hbm = Some(lease.keep());
                o.hbm_ready = Some(Arc::clone(ev));
                o.staged = false;
                let h = o.res.host.unwrap_or_default();
                st.host.fence[h as usize] = Some(Arc::clone(ev));
            })?;
        }
        if !from_disk.is_empty() {
            self.two_hop(&mut op, &from_disk, HopTarget::Hbm)?;
        }
        for &i in &idx {
            op.st.touch_hbm(i);
        }
        op.st.prefetched += missing.len() as u64;
        drop(op);
        self.all_queued(Direction::HostToDevice)
    }

    /// Disk → staging → `target` for pinned objects, pipelined over the two staging halves:
    /// one half fills from disk (parallel reads on the I/O pool, outside the lock) while the
    /// other drains to the device.
    pub(super) fn two_hop(
        &self,
        op: &mut Op<'_>,
        objs: &[u32],
        target: HopTarget<'_>,
    ) -> Result<()> {
        let (disk, io) = self.disk()?;
        let b = self.config.block_size;
        // A restore waits for these reads: no staging read starts until they are done.
        let _demand = io.demand();
        let mut staging = op.unlocked(|| self.staging_fences.lock());
        let half = staging.len() / 2;
        for (round, chunk) in objs.chunks(half).enumerate() {
            let base = (round % 2) * half;
            let keeps = |j: usize| match target {
                HopTarget::Outside { keep, .. } => keep[round * half + j],
                HopTarget::Hbm => false,
            };
            // Where each object is read to: a free host slot it keeps, or staging.
            let st = &mut *op.st;
            let mut reads = Vec::with_capacity(chunk.len());
            let mut kept = Vec::with_capacity(chunk.len());
            let mut kept_fences = Vec::new();
            for (j, &i) in chunk.iter().enumerate() {
                let d = st.objs[i as usize].res.disk.ok_or_else(|| {
                    Error::InvalidState(format!("object #{i} has no disk copy to read"))
                })?;
                let lease = if keeps(j) {
                    st.lease(SlotTier::Host, i, &self.returns)
                } else {
                    None
                };
                let (buf, off) = match &lease {
                    Some(h) => {
                        // A free slot's fence names the last copy that read it.
                        kept_fences.push(st.host.fence[h.slot() as usize].clone());
                        let (buf, off) = self.host_chunk(h.slot());
                        (Arc::clone(buf), off)
                    }
                    None => (Arc::clone(&self.staging), (base + j) as u64 * b),
                };
                reads.push((buf, off, self.disk_offset(d)));
                kept.push(lease);
            }
            // Hop 1, outside the lock: the half is free once its previous H2D drained; then
            // parallel reads (the other half's H2D is still running).
            op.unlocked(|| {
                for f in staging[base..base + half].iter().chain(&kept_fences) {
                    sync(f)?;
                }
                read_blocks(disk, io, Lane::Demand, b, reads)
            })?;
            // Hop 2: one H2D batch for the chunk.
            let st = &mut *op.st;
            let mut batch: Batch<Hop<'_>> = Batch::new(Direction::HostToDevice);
            for (j, (&i, kept)) in chunk.iter().zip(kept).enumerate() {
                let (dst, hbm) = match target {
                    HopTarget::Hbm => {
                        let lease = st
                            .lease(SlotTier::Hbm, i, &self.returns)
                            .ok_or_else(|| self.hbm_oom(1))?;
                        batch.after(st.hbm.fence[lease.slot() as usize].as_ref());
                        (self.hbm_va(lease.slot()), Some(lease))
                    }
                    HopTarget::Outside { dsts, .. } => (dsts[round * half + j], None),
                };
                let src = kept
                    .as_ref()
                    .map_or_else(|| self.staging_ptr(base + j), |h| self.host_ptr(h.slot()));
                batch.push(src, dst, (i, base + j, hbm, kept));
            }
            let outside = match target {
                HopTarget::Hbm => &[][..],
                HopTarget::Outside { scope, .. } => scope,
            };
            self.queue_batch(st, batch, outside, |st, (i, staged, hbm, kept), ev| {
                if let Some(lease) = hbm {
                    let o = &mut st.objs[i as usize];
                    o.res.hbm = Some(lease.keep());
                    o.hbm_ready = Some(Arc::clone(ev));
                }
                match kept {
                    Some(h) => st.add_host_copy(i, h.keep(), Some(ev), false),
                    None => staging[staged] = Some(Arc::clone(ev)),
                }
            })?;
        }
        Ok(())
    }

    /// Brings the disk copies of `ids` up into host memory: the first hop of the two-hop path,
    /// run ahead of the restore that needs them (TierKV §3.3's longer lookahead for disk). The
    /// disk copy stays, so the host copy can go again without a write.
    ///
    /// Staging never displaces anything: it takes only free host slots, and leaves `reserve` of
    /// them free (the room the owner's spills before that restore will need). Making room by
    /// moving another owner's copies down would cost that owner a disk read later (and a write,
    /// for a sole copy), so ahead-of-need reads would add traffic rather than hide it; what
    /// finds no room stays on disk only (advice, not an error), and is read on demand. A host
    /// copy staged here is evicted like any other host copy (by the host policy: an owner that
    /// runs sooner is never displaced for one that runs later); [`StoreStats::staged_evicted`]
    /// counts those dropped before anything read them.
    ///
    /// The file reads go to the I/O pool's background lane: no read of a restore waits behind
    /// them, and none of them starts while a restore's two-hop reads are under way. Ids that are
    /// stale, lost, already in host memory or HBM, or not on disk, are passed over. Returns the
    /// objects moved up (with room for only some, the first ones in `ids` order).
    ///
    /// [`StoreStats::staged_evicted`]: super::StoreStats::staged_evicted
    pub fn stage_to_host(&self, ids: &[ObjectId], reserve: usize) -> Result<usize> {
        if self.disk.is_none() {
            return Ok(0);
        }
        // Only the objects that find room are pinned (the rest stay free for a restore).
        let (mut op, idx) = self.begin(|st| {
            let mut seen = HashSet::new();
            Ok(ids
                .iter()
                .filter_map(|&id| st.check(id).ok())
                .filter(|&i| {
                    let r = st.objs[i as usize].res;
                    r.disk.is_some() && r.host.is_none() && r.hbm.is_none() && seen.insert(i)
                })
                .take(st.host.free_count().saturating_sub(reserve))
                .collect())
        })?;
        if idx.is_empty() {
            return Ok(0);
        }
        let (disk, io) = self.disk()?;
        let mut reads = Vec::with_capacity(idx.len());
        let mut fences = Vec::with_capacity(idx.len());
        let mut leases = Vec::with_capacity(idx.len());
        for &i in &idx {
            let st = &mut *op.st;
            let d = st.objs[i as usize].res.disk.unwrap_or_default();
            let Some(lease) = st.lease(SlotTier::Host, i, &self.returns) else {
                break;
            };
            // A free slot's fence names the last copy that read it.
            fences.push(st.host.fence[lease.slot() as usize].clone());
            let (buf, off) = self.host_chunk(lease.slot());
            reads.push((Arc::clone(buf), off, self.disk_offset(d)));
            leases.push((i, lease));
        }
        let b = self.config.block_size;
        op.unlocked(|| {
            for f in &fences {
                sync(f)?;
            }
            read_blocks(disk, io, Lane::Background, b, reads)
        })?;
        let moved = leases.len();
        for (i, lease) in leases {
            op.st.add_host_copy(i, lease.keep(), None, true);
        }
        op.st.staged += moved as u64;
        Ok(moved)
    }

    /// Reads an object (exactly its length) from its fastest copy, after the copy's last write.
    /// The copy is read outside the store's lock.
    pub fn read(&self, id: ObjectId, out: &mut [u8]) -> Result<Tier> {
        let (mut op, idx) = self.begin(|st| Ok(vec![st.check(id)?]))?;
        let i = idx[0];
        let o = op.st.objs[i as usize].clone();
        if out.len() as u64 != o.len {
            return Err(Error::InvalidArgument(format!(
                "{id} holds {} bytes, read buffer has {}",
                o.len,
                out.len()
            )));
        }
        if let Some(s) = o.res.hbm {
            let va = self.hbm_va(s);
            op.unlocked(|| {
                sync(&o.hbm_ready)?;
                self.backend.read(va, out)
            })?;
            op.st.touch_hbm(i);
            Ok(Tier::Hbm)
        } else if let Some(h) = o.res.host {
            let (buf, off) = self.host_chunk(h);
            op.unlocked(|| {
                sync(&o.host_ready)?;
                buf.read_at(off, out)
            })?;
            op.st.objs[i as usize].staged = false;
            op.st.touch_host(i);
            Ok(Tier::Host)
        } else if let Some(d) = o.res.disk {
            let (disk, _) = self.disk()?;
            let file_off = self.disk_offset(d);
            op.unlocked(|| {
                let staging = self.staging_fences.lock();
                sync(&staging[0])?;
                disk.read_into(&self.staging, 0, file_off, self.config.block_size)?;
                self.staging.read_at(0, out)
            })?;
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
        let (mut op, idx) = self.begin(|st| {
            let mut idx = ids
                .iter()
                .map(|&id| st.check(id))
                .collect::<Result<Vec<u32>>>()?;
            idx.sort_unstable();
            idx.dedup();
            Ok(idx)
        })?;
        let in_hbm: Vec<u32> = idx
            .iter()
            .copied()
            .filter(|&i| op.st.objs[i as usize].res.hbm.is_some())
            .collect();
        self.demote_hbm(&mut op, &in_hbm)?;
        if to == Tier::Disk {
            for &i in &idx {
                if op.st.objs[i as usize].res.host.is_some() {
                    self.demote_host(&mut op, i)?;
                }
            }
        }
        op.st.check_not_dropped(&idx)
    }
}

/// Reads `reads` (host buffer, offset in it, offset in the file) of `b` bytes each from the disk
/// file in parallel on the I/O pool's `lane`; every submitted read finishes before this
/// returns, so its buffer may be reused after an error too.
fn read_blocks(
    disk: &Arc<DiskFile>,
    io: &IoPool,
    lane: Lane,
    b: u64,
    reads: Vec<(Arc<HostBuffer>, u64, u64)>,
) -> Result<()> {
    let mut tickets = Vec::with_capacity(reads.len());
    let mut first_err = None;
    for (buf, off, file_off) in reads {
        let disk = Arc::clone(disk);
        match io.submit(lane, move || disk.read_into(&buf, off, file_off, b)) {
            Ok(t) => tickets.push(t),
            Err(e) => {
                first_err = Some(e);
                break;
            }
        }
    }
    for t in tickets {
        if let Err(e) = t.wait() {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}
