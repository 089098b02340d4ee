//! [`KvBlockManager`]: the KV cache of an engine's requests on a [`KvSpace`], spilling down the
//! host and disk tiers of a [`TierStore`].
//!
//! Each request is a slot of a `KvSpace` (per-layer K and V virtual tensors). The engine reads
//! and writes a request's KV at [`KvBlockManager::kv_ptr`]: addresses that never change while the
//! request lives, spilled or not (vAttention-style virtual memory; kernels and CUDA graphs may
//! bake them in). A *block* of a request is one page index of its slot across all `2 × layers`
//! tensors (`page_size / bytes_per_token` tokens); it is the unit of residency.
//!
//! - **Spill** (pause, idle, memory pressure): the tokens of each resident block, in every tensor,
//!   are copied to new `Lossy` store objects in host memory (or on disk) with backend copies
//!   ([`TierStore::put_from_device`]); once the copy's event completed,
//!   [`KvSpace::evict_pages`] returns the physical pages to the pool and the zero page goes
//!   back behind the addresses.
//! - **Make resident**: [`KvSpace::restore_pages`] maps fresh pool pages at the same addresses and
//!   [`TierStore::copy_to_device`] copies the bytes back; the returned event orders the engine's
//!   reads after those copies. When the pool is short, the request that runs furthest away in
//!   the hinted schedule spills first ([`Lookahead`]); requests used in the current step
//!   ([`KvBlockManager::advance`] moves it) are never chosen.
//! - **Clean copies**: a block is *full* when every token slot of its page is written; appends
//!   only go past it, so its bytes never change. A full block keeps its store objects when it
//!   is restored (its *clean copy*, redundant in the store). A copy restored from disk also
//!   lands in a free host slot on the way up, as TierKV keeps the DRAM copy, and keeps its
//!   disk copy (so that host copy can go again without a write). Other blocks release theirs.
//!   Spilling a block with a clean copy copies nothing: after the copies into it, its pages
//!   are evicted and the copy becomes its spilled copy; a revocation takes such blocks first
//!   and loses nothing (they become spilled, not lost). Writing a block through
//!   [`KvBlockManager::write_kv`] drops its clean copy (an engine's kernels never rewrite a
//!   full block), and so do `release` and drop.
//! - **Clean copies under pressure**: they are redundant, so the store drops them first when the
//!   host tier (or the disk tier) is full, before it moves a sole copy to disk or fails a spill.
//!   A dropped clean copy is no loss while the block is resident: the block is just no longer
//!   clean, and its next spill copies it. The check happens atomically when the copy is needed
//!   ([`TierStore::set_redundant`] with `false` before evicting the pages); once spilled, the
//!   objects are the block's only copy and are never dropped for room.
//! - **Hint** (lookahead): spilled blocks of the requests in the next K steps whose transfer fits
//!   the compute window (TierKV Eq. 1, Algorithm 1: [`plan_prefetch`]) come back now, evicting
//!   only requests that run later.
//! - **Revoke**: a lender takes pool pages back (Harvest's order): free capacity first, then
//!   blocks of the requests running furthest away, without copying them: clean blocks first
//!   (they become spilled), then others, which are lost (KV is reconstructible), reported once
//!   per request ([`KvBlockManager::take_lost`]), and mapped fresh by the next `make_resident`
//!   for the engine to recompute.
//!
//! All bookkeeping sits behind one lock and every copy starts under it, so a revocation holding
//! it stops new copies, waits for the in-flight copies into the pages it takes (events), and only
//! then unmaps them. The engine synchronizes its own work on a request's KV before spilling,
//! pausing or releasing it (as for [`KvSpace::evict_pages`]).
//!
//! [`plan_prefetch`]: crate::policy::plan_prefetch

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_allocator::{Kind, KvConfig, KvSpace, Page, SlotId};
use strata_vmm::{record_deferred, DevicePtr, Error, Event, Reservation, Result};

use crate::object::{ObjectId, Tier};
use crate::policy::{EvictionPolicy, Links, Lookahead};
use crate::store::TierStore;

mod access;
mod check;
mod copy;
mod residency;
mod revoke;
mod spill;

pub use copy::{TokenCopy, TokenCopyDirection};

/// A request of the block manager. Ids are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Shape and prefetch window of a [`KvBlockManager`].
#[derive(Clone, Debug)]
pub struct KvBlocksConfig {
    /// Layers (each has a K and a V tensor).
    pub layers: u32,
    /// Most requests live at once (slots of the `KvSpace`).
    pub max_requests: u32,
    /// Most tokens of one request.
    pub max_tokens: u32,
    /// Bytes of one token in one tensor (one layer, K or V); must divide the page size.
    pub bytes_per_token: u64,
    /// `T_iter^(k)` for the lookahead window (Eq. 1), one per hinted step.
    pub t_iter: Duration,
    /// δ_sched of Eq. 1.
    pub delta_sched: Duration,
    /// Link terms for Algorithm 1.
    pub links: Links,
    /// Back the addresses of holes (spilled, lost, not yet appended) with the shared read-only
    /// zero page ([`KvConfig::zero_page`]), so that kernels reading padded ranges never fault.
    pub zero_page: bool,
}

/// Counters of a block manager ("blocks" as in the module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvBlocksStats {
    /// Requests admitted, ever.
    pub requests: u64,
    /// Blocks of the live requests now (resident, spilled or lost).
    pub blocks: u64,
    /// Requests live now, and their tokens.
    pub live_requests: u64,
    pub tokens: u64,
    /// Of those, blocks backed by pool pages now.
    pub blocks_resident: u64,
    /// Of those, blocks whose bytes live in the store now.
    pub blocks_spilled: u64,
    /// Of those, resident blocks holding a clean copy now (the store may have dropped some of
    /// those copies since: [`KvBlockManager::clean_blocks`] checks).
    pub blocks_clean: u64,
    /// Blocks copied down to the store, ever.
    pub spills: u64,
    /// Blocks spilled without a copy (their clean copy became the spilled copy), ever.
    pub clean_spills: u64,
    /// Blocks revoked without loss (their clean copy became the spilled copy), ever.
    pub clean_revocations: u64,
    /// Blocks copied back from the store, ever (hinted prefetches included).
    pub restores: u64,
    /// Blocks brought back by lookahead hints, ever.
    pub hinted_prefetches: u64,
    /// Blocks [`KvBlockManager::make_resident`] had to copy back itself (no hint had brought
    /// them in ahead: prefetch misses), ever.
    pub demand_restores: u64,
    /// `make_resident` calls that copied at least one block back (the step waits), ever.
    pub stalls: u64,
    /// Requests spilled to make room (memory pressure), ever.
    pub evictions: u64,
    /// Blocks lost to revocations, ever.
    pub lost_blocks: u64,
    /// Pool pages that revocations ([`KvBlockManager::revoke`], `revoke_spilling`) took from
    /// the space (unmapped), ever; free pool pages and pages the device still had take nothing
    /// from it and count nothing.
    pub pages_revoked: u64,
}

/// What a revocation did.
#[derive(Debug, Default)]
pub struct KvRevocation {
    /// The pages taken back, unmapped, for the lender.
    pub pages: Vec<Page>,
    /// Blocks lost, per request (also reported once by [`KvBlockManager::take_lost`]).
    pub lost: Vec<(RequestId, Vec<usize>)>,
}

struct Req {
    slot: SlotId,
    /// Spilled blocks: block → its store objects, tensor-major (`layer × 2 + kind`), then the
    /// block's used chunks in order.
    spilled: BTreeMap<usize, Vec<ObjectId>>,
    /// Resident full blocks with a clean copy: block → its store objects (redundant in the
    /// store), in the order of `spilled`.
    clean: BTreeMap<usize, Vec<ObjectId>>,
    /// Blocks lost to a revocation and not yet reported.
    lost_unreported: BTreeSet<usize>,
    /// Blocks lost and reported: the next `make_resident` maps fresh pages for them.
    lost_reported: BTreeSet<usize>,
    /// The last copy into the slot; spills, revocations and host-side access wait for it.
    ready: Option<Arc<Event>>,
    last_step: u64,
}

impl Req {
    fn holes(&self) -> usize {
        self.spilled.len() + self.lost_unreported.len() + self.lost_reported.len()
    }
}

struct Inner {
    space: KvSpace,
    reqs: HashMap<u64, Req>,
    next: u64,
    step: u64,
    /// Keys and owners are request ids: the request running furthest away is evicted first.
    lookahead: Lookahead,
    stats: KvBlocksStats,
}

/// See the module documentation.
pub struct KvBlockManager {
    store: Arc<TierStore>,
    config: KvBlocksConfig,
    page: u64,
    /// Store objects per tensor page.
    chunks: u64,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for KvBlockManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBlockManager")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

fn unknown(r: RequestId) -> Error {
    Error::StaleId {
        kind: "kv request",
        index: r.0 as u32,
        generation: (r.0 >> 32) as u32,
    }
}

fn lost_first(r: u64) -> Error {
    Error::InvalidState(format!(
        "request {r} lost KV blocks to a revocation: take_lost, then recompute them"
    ))
}

/// Maximal runs of consecutive values of an ascending list.
fn runs(sorted: &[usize]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for &p in sorted {
        match out.last_mut() {
            Some(run) if run.end == p => run.end += 1,
            _ => out.push(p..p + 1),
        }
    }
    out
}

fn get(reqs: &HashMap<u64, Req>, r: RequestId) -> Result<&Req> {
    reqs.get(&r.0).ok_or(unknown(r))
}

fn resident_blocks(space: &KvSpace, q: &Req) -> Result<Vec<usize>> {
    let n = space.pages_for(space.tokens(q.slot)?);
    let mut out = Vec::with_capacity(n);
    for p in 0..n {
        if space.is_resident(q.slot, p)? {
            out.push(p);
        }
    }
    Ok(out)
}

impl KvBlockManager {
    /// A manager whose `KvSpace` takes its pages from `store`'s pool (the device's one pool, so
    /// a lender or MIRAGE sees one HBM budget) and whose spilled blocks live in `store`'s host
    /// and disk tiers (its HBM slots, if any, are not used). The store's block size is the
    /// copy unit; it must divide the page size (it always does) and so must `bytes_per_token`.
    pub fn new(store: Arc<TierStore>, config: KvBlocksConfig) -> Result<Self> {
        let page = store.pool().page_size();
        let bpt = config.bytes_per_token;
        if bpt == 0 || page % bpt != 0 {
            return Err(Error::InvalidArgument(format!(
                "{bpt} bytes per token must divide the {page}-byte page"
            )));
        }
        let space = KvSpace::new(
            Arc::clone(store.pool()),
            KvConfig {
                layers: config.layers,
                max_slots: config.max_requests,
                max_tokens: config.max_tokens,
                bytes_per_token: bpt,
                zero_page: config.zero_page,
            },
        )?;
        Ok(KvBlockManager {
            chunks: page / store.block_size(),
            page,
            config,
            inner: Mutex::new(Inner {
                space,
                reqs: HashMap::new(),
                next: 1,
                step: 0,
                lookahead: Lookahead::default(),
                stats: KvBlocksStats::default(),
            }),
            store,
        })
    }

    pub fn store(&self) -> &Arc<TierStore> {
        &self.store
    }

    pub fn config(&self) -> &KvBlocksConfig {
        &self.config
    }

    /// Tokens per block (`page_size / bytes_per_token`).
    pub fn tokens_per_block(&self) -> u32 {
        (self.page / self.config.bytes_per_token) as u32
    }

    /// Bytes of one block in all tensors together (`2 × layers` pages).
    pub fn block_bytes(&self) -> u64 {
        2 * u64::from(self.config.layers) * self.page
    }

    /// Start of the `kind` tensor of `layer` (fixed for the life of the manager): request slot
    /// `i` starts at `+ i × slot_stride`, token `t` of it at `+ t × bytes_per_token`.
    pub fn tensor_ptr(&self, layer: u32, kind: Kind) -> Result<DevicePtr> {
        if layer >= self.config.layers {
            return Err(Error::InvalidArgument(format!(
                "kv layer {layer} out of range (layers: {})",
                self.config.layers
            )));
        }
        Ok(self.inner.lock().space.tensor_ptr(layer, kind))
    }

    /// Bytes between two request slots of a tensor.
    pub fn slot_stride(&self) -> u64 {
        self.inner.lock().space.slot_stride()
    }

    /// The slot of `r` in every tensor (its index along the first axis).
    pub fn slot_index(&self, r: RequestId) -> Result<u32> {
        let inner = self.inner.lock();
        Ok(get(&inner.reqs, r)?.slot.index())
    }

    fn tensors(&self) -> impl Iterator<Item = (u32, Kind)> {
        (0..self.config.layers).flat_map(|l| [(l, Kind::K), (l, Kind::V)])
    }

    /// Every tensor's reservation: the copy scope of the block copies.
    fn scope<'a>(&self, space: &'a KvSpace) -> Vec<&'a Reservation> {
        self.tensors()
            .map(|(l, k)| &**space.tensor_reservation(l, k))
            .collect()
    }

    /// Store objects of each tensor that block `p` of a request with `tokens` tokens fills.
    fn used_chunks(&self, p: usize, tokens: u32) -> u64 {
        let start = p as u64 * self.page;
        let used = (u64::from(tokens) * self.config.bytes_per_token)
            .saturating_sub(start)
            .min(self.page);
        used.div_ceil(self.store.block_size()).min(self.chunks)
    }

    /// Whether every token slot of block `p` is written in a request with `tokens` tokens.
    fn is_full(&self, p: usize, tokens: u32) -> bool {
        u64::from(tokens) * self.config.bytes_per_token >= (p as u64 + 1) * self.page
    }

    /// A spill that failed after claiming the clean copies of `claimed` blocks: they are
    /// redundant again (still clean, so they go first under pressure).
    fn unclaim(&self, q: &Req, claimed: &[usize]) {
        for p in claimed {
            if let Err(e) = self.store.set_redundant(&q.clean[p], true) {
                record_deferred(e);
            }
        }
    }

    /// Releases store objects the manager no longer holds (a failure is a bug: recorded).
    fn release_objects(&self, ids: &[ObjectId]) {
        for &id in ids {
            if let Err(e) = self.store.release(id) {
                record_deferred(e);
            }
        }
    }

    /// Device addresses of the first `chunks` store blocks of block `p` in every tensor,
    /// tensor-major (the order of [`Req::spilled`]).
    fn block_addrs(
        &self,
        space: &KvSpace,
        slot: SlotId,
        p: usize,
        chunks: u64,
    ) -> Result<Vec<DevicePtr>> {
        let mut out = Vec::new();
        for (l, k) in self.tensors() {
            let base = space.slot_ptr(slot, l, k)? + p as u64 * self.page;
            out.extend((0..chunks).map(|c| base + c * self.store.block_size()));
        }
        Ok(out)
    }

    /// Admits a request with no tokens. No free slot is [`Error::InvalidState`].
    pub fn admit(&self) -> Result<RequestId> {
        let mut inner = self.inner.lock();
        let slot = inner.space.admit()?;
        let id = inner.next;
        inner.next += 1;
        let step = inner.step;
        inner.reqs.insert(
            id,
            Req {
                slot,
                spilled: BTreeMap::new(),
                clean: BTreeMap::new(),
                lost_unreported: BTreeSet::new(),
                lost_reported: BTreeSet::new(),
                ready: None,
                last_step: step,
            },
        );
        inner.lookahead.touch(id, id, step);
        inner.stats.requests += 1;
        Ok(RequestId(id))
    }

    /// Tokens of a request.
    pub fn tokens(&self, r: RequestId) -> Result<u32> {
        let inner = self.inner.lock();
        inner.space.tokens(get(&inner.reqs, r)?.slot)
    }

    /// Where each block of `r` is, in order: `Some(Tier::Hbm)` resident, `Some(Tier::Host)` or
    /// `Some(Tier::Disk)` spilled (the slowest tier holding part of it), `None` lost.
    pub fn blocks(&self, r: RequestId) -> Result<Vec<Option<Tier>>> {
        let inner = self.inner.lock();
        let q = get(&inner.reqs, r)?;
        let n = inner.space.pages_for(inner.space.tokens(q.slot)?);
        let mut out = Vec::with_capacity(n);
        for p in 0..n {
            out.push(match q.spilled.get(&p) {
                Some(ids) => Some(self.tier_of(ids)?),
                None if q.lost_unreported.contains(&p) || q.lost_reported.contains(&p) => None,
                None => Some(Tier::Hbm),
            });
        }
        Ok(out)
    }

    /// Blocks of `r` resident with an intact clean copy, ascending: spilling them copies
    /// nothing and a revocation loses nothing (the store drops clean copies first under
    /// pressure; those are not listed).
    pub fn clean_blocks(&self, r: RequestId) -> Result<Vec<usize>> {
        let inner = self.inner.lock();
        let q = get(&inner.reqs, r)?;
        Ok(q.clean
            .iter()
            .filter(|(_, ids)| ids.iter().all(|&id| self.store.residency(id).is_ok()))
            .map(|(&p, _)| p)
            .collect())
    }

    /// The slowest tier holding one of `ids`.
    fn tier_of(&self, ids: &[ObjectId]) -> Result<Tier> {
        let mut tier = Tier::Host;
        for &id in ids {
            if let Some(t) = self.store.residency(id)?.fastest() {
                tier = tier.max(t);
            }
        }
        Ok(tier)
    }

    /// The stable address of `r`'s KV in the `kind` tensor of `layer` (token `i` at
    /// `+ i × bytes_per_token`). Valid until `r` is released; read or write it only while the
    /// blocks touched are resident (after the event of [`KvBlockManager::make_resident`]).
    pub fn kv_ptr(&self, r: RequestId, layer: u32, kind: Kind) -> Result<DevicePtr> {
        let inner = self.inner.lock();
        inner.space.slot_ptr(get(&inner.reqs, r)?.slot, layer, kind)
    }

    /// Blocks of `r` lost to revocations since the last call, ascending: each is reported
    /// exactly once. The next [`KvBlockManager::make_resident`] maps fresh pages for them, whose
    /// bytes the engine recomputes.
    pub fn take_lost(&self, r: RequestId) -> Result<Vec<usize>> {
        let mut inner = self.inner.lock();
        let q = inner.reqs.get_mut(&r.0).ok_or(unknown(r))?;
        let lost = std::mem::take(&mut q.lost_unreported);
        q.lost_reported.extend(lost.iter().copied());
        Ok(lost.into_iter().collect())
    }

    /// Requests with lost blocks not yet reported by [`KvBlockManager::take_lost`], ascending
    /// (after a [`KvBlockManager::revoke`] that failed part way, whose losses stand).
    pub fn requests_with_lost(&self) -> Vec<RequestId> {
        let inner = self.inner.lock();
        let mut out: Vec<RequestId> = inner
            .reqs
            .iter()
            .filter(|(_, q)| !q.lost_unreported.is_empty())
            .map(|(&r, _)| RequestId(r))
            .collect();
        out.sort_unstable();
        out
    }

    /// Appends `tokens` tokens to `r`: maps the pages they need in every tensor (spilling
    /// requests that run furthest away while the pool is short); the engine then writes them at
    /// [`KvBlockManager::kv_ptr`]. The partly filled last block must be resident
    /// ([`Error::InvalidState`] otherwise, as while `r` has unreported lost blocks). Out of
    /// memory leaves `r` as it was.
    pub fn append(&self, r: RequestId, tokens: u32) -> Result<()> {
        let mut inner = self.inner.lock();
        let step = inner.step;
        let q = get(&inner.reqs, r)?;
        if !q.lost_unreported.is_empty() {
            return Err(lost_first(r.0));
        }
        let slot = q.slot;
        let have = inner.space.tokens(slot)?;
        let total = have
            .checked_add(tokens)
            .filter(|_| tokens > 0)
            .filter(|&t| t <= self.config.max_tokens)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "append of {tokens} tokens to {have} (0 tokens, or past max_tokens {})",
                    self.config.max_tokens
                ))
            })?;
        let first = (u64::from(have) * self.config.bytes_per_token / self.page) as usize;
        if let Some(p) = inner
            .space
            .evicted_pages(slot)?
            .into_iter()
            .find(|&p| p >= first)
        {
            return Err(Error::InvalidState(format!(
                "block {p} of request {} is not resident: make_resident before appending",
                r.0
            )));
        }
        self.touch(&mut inner, r.0, step);
        let keep: HashSet<u64> = [r.0].into();
        self.with_room(&mut inner, &keep, None, |space| space.grow(slot, total))
    }

    fn touch(&self, inner: &mut Inner, r: u64, step: u64) {
        if let Some(q) = inner.reqs.get_mut(&r) {
            q.last_step = step;
        }
        inner.lookahead.touch(r, r, step);
    }

    /// Truncates `r` to its first `tokens` tokens (a crop): the pages past them are unmapped and
    /// given back to the pool, the blocks' spilled or clean copies released and their losses
    /// forgotten, after the last copy into `r`; the last kept block keeps its clean copy only
    /// while it is still full. `tokens` above `r`'s length is [`Error::InvalidArgument`] and
    /// changes nothing.
    pub fn truncate(&self, r: RequestId, tokens: u32) -> Result<()> {
        let mut inner = self.inner.lock();
        let q = get(&inner.reqs, r)?;
        let slot = q.slot;
        let have = inner.space.tokens(slot)?;
        if tokens > have {
            return Err(Error::InvalidArgument(format!(
                "truncate of request {} to {tokens} tokens above its {have}",
                r.0
            )));
        }
        if let Some(ev) = &q.ready {
            ev.synchronize()?;
        }
        let kept = inner.space.pages_for(tokens);
        let full = (u64::from(tokens) * self.config.bytes_per_token / self.page) as usize;
        let q = inner.reqs.get_mut(&r.0).ok_or(unknown(r))?;
        let mut released: Vec<ObjectId> =
            q.spilled.split_off(&kept).into_values().flatten().collect();
        released.extend(q.clean.split_off(&full).into_values().flatten());
        // A spilled last block keeps only the chunks its remaining tokens use, in every tensor.
        if let Some(ids) = kept.checked_sub(1).and_then(|p| q.spilled.get_mut(&p)) {
            let tensors = 2 * self.config.layers as usize;
            let (had, keep) = (
                ids.len() / tensors,
                self.used_chunks(kept - 1, tokens) as usize,
            );
            if keep < had {
                let mut chunk = 0;
                ids.retain(|&id| {
                    let stays = chunk % had < keep;
                    chunk += 1;
                    if !stays {
                        released.push(id);
                    }
                    stays
                });
            }
        }
        q.lost_unreported.split_off(&kept);
        q.lost_reported.split_off(&kept);
        let mut first = inner.space.shrink(slot, tokens).err();
        for id in released {
            if let Err(e) = self.store.release(id) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Releases a request: its slot (pages to the next request) and its spilled objects, after
    /// the copies into it. Unknown or released: [`Error::StaleId`].
    pub fn release(&self, r: RequestId) -> Result<()> {
        let mut inner = self.inner.lock();
        let q = inner.reqs.remove(&r.0).ok_or(unknown(r))?;
        inner.lookahead.remove(r.0);
        let mut first = None;
        if let Some(ev) = &q.ready {
            if let Err(e) = ev.synchronize() {
                first.get_or_insert(e);
            }
        }
        for &id in q.spilled.values().chain(q.clean.values()).flatten() {
            if let Err(e) = self.store.release(id) {
                first.get_or_insert(e);
            }
        }
        if let Err(e) = inner.space.free(q.slot) {
            first.get_or_insert(e);
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for KvBlockManager {
    /// Waits for the copies into and out of the space (its pages are unmapped next: the store's,
    /// and each request's last copy, which may be on a caller's stream) and releases the
    /// spilled objects of requests still live.
    fn drop(&mut self) {
        if let Err(e) = self.store.synchronize() {
            record_deferred(e);
        }
        for q in self.inner.get_mut().reqs.values() {
            if let Some(Err(e)) = q.ready.as_ref().map(|ev| ev.synchronize()) {
                record_deferred(e);
            }
        }
        for q in self.inner.get_mut().reqs.values() {
            for &id in q.spilled.values().chain(q.clean.values()).flatten() {
                let _ = self.store.release(id);
            }
        }
    }
}
