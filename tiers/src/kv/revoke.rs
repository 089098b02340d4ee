//! Revocation: pool pages taken back by a lender, clean blocks first, then lost blocks.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use strata_allocator::{Page, PageLease, Return};
use strata_vmm::{Error, Result};

use crate::object::Tier;

use super::{resident_blocks, unknown, Inner, KvBlockManager, KvRevocation, RequestId};

impl KvBlockManager {
    /// Takes `pages` pool pages back for a lender (Harvest's order, under the lock so no new
    /// copy starts): free pool capacity and pages of released requests first; then, block by
    /// block, the requests running furthest away (those used in the current step last): copies
    /// into the block drain (events), its pages are unmapped without copying and return to the
    /// pool, which hands them out. A block with an intact clean copy goes first and becomes
    /// spilled; any other is lost (reported once through [`KvBlockManager::take_lost`]). When
    /// even that is not enough the pool's error is returned; blocks lost on the way stay lost
    /// ([`KvBlockManager::revoke_reporting`] names them).
    pub fn revoke(&self, pages: usize) -> Result<KvRevocation> {
        let (rev, result) = self.revoke_reporting(pages);
        result.map(|()| rev)
    }

    /// [`KvBlockManager::revoke`], with the blocks it lost also when it fails (then no pages:
    /// those taken went back to the pool).
    pub fn revoke_reporting(&self, pages: usize) -> (KvRevocation, Result<()>) {
        let mut inner = self.inner.lock();
        let mut lost: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let unmapped = inner.space.stats().pages_unmapped_total;
        let taken = self.take_for_lender(&mut inner, pages, |m, inner, r| {
            if let Some(p) = m.lose_last_block(inner, r)? {
                lost.entry(r).or_default().push(p);
            }
            Ok(())
        });
        Self::count_revoked(&mut inner, unmapped);
        let lost = lost
            .into_iter()
            .map(|(r, mut ps)| {
                ps.sort_unstable();
                (RequestId(r), ps)
            })
            .collect();
        match taken {
            Ok(pages) => (KvRevocation { pages, lost }, Ok(())),
            Err(e) => (
                KvRevocation {
                    pages: Vec::new(),
                    lost,
                },
                Err(e),
            ),
        }
    }

    /// Counts the pages a revocation took from the space: those unmapped since the space had
    /// unmapped `unmapped_before` in all (free pool pages and new ones take nothing from it).
    fn count_revoked(inner: &mut Inner, unmapped_before: u64) {
        let now = inner.space.stats().pages_unmapped_total;
        inner.stats.pages_revoked += now.saturating_sub(unmapped_before);
    }

    /// Takes `pages` pool pages back for a lender without losing any KV: as
    /// [`KvBlockManager::revoke`], but the victims (requests running furthest away, those used
    /// in the current step last) are spilled to host memory first, whole, with copies. For
    /// spaces whose KV cannot be recomputed cheaply. Out of host space or of victims: the
    /// error, with the requests spilled so far left spilled.
    pub fn revoke_spilling(&self, pages: usize) -> Result<Vec<Page>> {
        let mut inner = self.inner.lock();
        let unmapped = inner.space.stats().pages_unmapped_total;
        let taken = self.take_for_lender(&mut inner, pages, |m, inner, r| {
            m.spill(inner, r, Tier::Host)?;
            inner.stats.evictions += 1;
            Ok(())
        });
        Self::count_revoked(&mut inner, unmapped);
        taken
    }

    /// Takes `pages` pool pages for a lender: free pool capacity first (pages the device can
    /// still create), then the pages of released requests, then what `free_up` returns to the
    /// pool from the requests running furthest away (those used in the current step last),
    /// taking the pages as they come back. Once the device has refused a page, none is created
    /// again until the pool has released memory to it: one failed driver call, not one per
    /// victim. On an error the pages taken from the free list go back to it and the pages
    /// created here are released to the device.
    fn take_for_lender(
        &self,
        inner: &mut Inner,
        pages: usize,
        mut free_up: impl FnMut(&Self, &mut Inner, u64) -> Result<()>,
    ) -> Result<Vec<Page>> {
        let pool = Arc::clone(self.store.pool());
        let mut refused = match pool.take(pages) {
            Ok(taken) => return Ok(taken),
            Err(e) if e.is_out_of_memory() => e,
            Err(e) => return Err(e),
        };
        // Pages taken from the free list go back there on an error; pages created here go back
        // to the device, as a failed take would have left them.
        let mut lease = PageLease::empty(&pool);
        let mut created = PageLease::empty(&pool).returning(Return::Release);
        // `Some(released_total)` once the device refused a single page: creation waits until
        // the pool has released memory to the device since.
        let mut refused_at: Option<u64> = None;
        let mut reclaimed = false;
        let none = HashSet::new();
        while lease.len() + created.len() < pages {
            let want = pages - lease.len() - created.len();
            let stats = pool.stats();
            // Free pages are taken without a driver call; then one page is created at a time
            // while the device gives them.
            let attempt = if stats.free > 0 {
                Some((pool.take(stats.free.min(want)), &mut lease))
            } else if refused_at.is_none_or(|at| stats.released_total > at) {
                Some((pool.take(1), &mut created))
            } else {
                None
            };
            match attempt {
                Some((Ok(taken), into)) => {
                    taken.into_iter().for_each(|p| into.push(p));
                    continue;
                }
                Some((Err(e), _)) if e.is_out_of_memory() => {
                    refused = e;
                    refused_at = Some(pool.stats().released_total);
                }
                Some((Err(e), _)) => return Err(e),
                None => {}
            }
            if !reclaimed {
                reclaimed = true;
                if inner.space.reclaim_deferred() > 0 {
                    continue;
                }
            }
            let victim = self
                .victim(inner, &none, None, false)
                .or_else(|| self.victim(inner, &none, None, true));
            let Some(r) = victim else {
                return Err(refused);
            };
            free_up(self, inner, r)?;
        }
        let mut taken = lease.into_pages();
        taken.extend(created.into_pages());
        Ok(taken)
    }

    /// Unmaps a resident block of `r` without copying it (after the copies into it): the last
    /// one with an intact clean copy, which becomes spilled (`None`), else the last one, which
    /// is lost and returned. Surplus pages of a reused slot go first, losing nothing (`None`).
    fn lose_last_block(&self, inner: &mut Inner, r: u64) -> Result<Option<usize>> {
        let Inner {
            space, reqs, stats, ..
        } = inner;
        let q = reqs.get_mut(&r).ok_or(unknown(RequestId(r)))?;
        if let Some(ev) = q.ready.take() {
            ev.synchronize()?;
        }
        let tokens = space.tokens(q.slot)?;
        if space.mapped_pages(q.slot)? > space.pages_for(tokens) {
            space.shrink(q.slot, tokens)?;
            return Ok(None);
        }
        let resident = resident_blocks(space, q)?;
        let clean: Vec<usize> = q.clean.keys().rev().copied().collect();
        for p in clean {
            let Some(ids) = q.clean.remove(&p) else {
                continue;
            };
            if self.store.set_redundant(&ids, false)? {
                q.spilled.insert(p, ids);
                stats.clean_revocations += 1;
                // The block is spilled even when the unmap reports an error.
                space.evict_page(q.slot, p)?;
                return Ok(None);
            }
            self.release_objects(&ids);
        }
        let Some(&p) = resident.last() else {
            return Err(Error::InvalidState(format!(
                "request {r} holds no resident block"
            )));
        };
        q.lost_unreported.insert(p);
        stats.lost_blocks += 1;
        // The block is a hole (lost) even when the unmap reports an error.
        space.evict_page(q.slot, p)?;
        Ok(Some(p))
    }
}
