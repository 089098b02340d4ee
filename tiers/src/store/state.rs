//! What sits behind the store's lock: objects, the three slot tables, the HBM pages, the
//! policies and counters; and [`Op`], an operation holding the lock, with the objects it pins
//! while it works outside the lock (disk I/O, host waits).

use std::sync::Arc;

use parking_lot::{Condvar, MutexGuard};
use strata_allocator::MappedPage;
use strata_vmm::{Error, Event, Result};

use super::slots::{Returns, SlotLease, SlotTier, Slots};
use crate::object::{Durability, ObjectId, Residency};
use crate::policy::EvictionPolicy;

#[derive(Clone)]
pub(super) struct Obj {
    pub(super) generation: u32,
    pub(super) live: bool,
    pub(super) lost: bool,
    /// The owner holds these bytes too: dropped first under pressure.
    pub(super) redundant: bool,
    /// The host copy came up from disk ahead of need ([`TierStore::stage_to_host`]) and no
    /// restore or read has used it yet.
    ///
    /// [`TierStore::stage_to_host`]: super::TierStore::stage_to_host
    pub(super) staged: bool,
    pub(super) durability: Durability,
    pub(super) owner: u64,
    pub(super) len: u64,
    pub(super) res: Residency,
    pub(super) hbm_ready: Option<Arc<Event>>,
    pub(super) host_ready: Option<Arc<Event>>,
    /// The operation working on the object (see [`Op`]); no other one touches it meanwhile.
    pub(super) pinned_by: Option<u64>,
}

impl Obj {
    /// True unless another operation than `op` pins the object.
    pub(super) fn free_for(&self, op: u64) -> bool {
        self.pinned_by.is_none_or(|p| p == op)
    }
}

pub(super) struct State {
    pub(super) objs: Vec<Obj>,
    pub(super) free_objs: Vec<u32>,
    pub(super) hbm: Slots,
    pub(super) host: Slots,
    pub(super) disk: Slots,
    /// The HBM pages, mapped back to back (`None`: revoked).
    pub(super) pages: Vec<Option<MappedPage>>,
    pub(super) hbm_policy: Box<dyn EvictionPolicy>,
    pub(super) host_policy: Box<dyn EvictionPolicy>,
    pub(super) step: u64,
    pub(super) evictions_hbm: u64,
    pub(super) evictions_host: u64,
    pub(super) prefetched: u64,
    pub(super) staged: u64,
    /// Staged host copies dropped before anything used them, ever.
    pub(super) staged_evicted: u64,
    pub(super) fell_back: u64,
    pub(super) lost: u64,
    pub(super) redundant_dropped: u64,
    pub(super) pages_revoked: u64,
    /// Operations begun and not yet ended (some may be inside [`Op::unlocked`]).
    pub(super) ops_in_flight: u32,
}

pub(super) fn stale(id: ObjectId) -> Error {
    Error::StaleId {
        kind: "tier object",
        index: id.index,
        generation: id.generation,
    }
}

impl State {
    /// The index of a live object that was not lost.
    pub(super) fn check(&self, id: ObjectId) -> Result<u32> {
        match self.objs.get(id.index as usize) {
            Some(o) if o.live && o.generation == id.generation => {
                if o.lost {
                    Err(Error::InvalidState(format!(
                        "{id} was lost to a revocation (release it and rebuild)"
                    )))
                } else {
                    Ok(id.index)
                }
            }
            _ => Err(stale(id)),
        }
    }

    /// A live object with no copy yet (a retired index when one is free).
    pub(super) fn new_object(&mut self, durability: Durability, owner: u64, len: u64) -> u32 {
        let fresh = Obj {
            generation: 0,
            live: true,
            lost: false,
            redundant: false,
            staged: false,
            durability,
            owner,
            len,
            res: Residency::default(),
            hbm_ready: None,
            host_ready: None,
            pinned_by: None,
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

    pub(super) fn id(&self, index: u32) -> ObjectId {
        ObjectId {
            index,
            generation: self.objs[index as usize].generation,
        }
    }

    pub(super) fn key(&self, index: u32) -> u64 {
        self.id(index).key()
    }

    fn slots(&mut self, tier: SlotTier) -> &mut Slots {
        match tier {
            SlotTier::Hbm => &mut self.hbm,
            SlotTier::Host => &mut self.host,
            SlotTier::Disk => &mut self.disk,
        }
    }

    /// A free slot of `tier` for object `obj`, back on its free list unless kept.
    pub(super) fn lease<'s>(
        &mut self,
        tier: SlotTier,
        obj: u32,
        returns: &'s Returns,
    ) -> Option<SlotLease<'s>> {
        let slot = self.slots(tier).take(obj)?;
        Some(SlotLease::new(tier, slot, returns))
    }

    /// Puts back the slots of dropped leases.
    pub(super) fn settle(&mut self, returns: &Returns) {
        let back = std::mem::take(&mut *returns.lock());
        for (tier, slot) in back {
            self.slots(tier).put_back(slot, None);
        }
    }

    pub(super) fn touch_hbm(&mut self, index: u32) {
        let (key, owner) = (self.key(index), self.objs[index as usize].owner);
        self.hbm_policy.touch(key, owner, self.step);
    }

    pub(super) fn touch_host(&mut self, index: u32) {
        let (key, owner) = (self.key(index), self.objs[index as usize].owner);
        self.host_policy.touch(key, owner, self.step);
    }

    /// Drops the host copy (its slot's fence already names the last copy that touched it).
    pub(super) fn drop_host(&mut self, index: u32) {
        let key = self.key(index);
        let o = &mut self.objs[index as usize];
        o.host_ready = None;
        if std::mem::take(&mut o.staged) {
            self.staged_evicted += 1;
        }
        if let Some(h) = o.res.host.take() {
            self.host.put_back(h, None);
            self.host_policy.remove(key);
        }
    }

    /// Drops the host and disk copies.
    pub(super) fn drop_lower(&mut self, index: u32) {
        self.drop_host(index);
        if let Some(d) = self.objs[index as usize].res.disk.take() {
            self.disk.put_back(d, None);
        }
    }

    pub(super) fn drop_hbm(&mut self, i: u32) {
        let ready = self.objs[i as usize].hbm_ready.clone();
        self.drop_hbm_with_fence(i, ready);
    }

    pub(super) fn drop_hbm_with_fence(&mut self, i: u32, fence: Option<Arc<Event>>) {
        let key = self.key(i);
        let o = &mut self.objs[i as usize];
        o.hbm_ready = None;
        if let Some(h) = o.res.hbm.take() {
            self.hbm.put_back(h, fence);
        }
        self.hbm_policy.remove(key);
    }

    /// Frees an object's slots and retires its id.
    pub(super) fn drop_object(&mut self, index: u32) {
        self.objs[index as usize].staged = false;
        self.drop_lower(index);
        self.drop_hbm(index);
        let o = &mut self.objs[index as usize];
        o.live = false;
        o.lost = false;
        o.redundant = false;
        o.generation = o.generation.wrapping_add(1);
        self.free_objs.push(index);
    }

    /// Object `i`'s bytes were read from its disk copy into host slot `h` by the CPU: the host
    /// slot becomes a second copy and the disk copy stays (an object's bytes never change while
    /// it has lower copies: a write drops them), so dropping the host copy later writes nothing.
    /// `reader` is the copy already queued to read the slot, if any; `staged`: moved up ahead
    /// of need, not yet used.
    pub(super) fn add_host_copy(
        &mut self,
        i: u32,
        h: u32,
        reader: Option<&Arc<Event>>,
        staged: bool,
    ) {
        self.host.fence[h as usize] = reader.cloned();
        let o = &mut self.objs[i as usize];
        o.res.host = Some(h);
        o.host_ready = None;
        o.staged = staged;
        self.touch_host(i);
    }

    /// Making room may drop redundant objects (see the module docs), the call's own included:
    /// then the call did not do what it was asked for them, which is an error, not a silent
    /// loss. (`idx` were all live and not lost when the call checked them.)
    pub(super) fn check_not_dropped(&self, idx: &[u32]) -> Result<()> {
        match idx.iter().find(|&&i| self.objs[i as usize].lost) {
            Some(i) => Err(Error::InvalidState(format!(
                "object #{i} was a redundant copy and was dropped to make room"
            ))),
            None => Ok(()),
        }
    }
}

/// One operation of the store: holds its lock, except inside [`Op::unlocked`], where it does
/// disk I/O and host waits. Objects it pins stay out of every other operation's reach (others
/// wait for them or pass them over as victims) until it unpins them or ends.
pub(super) struct Op<'s> {
    pub(super) st: MutexGuard<'s, State>,
    token: u64,
    pinned: Vec<u32>,
    idle: &'s Condvar,
    returns: &'s Returns,
}

impl<'s> Op<'s> {
    pub(super) fn new(
        st: MutexGuard<'s, State>,
        token: u64,
        idle: &'s Condvar,
        returns: &'s Returns,
    ) -> Self {
        let mut st = st;
        st.ops_in_flight += 1;
        Op {
            st,
            token,
            pinned: Vec::new(),
            idle,
            returns,
        }
    }

    pub(super) fn token(&self) -> u64 {
        self.token
    }

    /// Pins the objects of `idx` no operation pins yet (the caller checked that no other one
    /// does) and returns them.
    pub(super) fn pin(&mut self, idx: &[u32]) -> Vec<u32> {
        let mut fresh = Vec::new();
        for &i in idx {
            let o = &mut self.st.objs[i as usize];
            if o.pinned_by.is_none() {
                o.pinned_by = Some(self.token);
                fresh.push(i);
            }
        }
        self.pinned.extend_from_slice(&fresh);
        fresh
    }

    /// Unpins objects this operation pinned.
    pub(super) fn unpin(&mut self, idx: &[u32]) {
        if idx.is_empty() {
            return;
        }
        for &i in idx {
            let o = &mut self.st.objs[i as usize];
            if o.pinned_by == Some(self.token) {
                o.pinned_by = None;
            }
        }
        self.pinned.retain(|i| !idx.contains(i));
        self.idle.notify_all();
    }

    /// Runs `f` without the lock (the operation's pins and slot leases hold).
    pub(super) fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let r = MutexGuard::unlocked(&mut self.st, f);
        self.settle();
        r
    }

    /// Waits for another operation to unpin objects.
    pub(super) fn wait(&mut self) {
        self.idle.wait(&mut self.st);
        self.settle();
    }

    /// Puts back the slots of dropped leases.
    pub(super) fn settle(&mut self) {
        self.st.settle(self.returns);
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        let pinned = std::mem::take(&mut self.pinned);
        self.unpin(&pinned);
        self.settle();
        self.st.ops_in_flight -= 1;
    }
}
