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
//!   is restored (its *clean copy*, redundant in the store). A copy restored from disk moves
//!   into a free host slot on the way up, as TierKV keeps the DRAM copy, and stays on disk
//!   when none is free. Other blocks release theirs. Spilling a block with a clean copy copies nothing: after the copies
//!   into it, its pages are evicted and the copy becomes its spilled copy; a revocation takes
//!   such blocks first and loses nothing (they become spilled, not lost). Writing a block
//!   through [`KvBlockManager::write_kv`] drops its clean copy (an engine's kernels never
//!   rewrite a full block), and so do `release` and drop.
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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_allocator::{Kind, KvConfig, KvSpace, Page, SlotId};
use strata_vmm::{record_deferred, DevicePtr, Error, Event, Reservation, Result};

use crate::object::{ObjectId, Tier};
use crate::policy::{plan_prefetch, EvictionPolicy, Links, Lookahead};
use crate::store::TierStore;
use crate::Durability;

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
    /// Pool pages handed to lenders by [`KvBlockManager::revoke`], ever.
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

    /// Writes tokens `first_token..` of `r` (whole tokens of `data`, already appended) in the
    /// `kind` tensor of `layer` with a backend copy, after the last copy into the request: the
    /// host-side path for tests and CPU engines. Their blocks must be resident.
    pub fn write_kv(
        &self,
        r: RequestId,
        layer: u32,
        kind: Kind,
        first_token: u32,
        data: &[u8],
    ) -> Result<()> {
        let mut inner = self.inner.lock();
        let Inner { space, reqs, .. } = &mut *inner;
        let q = reqs.get_mut(&r.0).ok_or(unknown(r))?;
        let (ptr, range) = self.span(space, q, layer, kind, first_token, data.len())?;
        for p in self.blocks_of(&range) {
            if !space.is_resident(q.slot, p)? {
                return Err(Error::InvalidState(format!(
                    "block {p} of request {} is not resident: make_resident before writing",
                    r.0
                )));
            }
        }
        if let Some(ev) = &q.ready {
            ev.synchronize()?;
        }
        // The bytes change: their clean copies would be stale.
        for p in self.blocks_of(&range) {
            if let Some(ids) = q.clean.remove(&p) {
                self.release_objects(&ids);
            }
        }
        self.store.backend().write(ptr + range.start, data)
    }

    /// Reads tokens `first_token..` of `r` (whole tokens of `out`) in the `kind` tensor of
    /// `layer`, from wherever each block is: the device (after the last copy into it) or its
    /// store objects. Returns the slowest tier read. Lost blocks are [`Error::InvalidState`].
    pub fn read_kv(
        &self,
        r: RequestId,
        layer: u32,
        kind: Kind,
        first_token: u32,
        out: &mut [u8],
    ) -> Result<Tier> {
        let inner = self.inner.lock();
        let q = get(&inner.reqs, r)?;
        let (ptr, range) = self.span(&inner.space, q, layer, kind, first_token, out.len())?;
        let tensor = (layer as usize) * 2 + usize::from(kind == Kind::V);
        let block = self.store.block_size();
        let mut slowest = Tier::Hbm;
        let mut chunk = strata_vmm::try_host_vec(block)?;
        let mut at = range.start;
        while at < range.end {
            let p = (at / self.page) as usize;
            let end = range.end.min((p as u64 + 1) * self.page);
            let dst = &mut out[(at - range.start) as usize..(end - range.start) as usize];
            if let Some(ids) = q.spilled.get(&p) {
                // One store object per chunk of the page.
                let per_tensor = ids.len() / (2 * self.config.layers as usize);
                let mut pos = at;
                while pos < end {
                    let within = pos - p as u64 * self.page;
                    let c = (within / block) as usize;
                    let stop = end.min(p as u64 * self.page + (c as u64 + 1) * block);
                    let tier = self.store.read(ids[tensor * per_tensor + c], &mut chunk)?;
                    slowest = slowest.max(tier);
                    let from = (within % block) as usize;
                    let n = (stop - pos) as usize;
                    dst[(pos - at) as usize..(pos - at) as usize + n]
                        .copy_from_slice(&chunk[from..from + n]);
                    pos = stop;
                }
            } else if inner.space.is_resident(q.slot, p)? {
                if let Some(ev) = &q.ready {
                    ev.synchronize()?;
                }
                self.store.backend().read(ptr + at, dst)?;
            } else {
                return Err(lost_first(r.0));
            }
            at = end;
        }
        Ok(slowest)
    }

    /// The slot address of tensor `(layer, kind)` and the byte range of `len` bytes of whole
    /// tokens from `first_token`, checked against the request's tokens.
    fn span(
        &self,
        space: &KvSpace,
        q: &Req,
        layer: u32,
        kind: Kind,
        first_token: u32,
        len: usize,
    ) -> Result<(DevicePtr, Range<u64>)> {
        let bpt = self.config.bytes_per_token;
        let ptr = space.slot_ptr(q.slot, layer, kind)?;
        let start = u64::from(first_token) * bpt;
        let end = start + len as u64;
        let tokens = u64::from(space.tokens(q.slot)?);
        if len == 0 || len as u64 % bpt != 0 || end > tokens * bpt {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes from token {first_token} are not whole tokens within the request's {tokens}"
            )));
        }
        Ok((ptr, start..end))
    }

    fn blocks_of(&self, range: &Range<u64>) -> Range<usize> {
        (range.start / self.page) as usize..range.end.div_ceil(self.page) as usize
    }

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
    /// requests in neither go first. Replaces the previous queue.
    pub fn queue(&self, waiting: &[RequestId]) {
        let owners: Vec<u64> = waiting.iter().map(|r| r.0).collect();
        self.store.queue(&owners);
        self.inner.lock().lookahead.queue(&owners);
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

    /// Makes every block of `batch` resident: maps pages behind its spilled and lost blocks
    /// (spilling requests outside the batch, furthest next use first, while the pool is short)
    /// and copies the spilled bytes back. Wait for the event before the kernels read (it also
    /// covers earlier prefetches of these requests). All or nothing: on error (out of memory
    /// when the batch does not fit; [`Error::InvalidState`] while a request has unreported lost
    /// blocks; [`Error::StaleId`]) no block of the batch changed residency.
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
        for &r in &keep {
            self.touch(&mut inner, r, step);
        }
        let before = inner.stats.restores;
        let brought = self.bring_in(&mut inner, &wanted, &keep, false)?;
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
    fn with_room<T>(
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
    fn victim(
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

    /// Moves the resident blocks of `r` down and evicts their pages: blocks with an intact clean
    /// copy copy nothing; the others are copied (all layers, K and V; only the chunks its tokens
    /// fill). With `to == Tier::Disk` its spilled objects then move to disk. Returns the blocks
    /// spilled; on error every block stays resident.
    fn spill(&self, inner: &mut Inner, r: u64, to: Tier) -> Result<usize> {
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

    pub fn stats(&self) -> KvBlocksStats {
        let inner = self.inner.lock();
        let mut s = inner.stats;
        for q in inner.reqs.values() {
            let n = inner
                .space
                .tokens(q.slot)
                .map_or(0, |t| inner.space.pages_for(t)) as u64;
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

impl Drop for KvBlockManager {
    /// Waits for the copies into the space (its pages are unmapped next) and releases the
    /// spilled objects of requests still live.
    fn drop(&mut self) {
        if let Err(e) = self.store.synchronize() {
            record_deferred(e);
        }
        for q in self.inner.get_mut().reqs.values() {
            for &id in q.spilled.values().chain(q.clean.values()).flatten() {
                let _ = self.store.release(id);
            }
        }
    }
}
