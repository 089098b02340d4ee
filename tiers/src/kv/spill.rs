//! Spilling blocks down to the store's host and disk tiers: pause, idle spills, and the spill that
//! makes room.

use strata_allocator::{KvSpace, SlotId};
use strata_vmm::{Error, Result};

use crate::object::{ObjectId, Tier};
use crate::Durability;

use super::{get, resident_blocks, runs, unknown, Inner, KvBlockManager, RequestId};

impl KvBlockManager {
    /// A spill to disk needs a disk tier: without one it is [`Error::InvalidState`], whatever
    /// the host tier holds (so the answer does not depend on which copies are where).
    fn check_tier(&self, to: Tier) -> Result<()> {
        if to == Tier::Disk && self.store.config().disk.is_none() {
            return Err(Error::InvalidState(
                "a spill to disk in a space without a disk tier (disk_bytes 0)".into(),
            ));
        }
        Ok(())
    }

    /// Moves the resident blocks of `r` down and evicts their pages: blocks with an intact clean
    /// copy copy nothing; the others are copied (all layers, K and V; only the chunks its tokens
    /// fill). With `to == Tier::Disk` its spilled objects then move to disk. Returns the blocks
    /// spilled; on error every block stays resident.
    pub(super) fn spill(&self, inner: &mut Inner, r: u64, to: Tier) -> Result<usize> {
        let Inner {
            space, reqs, stats, ..
        } = inner;
        let q = reqs.get_mut(&r).ok_or(unknown(RequestId(r)))?;
        let tokens = space.tokens(q.slot)?;
        if space.mapped_pages(q.slot)? > space.pages_for(tokens) {
            // Capacity a reused slot brought along holds no KV: give it back, copy nothing.
            space.shrink(q.slot, tokens)?;
        }
        let resident = resident_blocks(space, q)?;
        if !resident.is_empty() {
            if let Some(ev) = q.ready.take() {
                ev.synchronize()?;
            }
            // Clean copies the store still holds become sole copies (never dropped for room
            // from now on); the rest of the blocks are copied.
            let (mut clean, mut dirty) = (Vec::new(), Vec::new());
            for &p in &resident {
                let claimed = match q.clean.get(&p) {
                    Some(ids) => self.store.set_redundant(ids, false),
                    None => {
                        dirty.push(p);
                        continue;
                    }
                };
                match claimed {
                    Ok(true) => clean.push(p),
                    Ok(false) => {
                        if let Some(ids) = q.clean.remove(&p) {
                            self.release_objects(&ids);
                        }
                        dirty.push(p);
                    }
                    Err(e) => {
                        self.unclaim(q, &clean);
                        return Err(e);
                    }
                }
            }
            let copied = match self.copy_down(space, q.slot, tokens, &dirty, r) {
                Ok(copied) => copied,
                Err(e) => {
                    self.unclaim(q, &clean);
                    return Err(e);
                }
            };
            q.spilled.extend(dirty.iter().copied().zip(copied));
            for p in &clean {
                if let Some(ids) = q.clean.remove(p) {
                    q.spilled.insert(*p, ids);
                }
            }
            // Every page is a hole afterwards, even when an unmap reports an error.
            let mut first_err = None;
            for run in runs(&resident) {
                if let Err(e) = space.evict_pages(q.slot, run) {
                    first_err.get_or_insert(e);
                }
            }
            stats.spills += dirty.len() as u64;
            stats.clean_spills += clean.len() as u64;
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        if to == Tier::Disk {
            let ids: Vec<ObjectId> = q.spilled.values().flatten().copied().collect();
            if !ids.is_empty() {
                self.store.spill(&ids, Tier::Disk)?;
            }
        }
        Ok(resident.len())
    }

    /// Copies `blocks` (resident, of a request with `tokens` tokens in `slot`) into new `Lossy`
    /// store objects of `owner` and waits until the bytes left the device; returns each
    /// block's objects (the order of [`Req::spilled`]). All or nothing.
    fn copy_down(
        &self,
        space: &KvSpace,
        slot: SlotId,
        tokens: u32,
        blocks: &[usize],
        owner: u64,
    ) -> Result<Vec<Vec<ObjectId>>> {
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let mut srcs = Vec::new();
        let mut per_block = Vec::with_capacity(blocks.len());
        for &p in blocks {
            let chunks = self.used_chunks(p, tokens);
            let addrs = self.block_addrs(space, slot, p, chunks)?;
            per_block.push(addrs.len());
            srcs.extend(addrs);
        }
        let (ids, done) =
            self.store
                .put_from_device(&srcs, Durability::Lossy, owner, &self.scope(space))?;
        if let Err(e) = done.synchronize() {
            self.release_objects(&ids);
            return Err(e);
        }
        let mut ids = ids.into_iter();
        Ok(per_block
            .into_iter()
            .map(|n| ids.by_ref().take(n).collect())
            .collect())
    }

    /// Spills `r`'s resident blocks to host memory, or to disk with `to == Tier::Disk` (its
    /// blocks already in host memory move there too). Out of host and disk space is an error
    /// that leaves the blocks resident.
    pub fn pause(&self, r: RequestId, to: Tier) -> Result<()> {
        if to == Tier::Hbm {
            return Err(Error::InvalidArgument(
                "pause spills down: to Host or Disk".into(),
            ));
        }
        self.check_tier(to)?;
        let mut inner = self.inner.lock();
        get(&inner.reqs, r)?;
        self.spill(&mut inner, r.0, to).map(drop)
    }

    /// Spills the requests idle for more than `idle_steps` steps to `to` (as
    /// [`KvBlockManager::pause`]); returns the blocks spilled.
    pub fn spill_idle(&self, idle_steps: u64, to: Tier) -> Result<usize> {
        if to == Tier::Hbm {
            return Err(Error::InvalidArgument(
                "spill_idle goes down: to Host or Disk".into(),
            ));
        }
        self.check_tier(to)?;
        let mut inner = self.inner.lock();
        let step = inner.step;
        let mut idle: Vec<u64> = inner
            .reqs
            .iter()
            .filter(|(_, q)| q.last_step.saturating_add(idle_steps) < step)
            .map(|(&r, _)| r)
            .collect();
        idle.sort_unstable();
        let mut spilled = 0;
        for r in idle {
            spilled += self.spill(&mut inner, r, to)?;
        }
        Ok(spilled)
    }
}
