//! Residency: the step clock, lookahead hints and their prefetches,
//! [`KvBlockManager::make_resident`], and making room in the pool by spilling the request that runs
//! furthest away.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use strata_allocator::KvSpace;
use strata_vmm::{record_deferred, Event, Result};

use crate::object::Tier;
use crate::policy::{plan_prefetch, EvictionPolicy};

use super::{get, lost_first, resident_blocks, runs, Inner, KvBlockManager, RequestId};

impl KvBlockManager {
    /// Moves to `step` (the policies' clock; it never goes back). Requests used in the current
    /// step are not spilled for room.
    pub fn advance(&self, step: u64) {
        let mut inner = self.inner.lock();
        inner.step = inner.step.max(step);
        let now = inner.step;
        inner.lookahead.advance(now);
        drop(inner);
        self.store.advance(step);
    }

    /// The scheduler's queue beyond the hinted window: requests in the order they will run after
    /// it (an FCFS waiting queue, or the rest of a round robin). Eviction then ranks them after
    /// the window, the last one first (TierKV §3.4: the longest time until next execution);
    /// requests in neither go first. Replaces the previous queue. An unknown or released
    /// request is [`strata_vmm::Error::StaleId`], with the previous queue kept.
    pub fn queue(&self, waiting: &[RequestId]) -> Result<()> {
        let mut inner = self.inner.lock();
        for &r in waiting {
            get(&inner.reqs, r)?;
        }
        let owners: Vec<u64> = waiting.iter().map(|r| r.0).collect();
        self.store.queue(&owners);
        inner.lookahead.queue(&owners);
        Ok(())
    }

    /// Scheduler lookahead: the requests of each of the next K steps (unknown ids are ignored: a
    /// hint is advice). Eviction learns who runs when; spilled blocks of those requests that
    /// fit the compute window (Eq. 1, Algorithm 1) come back now, nearest request first, as far
    /// as the pool allows without spilling a request that runs sooner. Returns the copies'
    /// event, if any block moved.
    pub fn hint(&self, next_steps: &[Vec<RequestId>]) -> Result<Option<Arc<Event>>> {
        let owners: Vec<Vec<u64>> = next_steps
            .iter()
            .map(|s| s.iter().map(|r| r.0).collect())
            .collect();
        self.store.schedule(&owners);
        let mut inner = self.inner.lock();
        inner.lookahead.schedule(&owners);
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for &r in owners.iter().flatten() {
            if inner
                .reqs
                .get(&r)
                .is_some_and(|q| q.lost_unreported.is_empty())
                && seen.insert(r)
            {
                order.push(r);
            }
        }
        let mut candidates = Vec::new();
        let mut blocks = Vec::new();
        for &r in &order {
            for (&p, ids) in &inner.reqs[&r].spilled {
                candidates.push((blocks.len() as u64, self.tier_of(ids)?));
                blocks.push((r, p));
            }
        }
        let t_iter = vec![self.config.t_iter; next_steps.len()];
        let plan = plan_prefetch(
            &candidates,
            self.block_bytes(),
            self.config.links,
            &t_iter,
            self.config.delta_sched,
        );
        let mut wanted: Vec<(u64, Vec<usize>)> = Vec::new();
        for (key, _) in plan {
            let (r, p) = blocks[key as usize];
            match wanted.last_mut() {
                Some((last, ps)) if *last == r => ps.push(p),
                _ => wanted.push((r, vec![p])),
            }
        }
        let keep: HashSet<u64> = wanted.iter().map(|(r, _)| *r).collect();
        let before = inner.stats.restores;
        let ev = self.bring_in(&mut inner, &wanted, &keep, true)?;
        inner.stats.hinted_prefetches += inner.stats.restores - before;
        Ok(ev)
    }

    /// TierKV's first hop ahead of need (§3.3): the spilled blocks of `batch` that sit on disk
    /// move up to host memory, so that a later [`KvBlockManager::make_resident`] copies them
    /// from there. Only into host room nothing else needs: free slots beyond what spilling
    /// every other resident request would take ([`crate::TierStore::stage_to_host`]: staging
    /// never moves another request's blocks down, which would only trade this disk read for
    /// one of theirs); what finds none stays on disk (a hint, not an error). Returns the store
    /// objects moved up. The file reads run without this manager's lock, so requests outside
    /// `batch` can be spilled and made resident meanwhile, and behind every read of a restore.
    pub fn stage(&self, batch: &[RequestId]) -> Result<usize> {
        let (ids, reserve) = {
            let inner = self.inner.lock();
            let mut ids = Vec::new();
            for &r in batch {
                ids.extend(get(&inner.reqs, r)?.spilled.values().flatten().copied());
            }
            (ids, self.spill_room(&inner, batch)?)
        };
        if ids.is_empty() {
            return Ok(0);
        }
        self.store.stage_to_host(&ids, reserve)
    }

    /// Store objects a spill of every resident request outside `batch` would create: the used
    /// chunks of their resident blocks without a clean copy, in every tensor.
    fn spill_room(&self, inner: &Inner, batch: &[RequestId]) -> Result<usize> {
        let tensors = 2 * u64::from(self.config.layers);
        let mut n = 0;
        for (&r, q) in &inner.reqs {
            if batch.contains(&RequestId(r)) {
                continue;
            }
            let tokens = inner.space.tokens(q.slot)?;
            for p in resident_blocks(&inner.space, q)? {
                if !q.clean.contains_key(&p) {
                    n += self.used_chunks(p, tokens) * tensors;
                }
            }
        }
        Ok(n as usize)
    }

    /// Makes every block of `batch` resident: maps pages behind its spilled and lost blocks
    /// (spilling requests outside the batch, furthest next use first, while the pool is short)
    /// and copies the spilled bytes back. Wait for the event before the kernels read (it also
    /// covers earlier prefetches of these requests). All or nothing: on error (out of memory
    /// when the batch does not fit; [`Error::InvalidState`] while a request has unreported lost
    /// blocks; [`Error::StaleId`]) no block of the batch changed residency, and its requests
    /// are not counted as used in this step (a shorter batch may spill them for room).
    ///
    /// [`Error::InvalidState`]: strata_vmm::Error::InvalidState
    /// [`Error::StaleId`]: strata_vmm::Error::StaleId
    pub fn make_resident(&self, batch: &[RequestId]) -> Result<Arc<Event>> {
        let mut inner = self.inner.lock();
        let step = inner.step;
        let mut wanted = Vec::new();
        let mut keep = HashSet::new();
        for &r in batch {
            let q = get(&inner.reqs, r)?;
            if !q.lost_unreported.is_empty() {
                return Err(lost_first(r.0));
            }
            if keep.insert(r.0) {
                wanted.push((r.0, inner.space.evicted_pages(q.slot)?));
            }
        }
        let before = inner.stats.restores;
        let brought = self.bring_in(&mut inner, &wanted, &keep, false)?;
        for &r in &keep {
            self.touch(&mut inner, r, step);
        }
        let restored = inner.stats.restores - before;
        if restored > 0 {
            inner.stats.demand_restores += restored;
            inner.stats.stalls += 1;
        }
        match brought {
            Some(ev) => Ok(ev),
            None => self.store.take_to_device(&[], &[]),
        }
    }

    /// Maps pages behind `wanted` blocks (holes) and copies spilled bytes back in one batch.
    /// `advice` (hints): stops quietly at the first request that does not fit, and spills only
    /// requests that run later than the one coming in; otherwise all or nothing.
    fn bring_in(
        &self,
        inner: &mut Inner,
        wanted: &[(u64, Vec<usize>)],
        keep: &HashSet<u64>,
        advice: bool,
    ) -> Result<Option<Arc<Event>>> {
        let mut mapped: Vec<(u64, Range<usize>)> = Vec::new();
        let mut failure = None;
        'requests: for (r, blocks) in wanted {
            let slot = inner.reqs[r].slot;
            let later_than = advice.then(|| inner.lookahead.distance(*r));
            for run in runs(blocks) {
                let restore = |space: &mut KvSpace| space.restore_pages(slot, run.clone());
                match self.with_room(inner, keep, later_than, restore) {
                    Ok(()) => mapped.push((*r, run)),
                    Err(e) if advice && e.is_out_of_memory() => break 'requests,
                    Err(e) => {
                        failure = Some(e);
                        break 'requests;
                    }
                }
            }
        }
        if let Some(e) = failure {
            self.unmap(inner, &mapped);
            return Err(e);
        }
        if mapped.is_empty() {
            return Ok(None);
        }
        // Full blocks keep their objects as clean copies; the others' are released.
        let copied = (|| {
            let (mut copies, mut keep) = (Vec::new(), Vec::new());
            for (r, run) in &mapped {
                let q = &inner.reqs[r];
                let tokens = inner.space.tokens(q.slot)?;
                for p in run.clone() {
                    if let Some(ids) = q.spilled.get(&p) {
                        let per_tensor = (ids.len() / (2 * self.config.layers as usize)) as u64;
                        let addrs = self.block_addrs(&inner.space, q.slot, p, per_tensor)?;
                        copies.extend(ids.iter().copied().zip(addrs));
                        keep.resize(copies.len(), self.is_full(p, tokens));
                    }
                }
            }
            self.store
                .restore_to_device(&copies, &keep, &self.scope(&inner.space))
        })();
        let ev = match copied {
            Ok(ev) => ev,
            Err(e) => {
                // Copies already queued into the pages finish before they are unmapped.
                if let Err(sync) = self.store.synchronize() {
                    record_deferred(sync);
                }
                self.unmap(inner, &mapped);
                return Err(e);
            }
        };
        let Inner {
            space, reqs, stats, ..
        } = inner;
        for (r, run) in &mapped {
            let Some(q) = reqs.get_mut(r) else {
                continue;
            };
            // The same test as above: full blocks' objects were kept, the others' released.
            let tokens = space.tokens(q.slot).unwrap_or(0);
            for p in run.clone() {
                if let Some(ids) = q.spilled.remove(&p) {
                    stats.restores += 1;
                    if self.is_full(p, tokens) {
                        q.clean.insert(p, ids);
                    }
                } else {
                    q.lost_reported.remove(&p);
                }
            }
            q.ready = Some(Arc::clone(&ev));
        }
        Ok(Some(ev))
    }

    /// Makes holes again of pages a failed `bring_in` mapped (they hold no bytes yet).
    fn unmap(&self, inner: &mut Inner, mapped: &[(u64, Range<usize>)]) {
        for (r, run) in mapped {
            let slot = inner.reqs[r].slot;
            if let Err(e) = inner.space.evict_pages(slot, run.clone()) {
                record_deferred(e);
            }
        }
    }

    /// Runs `op` on the space, spilling victims to host memory while it runs out of pool
    /// pages: requests outside `keep`, not used in the current step, running furthest away (and
    /// further than `later_than` steps when given). No victim left: `op`'s error.
    pub(super) fn with_room<T>(
        &self,
        inner: &mut Inner,
        keep: &HashSet<u64>,
        later_than: Option<usize>,
        mut op: impl FnMut(&mut KvSpace) -> Result<T>,
    ) -> Result<T> {
        loop {
            match op(&mut inner.space) {
                Err(e) if e.is_out_of_memory() => {
                    let Some(victim) = self.victim(inner, keep, later_than, false) else {
                        return Err(e);
                    };
                    self.spill(inner, victim, Tier::Host)?;
                    inner.stats.evictions += 1;
                }
                other => return other,
            }
        }
    }

    /// The request holding pool pages that runs furthest away, among those outside `keep` and
    /// (unless `pinned_too`) not used in the current step.
    pub(super) fn victim(
        &self,
        inner: &mut Inner,
        keep: &HashSet<u64>,
        later_than: Option<usize>,
        pinned_too: bool,
    ) -> Option<u64> {
        let Inner {
            space,
            reqs,
            lookahead,
            step,
            ..
        } = inner;
        let far: Option<HashSet<u64>> = later_than.map(|d| {
            reqs.keys()
                .copied()
                .filter(|&r| lookahead.distance(r) > d)
                .collect()
        });
        lookahead.victim(&mut |r| {
            !keep.contains(&r)
                && far.as_ref().is_none_or(|f| f.contains(&r))
                && reqs.get(&r).is_some_and(|q| {
                    (pinned_too || q.last_step < *step)
                        && space.mapped_pages(q.slot).is_ok_and(|m| m > q.holes())
                })
        })
    }
}
