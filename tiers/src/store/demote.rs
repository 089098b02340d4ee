//! Making room: HBM copies move down to host memory (one coalesced batch) or disk (through
//! staging), host copies move to disk, redundant objects are dropped first. Victims are pinned
//! while their copies move; file writes and host waits happen outside the lock.

use std::collections::HashSet;
use std::sync::Arc;

use strata_vmm::{DevicePtr, Error, Event, Location, Reservation, Result};

use super::io::{sync, Batch};
use super::slots::{SlotLease, SlotTier};
use super::state::{Obj, Op};
use super::TierStore;
use crate::object::{Durability, ObjectId, Residency};
use crate::transfer::{Direction, Submission};

pub(super) type SlotOf = fn(&Residency) -> Option<u32>;

impl TierStore {
    /// Ensures `n` free HBM slots, evicting unprotected objects by the HBM policy.
    pub(super) fn make_room_hbm(
        &self,
        op: &mut Op<'_>,
        n: usize,
        protect: &HashSet<u32>,
    ) -> Result<()> {
        op.settle();
        if op.st.hbm.free_count() >= n {
            return Ok(());
        }
        let me = op.token();
        let st = &mut *op.st;
        let mut victims = Vec::new();
        let need = n - st.hbm.free_count();
        let mut chosen: HashSet<u32> = HashSet::new();
        while victims.len() < need {
            let objs = &st.objs;
            let v = st.hbm_policy.victim(&mut |k| {
                let id = ObjectId::from_key(k);
                let i = id.index;
                !protect.contains(&i)
                    && !chosen.contains(&i)
                    && objs.get(i as usize).is_some_and(|o| {
                        o.live
                            && o.generation == id.generation
                            && o.res.hbm.is_some()
                            && o.free_for(me)
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
        self.demote_hbm(op, &victims)?;
        op.settle();
        if op.st.hbm.free_count() >= n {
            Ok(())
        } else {
            Err(self.hbm_oom(n as u64))
        }
    }

    /// Moves HBM copies down: objects with a lower copy just drop theirs; the others go to host
    /// memory in one coalesced batch (or, when the host tier is full, to disk through staging).
    pub(super) fn demote_hbm(&self, op: &mut Op<'_>, victims: &[u32]) -> Result<()> {
        let pinned = op.pin(victims);
        let r = self.demote_pinned(op, victims);
        op.unpin(&pinned);
        r
    }

    fn demote_pinned(&self, op: &mut Op<'_>, victims: &[u32]) -> Result<()> {
        let mut to_host = Vec::new();
        for &i in victims {
            let o = &op.st.objs[i as usize];
            if o.res.host.is_some() || o.res.disk.is_some() {
                op.st.drop_hbm(i);
                op.st.evictions_hbm += 1;
            } else {
                to_host.push(i);
            }
        }
        let mut to_disk = Vec::new();
        if !to_host.is_empty() {
            let protect: HashSet<u32> = victims.iter().copied().collect();
            let _ = self.make_room_host(op, to_host.len(), &protect, 0);
            let fit = op.st.host.free_count().min(to_host.len());
            to_disk = to_host.split_off(fit);
        }
        if !to_host.is_empty() {
            let st = &mut *op.st;
            let mut batch = Batch::new(Direction::DeviceToHost);
            for &i in &to_host {
                let lease = st
                    .lease(SlotTier::Host, i, &self.returns)
                    .ok_or_else(|| self.hbm_oom(1))?;
                batch.after(st.host.fence[lease.slot() as usize].as_ref());
                let o = &st.objs[i as usize];
                batch.after(o.hbm_ready.as_ref());
                let src = self.hbm_va(o.res.hbm.unwrap_or_default());
                batch.push(src, self.host_ptr(lease.slot()), (i, lease));
            }
            self.queue_batch(st, batch, &[], |st, (i, lease), ev| {
                let h = lease.keep();
                st.objs[i as usize].res.host = Some(h);
                st.objs[i as usize].host_ready = Some(Arc::clone(ev));
                st.host.fence[h as usize] = Some(Arc::clone(ev));
                st.touch_host(i);
                st.drop_hbm_with_fence(i, Some(Arc::clone(ev)));
                st.evictions_hbm += 1;
            })?;
        }
        for &i in &to_disk {
            let o = &op.st.objs[i as usize];
            let src = self.hbm_va(o.res.hbm.unwrap_or_default());
            let after = o.hbm_ready.clone();
            self.device_to_disk(op, i, src, after.as_ref(), &[])?;
            op.st.drop_hbm(i);
            op.st.evictions_hbm += 1;
        }
        Ok(())
    }

    /// Writes the block at device address `src` (after `after`) to a new disk copy of the
    /// pinned object `i`, through staging: one device→host copy, waited for, then one file
    /// write, both outside the lock.
    pub(super) fn device_to_disk(
        &self,
        op: &mut Op<'_>,
        i: u32,
        src: DevicePtr,
        after: Option<&Arc<Event>>,
        outside: &[&Reservation],
    ) -> Result<()> {
        let disk = self.overflow_disk()?;
        let lease = self.take_disk(op, i)?;
        let file_off = self.disk_offset(lease.slot());
        let b = self.config.block_size;
        op.unlocked(|| {
            let staging = self.staging_fences.lock();
            sync(&staging[0])?;
            if let Some(ev) = after {
                self.engine.wait(Direction::DeviceToHost, ev)?;
            }
            let ev = self.submit(
                Direction::DeviceToHost,
                &[(src, self.staging_ptr(0))],
                b,
                Submission::Coalesced,
                outside,
            )?;
            ev.synchronize()?;
            disk.write_from(&self.staging, 0, file_off, b)
        })?;
        op.st.objs[i as usize].res.disk = Some(lease.keep());
        Ok(())
    }

    /// A free disk slot for object `index`. When the tier is full, a redundant object gives its
    /// slot first, then the disk copy of an object that has the same bytes in host memory too
    /// (the one whose owner runs soonest by the host policy: its host copy is the last to go).
    pub(super) fn take_disk<'s>(&'s self, op: &mut Op<'_>, index: u32) -> Result<SlotLease<'s>> {
        if self.config.disk.is_none() {
            return Err(Error::InvalidState("the store has no disk tier".into()));
        }
        op.settle();
        if op.st.disk.free_count() == 0
            && !self.drop_redundant(op, SlotTier::Disk, &HashSet::from([index]))
        {
            let me = op.token();
            let st = &mut *op.st;
            let duplicate = (0..st.objs.len() as u32)
                .filter(|&i| {
                    let o = &st.objs[i as usize];
                    i != index
                        && o.live
                        && o.free_for(me)
                        && o.res.host.is_some()
                        && o.res.disk.is_some()
                })
                .min_by_key(|&i| st.host_policy.distance(st.objs[i as usize].owner));
            if let Some(d) = duplicate.and_then(|i| st.objs[i as usize].res.disk.take()) {
                st.disk.put_back(d, None);
            }
        }
        let st = &mut *op.st;
        st.lease(SlotTier::Disk, index, &self.returns)
            .ok_or(Error::OutOfTierSpace {
                tier: "disk",
                requested: self.config.block_size,
                available: 0,
            })
    }

    /// Frees the `tier` slot of one unprotected redundant object that holds one (the
    /// host policy's victim first): only that copy when it has another one in host memory or on
    /// disk (it stays a redundant copy there), else the whole object, which becomes lost. False
    /// when there is none.
    pub(super) fn drop_redundant(
        &self,
        op: &mut Op<'_>,
        tier: SlotTier,
        protect: &HashSet<u32>,
    ) -> bool {
        let slot_of: SlotOf = match tier {
            SlotTier::Hbm => |r| r.hbm,
            SlotTier::Host => |r| r.host,
            SlotTier::Disk => |r| r.disk,
        };
        let me = op.token();
        let st = &mut *op.st;
        let droppable = |i: u32, o: &Obj| {
            o.live
                && o.redundant
                && o.free_for(me)
                && !protect.contains(&i)
                && slot_of(&o.res).is_some()
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
        let res = st.objs[i as usize].res;
        if tier != SlotTier::Hbm && res.host.is_some() && res.disk.is_some() {
            if tier == SlotTier::Host {
                st.drop_host(i);
            } else if let Some(d) = st.objs[i as usize].res.disk.take() {
                st.disk.put_back(d, None);
            }
            return true;
        }
        st.drop_lower(i);
        st.drop_hbm(i);
        let o = &mut st.objs[i as usize];
        o.lost = true;
        o.redundant = false;
        st.redundant_dropped += 1;
        true
    }

    /// Ensures `n` free host slots: drops unprotected redundant objects first, then moves
    /// host copies to disk (or drops copies that are not the last one), only those whose owner
    /// runs no sooner than `after` steps from now by the host policy (0: any).
    pub(super) fn make_room_host(
        &self,
        op: &mut Op<'_>,
        n: usize,
        protect: &HashSet<u32>,
        after: usize,
    ) -> Result<()> {
        let mut tried: HashSet<u32> = HashSet::new();
        loop {
            op.settle();
            if op.st.host.free_count() >= n {
                return Ok(());
            }
            if self.drop_redundant(op, SlotTier::Host, protect) {
                continue;
            }
            let me = op.token();
            let st = &mut *op.st;
            let has_disk = self.disk.is_some() && st.disk.free_count() > 0;
            let objs = &st.objs;
            let v = st.host_policy.victim_running_after(after, &mut |k| {
                let id = ObjectId::from_key(k);
                let i = id.index;
                !protect.contains(&i)
                    && !tried.contains(&i)
                    && objs.get(i as usize).is_some_and(|o| {
                        o.live
                            && o.generation == id.generation
                            && o.free_for(me)
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
                    available: st.host.free_count() as u64 * self.config.block_size,
                });
            };
            let i = ObjectId::from_key(k).index;
            tried.insert(i);
            let pinned = op.pin(&[i]);
            let r = self.demote_host(op, i);
            op.unpin(&pinned);
            r?;
            op.st.evictions_host += 1;
        }
    }

    /// Frees the host copy of the pinned object `i`, writing it to disk first (outside the
    /// lock) when it is the last copy.
    pub(super) fn demote_host(&self, op: &mut Op<'_>, i: u32) -> Result<()> {
        let o = &op.st.objs[i as usize];
        let keep_elsewhere =
            o.res.disk.is_some() || (o.durability == Durability::Lossy && o.res.hbm.is_some());
        if !keep_elsewhere {
            let (disk, _) = self.disk()?;
            let lease = self.take_disk(op, i)?;
            let o = &op.st.objs[i as usize];
            let ready = o.host_ready.clone();
            let (buf, off) = self.host_chunk(o.res.host.unwrap_or_default());
            let file_off = self.disk_offset(lease.slot());
            op.unlocked(|| {
                sync(&ready)?;
                disk.write_from(buf, off, file_off, self.config.block_size)
            })?;
            op.st.objs[i as usize].res.disk = Some(lease.keep());
        }
        op.st.drop_host(i);
        Ok(())
    }
}
