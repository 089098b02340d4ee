//! A thread cache's figures: counts not yet folded into the allocator's totals, and its
//! shares of the allocated-byte figures with the settle that keeps their peaks exact
//! (`stats::Peaked`).

use std::sync::Arc;

use parking_lot::MutexGuard;
use strata_vmm::{DevicePtr, StreamHandle};

use super::super::stats::{settle, Headroom};
use super::super::{State, TagId};
use super::{CacheData, Pop, ThreadCache};

/// Counts not yet folded into the allocator's totals.
#[derive(Clone, Copy, Debug, Default)]
pub(in crate::caching) struct Deltas {
    pub allocs: u64,
    pub frees: u64,
    pub live: i64,
    /// Block bytes (per tag only; the total is a [`Shares`] figure).
    pub blocks: i64,
}

/// A cache's shares of the allocated-byte figures (see [`super::super::stats::Peaked`]).
#[derive(Clone, Debug, Default)]
pub(in crate::caching) struct Shares {
    pub requested: Headroom,
    pub blocks: Headroom,
    /// Requested bytes by tag index.
    pub tags: Vec<Headroom>,
}

impl Shares {
    /// Whether handing out a block of `block` bytes for `requested` under tag `ti` stays
    /// within every cap.
    #[inline]
    pub(super) fn fit(&self, requested: u64, block: u64, ti: usize) -> bool {
        self.requested.fits(requested)
            && self.blocks.fits(block)
            && self.tags.get(ti).is_some_and(|t| t.fits(requested))
    }

    #[inline]
    pub(super) fn add(&mut self, requested: u64, block: u64, ti: usize) {
        self.requested.live += requested;
        self.blocks.live += block;
        self.tags[ti].live += requested;
    }

    #[inline]
    pub(super) fn sub(&mut self, requested: u64, block: u64, ti: usize) {
        self.requested.live -= requested;
        self.blocks.live -= block;
        self.tags[ti].live -= requested;
    }
}

#[inline]
pub(super) fn count(d: &mut Deltas, n: u64, block: u64) {
    d.allocs += n;
    d.live += 1;
    d.blocks += block as i64;
}

#[inline]
pub(super) fn uncount(d: &mut Deltas, block: u64) {
    d.frees += 1;
    d.live -= 1;
    d.blocks -= block as i64;
}

impl State {
    pub(in crate::caching) fn fold(&mut self, data: &mut CacheData) {
        for (ti, d) in data.tags.iter_mut().enumerate() {
            let d = std::mem::take(d);
            let t = &mut self.totals;
            t.counts.allocs += d.allocs;
            t.counts.small_allocs += d.allocs;
            t.counts.cache_hits += d.allocs;
            t.counts.frees += d.frees;
            t.live = t.live.wrapping_add_signed(d.live);
            let tt = &mut self.tags[ti].totals;
            tt.allocs += d.allocs;
            tt.frees += d.frees;
            tt.live = tt.live.wrapping_add_signed(d.live);
            tt.allocated_blocks = tt.allocated_blocks.wrapping_add_signed(d.blocks);
        }
    }

    /// The registered caches (cloned: their guards do not borrow the state).
    pub(in crate::caching) fn cache_list(&self) -> Vec<Arc<ThreadCache>> {
        self.caches.iter().flatten().cloned().collect()
    }

    /// After a shared-path increment that asked for it ([`super::super::stats::Peaked::add`]):
    /// settles the allocated-byte figures, the total and tag `ti`'s, with every cache locked.
    #[cold]
    #[inline(never)]
    pub(in crate::caching) fn settle_peaks(&mut self, ti: usize) {
        let caches = self.cache_list();
        let mut guards: Vec<_> = caches.iter().map(|c| c.data.lock()).collect();
        self.settle_locked(&mut guards, ti, None);
    }

    /// A pop from `cache`'s magazine that passes one of its caps: with every cache locked, the
    /// block is handed out and the peaks settled with this cache as the requester.
    #[cold]
    #[inline(never)]
    pub(in crate::caching) fn alloc_settling(
        &mut self,
        cache: &ThreadCache,
        ti: usize,
        (size, class, stream, tag): (u64, usize, StreamHandle, TagId),
    ) -> Option<DevicePtr> {
        let caches = self.cache_list();
        let mut guards: Vec<_> = caches.iter().map(|c| c.data.lock()).collect();
        let me = caches.iter().position(|c| c.slot == cache.slot)?;
        let Pop::Hit(ptr) = guards[me].alloc(size, class, stream, tag, true) else {
            return None;
        };
        self.settle_locked(&mut guards, ti, Some(me));
        Some(ptr)
    }

    /// [`settle`]s the total's two figures and tag `ti`'s with every cache's shares.
    fn settle_locked(
        &mut self,
        guards: &mut [MutexGuard<'_, CacheData>],
        ti: usize,
        requester: Option<usize>,
    ) {
        self.totals.counts.thread_cache_settles += 1;
        let mut shares: Vec<&mut Shares> = guards.iter_mut().map(|g| &mut g.shares).collect();
        for s in shares.iter_mut() {
            if s.tags.len() <= ti {
                s.tags.resize(ti + 1, Headroom::default());
            }
        }
        let bytes = &mut self.totals.bytes;
        let mut of: Vec<&mut Headroom> = shares.iter_mut().map(|s| &mut s.requested).collect();
        settle(&mut bytes.requested, &mut of, requester);
        let mut of: Vec<&mut Headroom> = shares.iter_mut().map(|s| &mut s.blocks).collect();
        settle(&mut bytes.blocks, &mut of, requester);
        let mut of: Vec<&mut Headroom> = shares.iter_mut().map(|s| &mut s.tags[ti]).collect();
        settle(&mut self.tags[ti].totals.allocated, &mut of, requester);
    }
}

/// Every cache's shares summed (live bytes and caps), with `tags` tag indices.
pub(in crate::caching) fn cache_shares(
    caches: &[(u32, MutexGuard<'_, CacheData>)],
    tags: usize,
) -> Shares {
    let mut sum = Shares {
        tags: vec![Headroom::default(); tags],
        ..Shares::default()
    };
    let plus = |to: &mut Headroom, h: &Headroom| {
        to.live += h.live;
        to.cap += h.cap;
    };
    for (_, data) in caches {
        plus(&mut sum.requested, &data.shares.requested);
        plus(&mut sum.blocks, &data.shares.blocks);
        for (to, h) in sum.tags.iter_mut().zip(&data.shares.tags) {
            plus(to, h);
        }
    }
    sum
}

/// Counts the caches have not folded yet: (total, by tag index).
pub(in crate::caching) fn cache_deltas(
    caches: &[(u32, MutexGuard<'_, CacheData>)],
    tags: usize,
) -> (Deltas, Vec<Deltas>) {
    let mut total = Deltas::default();
    let mut by_tag = vec![Deltas::default(); tags];
    for (_, data) in caches {
        for (ti, d) in data.tags.iter().enumerate() {
            add(&mut total, d);
            add(&mut by_tag[ti], d);
        }
    }
    (total, by_tag)
}

fn add(to: &mut Deltas, d: &Deltas) {
    to.allocs += d.allocs;
    to.frees += d.frees;
    to.live += d.live;
    to.blocks += d.blocks;
}
