//! [`KvBlockManager`]: KV blocks of requests for an engine, on a [`TierStore`].
//!
//! Each request's KV lives in fixed-size blocks (`tokens_per_block` tokens of `bytes_per_token`
//! bytes) stored as `Lossy` objects owned by the request (KV can be recomputed). The engine admits
//! a request, appends tokens, hints which requests run in the next steps (lookahead: the policies
//! evict the blocks of the request that runs furthest away, and blocks that fit the compute
//! window by TierKV Eq. 1 are prefetched), makes a batch resident (an event to wait on) and
//! releases. Blocks of paused or long-idle requests spill down the tiers and come back ahead of
//! use. Blocks lost to a revocation are reported per request: the engine recomputes them.
//!
//! Not yet wired to `KvSpace`'s virtual tensors: blocks live in the store's own HBM slots. The
//! page-range residency this needs now exists (`KvSpace::evict_pages` / `KvSpace::restore_pages`:
//! holes inside a slot at fixed addresses); moving the manager onto it is the follow-up.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_vmm::{Error, Event, Result};

use crate::object::{Notice, ObjectId, Tier};
use crate::policy::{plan_prefetch, Links};
use crate::store::TierStore;
use crate::Durability;

/// A request of the block manager. Ids are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Shape and prefetch window of a [`KvBlockManager`].
#[derive(Clone, Debug)]
pub struct KvBlocksConfig {
    pub tokens_per_block: u32,
    pub bytes_per_token: u64,
    /// `T_iter^(k)` for the lookahead window (Eq. 1), one per hinted step.
    pub t_iter: Duration,
    /// δ_sched of Eq. 1.
    pub delta_sched: Duration,
    /// Link terms for Algorithm 1.
    pub links: Links,
}

struct Req {
    blocks: Vec<ObjectId>,
    tokens: u32,
    /// The bytes of the last, partly filled block (appends rewrite it whole).
    tail: Vec<u8>,
    last_step: u64,
}

struct Inner {
    reqs: HashMap<u64, Req>,
    next: u64,
    step: u64,
}

/// Counters of a block manager.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvBlocksStats {
    pub requests: u64,
    pub blocks: u64,
    pub lost_blocks: u64,
    pub spilled_blocks: u64,
    pub hinted_prefetches: u64,
}

/// See the module documentation.
pub struct KvBlockManager {
    store: Arc<TierStore>,
    config: KvBlocksConfig,
    block_bytes: u64,
    inner: Mutex<Inner>,
    lost: Arc<Mutex<HashMap<u64, HashSet<ObjectId>>>>,
    counters: Mutex<KvBlocksStats>,
}

fn unknown(r: RequestId) -> Error {
    Error::StaleId {
        kind: "kv request",
        index: r.0 as u32,
        generation: (r.0 >> 32) as u32,
    }
}

impl KvBlockManager {
    /// A manager on `store` (whose block size must equal `tokens_per_block × bytes_per_token`).
    /// Takes over the store's revocation callback.
    pub fn new(store: Arc<TierStore>, config: KvBlocksConfig) -> Result<Self> {
        let block_bytes = u64::from(config.tokens_per_block) * config.bytes_per_token;
        if block_bytes != store.block_size() || block_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "{} tokens × {} bytes per block does not match the store's {}-byte blocks",
                config.tokens_per_block,
                config.bytes_per_token,
                store.block_size()
            )));
        }
        let lost: Arc<Mutex<HashMap<u64, HashSet<ObjectId>>>> = Arc::default();
        let l2 = Arc::clone(&lost);
        store.set_callback(move |n| {
            if let Notice::Lost { id, owner } = n {
                l2.lock().entry(owner).or_default().insert(id);
            }
        });
        Ok(KvBlockManager {
            store,
            config,
            block_bytes,
            inner: Mutex::new(Inner {
                reqs: HashMap::new(),
                next: 1,
                step: 0,
            }),
            lost,
            counters: Mutex::new(KvBlocksStats::default()),
        })
    }

    pub fn store(&self) -> &Arc<TierStore> {
        &self.store
    }

    /// Admits a request with no tokens.
    pub fn admit(&self) -> RequestId {
        let mut inner = self.inner.lock();
        let id = inner.next;
        inner.next += 1;
        let step = inner.step;
        inner.reqs.insert(
            id,
            Req {
                blocks: Vec::new(),
                tokens: 0,
                tail: Vec::new(),
                last_step: step,
            },
        );
        self.counters.lock().requests += 1;
        RequestId(id)
    }

    /// Tokens of a request.
    pub fn tokens(&self, r: RequestId) -> Result<u32> {
        Ok(self.inner.lock().reqs.get(&r.0).ok_or(unknown(r))?.tokens)
    }

    /// The request's blocks, in token order.
    pub fn blocks(&self, r: RequestId) -> Result<Vec<ObjectId>> {
        Ok(self
            .inner
            .lock()
            .reqs
            .get(&r.0)
            .ok_or(unknown(r))?
            .blocks
            .clone())
    }

    /// Blocks of `r` lost to revocations since the last call (the engine recomputes them).
    pub fn take_lost(&self, r: RequestId) -> Vec<ObjectId> {
        let mut v: Vec<_> = self
            .lost
            .lock()
            .remove(&r.0)
            .unwrap_or_default()
            .into_iter()
            .collect();
        v.sort_unstable();
        v
    }

    /// Appends tokens (`data.len()` a multiple of `bytes_per_token`): fills the tail block and
    /// adds blocks as needed. Fails with [`Error::InvalidState`] while the request has lost blocks.
    pub fn append(&self, r: RequestId, data: &[u8]) -> Result<()> {
        let bpt = self.config.bytes_per_token as usize;
        if data.is_empty() || data.len() % bpt != 0 {
            return Err(Error::InvalidArgument(format!(
                "append of {} bytes is not whole tokens of {bpt} bytes",
                data.len()
            )));
        }
        if self.lost.lock().get(&r.0).is_some_and(|s| !s.is_empty()) {
            return Err(Error::InvalidState(format!(
                "request {} lost KV blocks to a revocation: recompute first",
                r.0
            )));
        }
        let mut inner = self.inner.lock();
        let step = inner.step;
        let req = inner.reqs.get_mut(&r.0).ok_or(unknown(r))?;
        req.last_step = step;
        let block = self.block_bytes as usize;
        let mut rest = data;
        while !rest.is_empty() {
            let room = block - req.tail.len();
            let n = room.min(rest.len());
            req.tail.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            let fresh = req.tail.len() == n; // this chunk started a new block
            if fresh {
                let id = self.store.put(&req.tail, Durability::Lossy, r.0)?;
                req.blocks.push(id);
                self.counters.lock().blocks += 1;
            } else if let Some(&id) = req.blocks.last() {
                self.store.write(id, &req.tail)?;
            }
            req.tokens += (n / bpt) as u32;
            if req.tail.len() == block {
                req.tail.clear();
            }
        }
        Ok(())
    }

    /// Moves to `step` (the policies' clock).
    pub fn advance(&self, step: u64) {
        self.inner.lock().step = step;
        self.store.advance(step);
    }

    /// Scheduler lookahead: the requests of each of the next K steps. The policies learn who
    /// runs when; blocks of those requests that fit the compute window (Eq. 1, Algorithm 1) are
    /// prefetched now. Returns the prefetch's event, if any block moved.
    pub fn hint(&self, next_steps: &[Vec<RequestId>]) -> Result<Option<Arc<Event>>> {
        let owners: Vec<Vec<u64>> = next_steps
            .iter()
            .map(|s| s.iter().map(|r| r.0).collect())
            .collect();
        self.store.schedule(&owners);
        let t_iter = vec![self.config.t_iter; next_steps.len()];
        let mut candidates = Vec::new();
        {
            let inner = self.inner.lock();
            for r in next_steps.iter().flatten() {
                if let Some(req) = inner.reqs.get(&r.0) {
                    for &b in &req.blocks {
                        if let Ok(res) = self.store.residency(b) {
                            if let Some(t) = res.fastest() {
                                candidates.push((b.key(), t));
                            }
                        }
                    }
                }
            }
        }
        let plan = plan_prefetch(
            &candidates,
            self.block_bytes,
            self.config.links,
            &t_iter,
            self.config.delta_sched,
        );
        if plan.is_empty() {
            return Ok(None);
        }
        let ids: Vec<ObjectId> = plan.iter().map(|&(k, _)| ObjectId::from_key(k)).collect();
        match self.store.prefetch(&ids) {
            Ok(ev) => {
                self.counters.lock().hinted_prefetches += ids.len() as u64;
                Ok(Some(ev))
            }
            // A hint is advice: a full HBM tier is not an error for it.
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Makes every block of `batch` resident in HBM; wait for the event before the kernels read.
    pub fn make_resident(&self, batch: &[RequestId]) -> Result<Arc<Event>> {
        let mut ids = Vec::new();
        {
            let mut inner = self.inner.lock();
            let step = inner.step;
            for r in batch {
                if self.lost.lock().get(&r.0).is_some_and(|s| !s.is_empty()) {
                    return Err(Error::InvalidState(format!(
                        "request {} lost KV blocks to a revocation: recompute first",
                        r.0
                    )));
                }
                let req = inner.reqs.get_mut(&r.0).ok_or(unknown(*r))?;
                req.last_step = step;
                ids.extend_from_slice(&req.blocks);
            }
        }
        self.store.prefetch(&ids)
    }

    /// Spills a paused request's blocks to host memory (or `to`).
    pub fn pause(&self, r: RequestId, to: Tier) -> Result<()> {
        let blocks = self.blocks(r)?;
        self.store.spill(&blocks, to)?;
        self.counters.lock().spilled_blocks += blocks.len() as u64;
        Ok(())
    }

    /// Spills the blocks of requests idle for more than `idle_steps` steps to `to`.
    pub fn spill_idle(&self, idle_steps: u64, to: Tier) -> Result<usize> {
        let idle: Vec<ObjectId> = {
            let inner = self.inner.lock();
            inner
                .reqs
                .values()
                .filter(|q| q.last_step + idle_steps < inner.step)
                .flat_map(|q| q.blocks.iter().copied())
                .filter(|&b| {
                    self.store.residency(b).is_ok_and(|res| {
                        res.fastest() == Some(Tier::Hbm) || (to == Tier::Disk && res.host.is_some())
                    })
                })
                .collect()
        };
        if !idle.is_empty() {
            self.store.spill(&idle, to)?;
        }
        self.counters.lock().spilled_blocks += idle.len() as u64;
        Ok(idle.len())
    }

    /// Releases a request and all its blocks (lost ones included). Unknown: [`Error::StaleId`].
    pub fn release(&self, r: RequestId) -> Result<()> {
        let req = self.inner.lock().reqs.remove(&r.0).ok_or(unknown(r))?;
        let lost = self.lost.lock().remove(&r.0).unwrap_or_default();
        self.counters.lock().lost_blocks += lost.len() as u64;
        let mut first = None;
        for b in req.blocks {
            if let Err(e) = self.store.release(b) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    pub fn stats(&self) -> KvBlocksStats {
        *self.counters.lock()
    }
}
