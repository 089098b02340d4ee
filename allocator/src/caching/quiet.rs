//! Claiming tags for work that runs with the allocator's lock dropped: moving their pages
//! (offload, onload, revocation) or putting them to sleep.
//!
//! A claimed tag is [`Mode::Moving`]: its allocations and frees (fast paths included: they only
//! run on an awake tag) wait until the claim ends, and no other path reaches its pages. Other
//! tags' paths touch a tag's segments only when it has cached or wholly free memory (the cache,
//! empty small segments, whole free pages of large segments), and a claim gives that up before
//! any of its segments is taken out of the tables, after which no free of the tag can make
//! more. So the lock is dropped while the tag's streams are waited for and while each segment
//! is copied, and other tags allocate and free meanwhile.

use std::ops::{Deref, DerefMut};

use parking_lot::MutexGuard;
use strata_vmm::Result;

use super::streams::streams_of_tag;
use super::Guard;
use super::{CachingAllocator, Mode, State};

/// The allocator's lock, held, and the tags it claimed: dropping it (a panic included) ends
/// the claims and wakes whoever waits for them.
pub(super) struct Quiet<'a> {
    alloc: &'a CachingAllocator,
    guard: Guard<'a>,
    claimed: Vec<usize>,
}

impl<'a> Quiet<'a> {
    /// Takes the lock, claiming nothing yet.
    pub(super) fn new(alloc: &'a CachingAllocator) -> Self {
        Quiet {
            alloc,
            guard: alloc.state.lock(),
            claimed: Vec::new(),
        }
    }

    /// Claims tag index `ti` once it has no growth in flight and no other claim.
    pub(super) fn claim(&mut self, ti: usize) {
        while self.guard.inflight.growing(ti as u32) || self.guard.tags[ti].mode == Mode::Moving {
            self.alloc.settled.wait(&mut self.guard);
        }
        self.claim_now(ti);
    }

    /// Claims tag index `ti`, which the caller saw neither growing nor claimed under the lock
    /// it still holds.
    pub(super) fn claim_now(&mut self, ti: usize) {
        debug_assert!(self.guard.tags[ti].mode != Mode::Moving);
        // The tag's blocks leave the thread caches (whose fast paths only see awake tags).
        self.guard.absorb_caches();
        if self.guard.tags[ti].mode == Mode::Awake {
            self.guard.tags[ti].mode = Mode::Moving;
        }
        self.claimed.push(ti);
    }

    /// Waits until no tag is claimed and nothing is in flight.
    pub(super) fn wait_for_all(&mut self) {
        while self.guard.inflight.iter().next().is_some()
            || self.guard.tags.iter().any(|t| t.mode == Mode::Moving)
        {
            self.alloc.settled.wait(&mut self.guard);
        }
    }

    /// Runs `f` with the lock dropped; it is held again when `f` returns or unwinds.
    pub(super) fn unlocked<T>(&mut self, f: impl FnOnce() -> T) -> T {
        MutexGuard::unlocked(&mut self.guard, f)
    }
}

impl Deref for Quiet<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.guard
    }
}

impl DerefMut for Quiet<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Quiet<'_> {
    fn drop(&mut self) {
        for &ti in &self.claimed {
            let t = &mut self.guard.tags[ti];
            if t.mode == Mode::Moving {
                t.mode = Mode::Awake;
            }
        }
        if !self.claimed.is_empty() {
            self.alloc.settled.notify_all();
        }
    }
}

impl CachingAllocator {
    /// Waits (the lock dropped meanwhile) while tag index `ti` is claimed ([`Quiet`]).
    #[cold]
    pub(super) fn wait_while_moving(&self, guard: &mut Guard<'_>, ti: usize) {
        while guard.tags[ti].mode == Mode::Moving {
            self.settled.wait(guard);
        }
    }

    /// Quiesces the claimed tags before their pages are touched: waits, with the lock dropped,
    /// for every stream that may touch their memory (those their blocks were allocated,
    /// freed or used on, those of their cached runs and large segments, and those their
    /// pending frees wait for), then recycles their pending frees (complete by then).
    pub(super) fn quiesce(&self, quiet: &mut Quiet<'_>) -> Result<()> {
        let tags: Vec<u32> = quiet.claimed.iter().map(|&ti| ti as u32).collect();
        let mut streams = Vec::new();
        for &t in &tags {
            streams.extend(streams_of_tag(quiet, t));
        }
        let State {
            pending, blocks, ..
        } = &**quiet;
        for p in pending {
            if tags.contains(&blocks[p.block as usize].tag) {
                streams.extend(p.streams.iter().copied());
            }
        }
        streams.sort_unstable();
        streams.dedup();
        quiet.totals.counts.stream_syncs += streams.len() as u64;
        quiet.unlocked(|| self.sync_unlocked(&streams))?;
        for &t in &tags {
            self.drain_pending(quiet, Some(t))?;
        }
        Ok(())
    }

    /// Gives up the cached free memory of the claimed tags (see
    /// [`drop_cached_of_tag`](Self::drop_cached_of_tag)): their pages go back to their pools.
    pub(super) fn drop_cached_of_claimed(&self, quiet: &mut Quiet<'_>) -> Result<()> {
        let mut dropped = Vec::new();
        let mut first_err = None;
        for ti in quiet.claimed.clone() {
            self.drop_cached_of_tag(quiet, ti, &mut dropped, &mut first_err)?;
        }
        self.pool.give(dropped);
        first_err.map_or(Ok(()), Err)
    }
}
