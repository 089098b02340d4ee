//! Counters and the invariant check of a [`KvBlockManager`].

use std::collections::{BTreeSet, HashSet};

use strata_vmm::{Error, Result};

use super::{KvBlockManager, KvBlocksStats};

impl KvBlockManager {
    pub fn stats(&self) -> KvBlocksStats {
        let inner = self.inner.lock();
        let mut s = inner.stats;
        for q in inner.reqs.values() {
            let tokens = inner.space.tokens(q.slot).unwrap_or(0);
            s.live_requests += 1;
            s.tokens += u64::from(tokens);
            let n = inner.space.pages_for(tokens) as u64;
            s.blocks += n;
            s.blocks_spilled += q.spilled.len() as u64;
            s.blocks_clean += q.clean.len() as u64;
            s.blocks_resident += n.saturating_sub(q.holes() as u64);
        }
        s
    }

    /// Checks the manager against its `KvSpace` and store (run after every step in tests): the
    /// space's layout; every request's holes are exactly its spilled and lost blocks, below its
    /// tokens, disjoint; every spilled block has one live store object per used chunk and tensor,
    /// each with a host or disk copy; clean blocks are resident and full, with one live object
    /// per chunk and tensor (or dropped by the store); no object is held twice; then the
    /// store's own invariants.
    pub fn check_invariants(&self) -> Result<()> {
        let inner = self.inner.lock();
        let bad = |m: String| Err(Error::InvalidState(format!("kv invariant: {m}")));
        if let Err(m) = inner.space.check_layout() {
            return bad(m);
        }
        let mut held = HashSet::new();
        for (&r, q) in &inner.reqs {
            for &id in q.spilled.values().chain(q.clean.values()).flatten() {
                if !held.insert(id) {
                    return bad(format!("request {r}: {id} is held twice"));
                }
            }
            let tokens = inner.space.tokens(q.slot)?;
            let holes: BTreeSet<usize> = inner.space.evicted_pages(q.slot)?.into_iter().collect();
            let mut expected: BTreeSet<usize> = q.spilled.keys().copied().collect();
            for lost in [&q.lost_unreported, &q.lost_reported] {
                for &p in lost {
                    if !expected.insert(p) {
                        return bad(format!("request {r} block {p} is spilled and lost"));
                    }
                }
            }
            if holes != expected {
                return bad(format!(
                    "request {r}: holes {holes:?}, spilled or lost {expected:?}"
                ));
            }
            if holes
                .last()
                .is_some_and(|&p| p >= inner.space.pages_for(tokens))
            {
                return bad(format!("request {r} has a hole past its {tokens} tokens"));
            }
            for (&p, ids) in &q.spilled {
                let want = 2 * self.config.layers as usize * self.used_chunks(p, tokens) as usize;
                if ids.len() != want {
                    return bad(format!(
                        "request {r} block {p}: {} objects, {want} expected",
                        ids.len()
                    ));
                }
                for &id in ids {
                    let res = self.store.residency(id)?;
                    if res.host.is_none() && res.disk.is_none() {
                        return bad(format!("request {r} block {p}: {id} has no lower copy"));
                    }
                }
            }
            let whole = 2 * self.config.layers as usize * self.chunks as usize;
            for (&p, ids) in &q.clean {
                if holes.contains(&p) || !self.is_full(p, tokens) {
                    return bad(format!(
                        "request {r} block {p} is clean but not resident and full"
                    ));
                }
                if ids.len() != whole {
                    return bad(format!(
                        "request {r} clean block {p}: {} objects, {whole} expected",
                        ids.len()
                    ));
                }
                for &id in ids {
                    // Dropped by the store for room (lost) is fine; stale is not.
                    match self.store.residency(id) {
                        Ok(_) | Err(Error::InvalidState(_)) => {}
                        Err(e) => return bad(format!("request {r} clean block {p}: {e}")),
                    }
                }
            }
        }
        drop(inner);
        self.store.check_invariants()
    }
}
