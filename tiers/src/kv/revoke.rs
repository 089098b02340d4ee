//! Revocation: pool pages taken back by a lender, clean blocks first, then lost blocks.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use strata_allocator::Page;
use strata_vmm::{Error, Result};

use crate::object::Tier;

use super::{resident_blocks, unknown, Inner, KvBlockManager, KvRevocation, RequestId};

impl KvBlockManager {
    /// Takes `pages` pool pages back for a lender (Harvest's order, under the lock so no new
    /// copy starts): free pool capacity and pages of released requests first; then, block by
    /// block, the requests running furthest away (those used in the current step last): copies
    /// into the block drain (events), its pages are unmapped without copying and return to the
    /// pool, which hands them out. A block with an intact clean copy goes first and becomes
    /// spilled; any other is lost (reported once through [`KvBlockManager::take_lost`]). When even that is not enough the pool's error is returned; blocks lost on the way
    /// stay lost and reported.
    pub fn revoke(&self, pages: usize) -> Result<KvRevocation> {
        let mut inner = self.inner.lock();
        let pool = Arc::clone(self.store.pool());
        let mut lost: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let mut reclaimed = false;
        let taken = loop {
            match pool.take(pages) {
                Ok(taken) => break taken,
                Err(e) if e.is_out_of_memory() => {
                    if !reclaimed {
                        reclaimed = true;
                        if inner.space.reclaim_deferred() > 0 {
                            continue;
                        }
                    }
                    let none = HashSet::new();
                    let victim = self
                        .victim(&mut inner, &none, None, false)
                        .or_else(|| self.victim(&mut inner, &none, None, true));
                    let Some(r) = victim else {
                        return Err(e);
                    };
                    if let Some(p) = self.lose_last_block(&mut inner, r)? {
                        lost.entry(r).or_default().push(p);
                    }
                }
                Err(e) => return Err(e),
            }
        };
        inner.stats.pages_revoked += taken.len() as u64;
        Ok(KvRevocation {
            pages: taken,
            lost: lost
                .into_iter()
                .map(|(r, mut ps)| {
                    ps.sort_unstable();
                    (RequestId(r), ps)
                })
                .collect(),
        })
    }

    /// Takes `pages` pool pages back for a lender without losing any KV: as
    /// [`KvBlockManager::revoke`], but the victims (requests running furthest away, those used
    /// in the current step last) are spilled to host memory first, whole, with copies. For
    /// spaces whose KV cannot be recomputed cheaply. Out of host space or of victims: the
    /// error, with the requests spilled so far left spilled.
    pub fn revoke_spilling(&self, pages: usize) -> Result<Vec<Page>> {
        let mut inner = self.inner.lock();
        let pool = Arc::clone(self.store.pool());
        let none = HashSet::new();
        let mut reclaimed = false;
        loop {
            match pool.take(pages) {
                Ok(taken) => {
                    inner.stats.pages_revoked += taken.len() as u64;
                    return Ok(taken);
                }
                Err(e) if e.is_out_of_memory() => {
                    if !reclaimed {
                        reclaimed = true;
                        if inner.space.reclaim_deferred() > 0 {
                            continue;
                        }
                    }
                    let victim = self
                        .victim(&mut inner, &none, None, false)
                        .or_else(|| self.victim(&mut inner, &none, None, true));
                    let Some(r) = victim else {
                        return Err(e);
                    };
                    self.spill(&mut inner, r, Tier::Host)?;
                    inner.stats.evictions += 1;
                }
                Err(e) => return Err(e),
            }
        }
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
