//! Objects whose other copy lives at device addresses the store does not own (a `KvSpace`'s
//! tensors): the bytes move with backend copies, never through a CPU view of device memory.

use std::collections::HashSet;
use std::sync::Arc;

use strata_vmm::{DevicePtr, Error, Event, Location, Reservation, Result};

use super::fetch::HopTarget;
use super::io::Batch;
use super::slots::SlotTier;
use super::state::Op;
use super::TierStore;
use crate::object::{Durability, ObjectId};
use crate::transfer::Direction;

impl TierStore {
    /// Stores one new block-sized object per address of `srcs`, copied from the device: into
    /// host memory (making room by moving host copies to disk), the rest to disk through
    /// staging. Every `srcs[k]..+block_size` must lie inside a reservation of `scope`, and the
    /// caller's writes to it must be complete. The returned event completes once every byte has
    /// left the device: only then may the caller unmap the sources. The objects never get an
    /// HBM copy here. All or nothing: on error no new object remains (out of host and disk
    /// space is [`Error::OutOfMemory`] or [`Error::OutOfTierSpace`]).
    pub fn put_from_device(
        &self,
        srcs: &[DevicePtr],
        durability: Durability,
        owner: u64,
        scope: &[&Reservation],
    ) -> Result<(Vec<ObjectId>, Arc<Event>)> {
        let mut op = self.op();
        let block = self.config.block_size;
        let idx: Vec<u32> = srcs
            .iter()
            .map(|_| op.st.new_object(durability, owner, block))
            .collect();
        op.pin(&idx);
        if let Err(e) = self.fill_from_device(&mut op, &idx, srcs, scope) {
            for &i in &idx {
                op.st.drop_object(i);
            }
            return Err(e);
        }
        let ids = idx.iter().map(|&index| op.st.id(index)).collect();
        drop(op);
        let done = self.all_queued(Direction::DeviceToHost)?;
        Ok((ids, done))
    }

    fn fill_from_device(
        &self,
        op: &mut Op<'_>,
        idx: &[u32],
        srcs: &[DevicePtr],
        scope: &[&Reservation],
    ) -> Result<()> {
        let protect: HashSet<u32> = idx.iter().copied().collect();
        // Best effort: what does not fit in host memory goes to disk, and so does what would
        // displace a block whose owner runs sooner (TierKV §3.4).
        let owner = idx.first().map(|&i| op.st.objs[i as usize].owner);
        let after = owner.map_or(0, |o| op.st.host_policy.distance(o));
        let _ = self.make_room_host(op, idx.len(), &protect, after);
        let fit = op.st.host.free_count().min(idx.len());
        let (to_host, to_disk) = idx.split_at(fit);
        if !to_host.is_empty() {
            let st = &mut *op.st;
            let mut batch = Batch::new(Direction::DeviceToHost);
            for (&i, &src) in to_host.iter().zip(srcs) {
                let lease =
                    st.lease(SlotTier::Host, i, &self.returns)
                        .ok_or(Error::OutOfMemory {
                            location: Location::Host,
                            requested: self.config.block_size,
                            available: 0,
                        })?;
                batch.after(st.host.fence[lease.slot() as usize].as_ref());
                batch.push(src, self.host_ptr(lease.slot()), (i, lease));
            }
            self.queue_batch(st, batch, scope, |st, (i, lease), ev| {
                let h = lease.keep();
                st.host.fence[h as usize] = Some(Arc::clone(ev));
                let o = &mut st.objs[i as usize];
                o.res.host = Some(h);
                o.host_ready = Some(Arc::clone(ev));
                st.touch_host(i);
            })?;
        }
        for (&i, &src) in to_disk.iter().zip(&srcs[fit..]) {
            self.device_to_disk(op, i, src, None, scope)?;
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
        let begun = self.begin(|st| ids.iter().map(|&id| st.check(id)).collect());
        let (mut op, idx) = match begun {
            Ok(begun) => begun,
            Err(Error::InvalidState(_)) => return Ok(false),
            Err(e) => return Err(e),
        };
        for i in idx {
            op.st.objs[i as usize].redundant = redundant;
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
        let (mut op, idx) = self.begin(|st| {
            let mut idx = Vec::with_capacity(pairs.len());
            let mut seen = HashSet::new();
            for &(id, _) in pairs {
                let i = st.check(id)?;
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
            Ok(idx)
        })?;
        type Moves = Vec<(u32, DevicePtr, bool)>;
        let (from_host, from_disk): (Moves, Moves) = idx
            .iter()
            .zip(pairs)
            .zip(keep)
            .map(|((&i, &(_, dst)), &k)| (i, dst, k))
            .partition(|&(i, _, _)| op.st.objs[i as usize].res.host.is_some());
        if !from_host.is_empty() {
            let st = &mut *op.st;
            let mut batch = Batch::new(Direction::HostToDevice);
            for &(i, dst, _) in &from_host {
                st.objs[i as usize].staged = false;
                let o = &st.objs[i as usize];
                batch.after(o.host_ready.as_ref());
                let h = o.res.host.unwrap_or_default();
                batch.push(self.host_ptr(h), dst, h);
            }
            self.queue_batch(st, batch, scope, |st, h, ev| {
                st.host.fence[h as usize] = Some(Arc::clone(ev));
            })?;
        }
        if !from_disk.is_empty() {
            let objs: Vec<u32> = from_disk.iter().map(|m| m.0).collect();
            let dsts: Vec<DevicePtr> = from_disk.iter().map(|m| m.1).collect();
            let keeps: Vec<bool> = from_disk.iter().map(|m| m.2).collect();
            self.two_hop(
                &mut op,
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
                op.st.objs[i as usize].redundant = true;
            } else {
                op.st.drop_object(i);
            }
        }
        drop(op);
        self.all_queued(Direction::HostToDevice)
    }
}
