//! [`KvSpace`]: vAttention-style KV-cache virtual tensors.
//!
//! # Layout
//!
//! Every layer has a K tensor and a V tensor; each tensor is its own [`Reservation`] of
//! `max_slots × slot_stride` bytes, where `slot_stride = round_up(max_tokens × bytes_per_token,
//! page_size)`. Tensor `t = 2 × layer + kind` (K = 0, V = 1). Slot `s` of a tensor starts at
//! `tensor_ptr + s × slot_stride` and token `i` of that slot at `+ i × bytes_per_token`, so the
//! consecutive tokens of one slot of one layer are contiguous and share pages (a token may straddle
//! a page boundary when `bytes_per_token` does not divide the page size; both pages are then mapped).
//! Reservations never move: kernels and CUDA graphs may bake in every address for the life of the
//! space. One reservation per tensor (rather than one carved into `2 × layers` tensors) keeps each
//! tensor's VA request small and makes "every mapping lies inside its tensor" a property that
//! [`Mapping::new`] itself checks.
//!
//! # Backing
//!
//! Page `p` of slot `s` in a tensor is backed by a real pool page exactly when `p < mapped(s)`
//! and `p` is not a hole (see below), with the same `mapped(s)` and holes for all `2 × layers`
//! tensors. Everything else is unmapped, or, with
//! [`KvConfig::zero_page`], mapped read-only to one shared zero-filled page, so that padded reads
//! and CUDA graphs never fault. A grow takes every page it needs from the pool in one call, maps
//! them and sets access once per tensor over the new contiguous run.
//!
//! # Page-granular residency (holes)
//!
//! [`KvSpace::evict_pages`] unmaps pages of an active slot below its extent in every tensor and
//! gives them back to the pool (with a zero page, the zero page goes back behind them, so padded
//! reads and CUDA graphs still never fault); [`KvSpace::restore_pages`] maps fresh pool pages at
//! the same addresses (one `set_access` per tensor over the run). Such an evicted page is a
//! *hole*: the slot's *extent* `mapped(s)` does not change, and page `p` of slot `s` is backed by
//! a pool page exactly when `p < mapped(s)` and `p` is not a hole of `s`. A restored page's bytes
//! are whatever the pool page held (moving the bytes down and back is the caller's job, with
//! backend copies). Grows back only pages past the extent, never holes; a shrink forgets the holes
//! it cuts off; freeing a slot with holes truncates it to its first hole (unmapping the pages past
//! it) so that a deferred slot never has holes.
//!
//! # Deferred reclamation
//!
//! [`KvSpace::free`] keeps a slot's pages mapped and parks the slot on a deferred list;
//! [`KvSpace::admit`] prefers such a slot, whose mapped capacity is then reused with no driver call
//! (its previous bytes are not cleared). Pages of deferred slots go back to the pool when a grow
//! finds the pool out of memory, or on [`KvSpace::reclaim_deferred`].
//!
//! # Synchronization
//!
//! Unmapping does not wait for in-flight work: before [`KvSpace::shrink`], [`KvSpace::reclaim_deferred`],
//! a [`KvSpace::grow`] that may reclaim deferred slots, or dropping the space, the engine
//! synchronizes the streams that may still touch the affected slots. Library code never
//! dereferences device memory.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use strata_vmm::{
    process_is_exiting, record_deferred, round_up, Access, Backend, CreateFlags, DevicePtr, Error,
    Location, Mapping, PhysicalMemory, Reservation, Result, Stream,
};

use crate::mapped::unmap_pages;
use crate::pool::PagePool;

mod ahead;
mod check;
mod grow_ahead;
mod holes;
mod reclaim;
mod stats;
mod tensor;

pub use grow_ahead::MAP_AHEAD_ENV;
pub use stats::KvStats;
use tensor::{Backing, Counters, Env, Tensor};

/// Which of a layer's two tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Keys.
    K,
    /// Values.
    V,
}

impl Kind {
    fn index(self) -> usize {
        match self {
            Kind::K => 0,
            Kind::V => 1,
        }
    }
}

/// Shape of a [`KvSpace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvConfig {
    /// Number of layers (each has a K and a V tensor).
    pub layers: u32,
    /// Most requests (slots) that can be live at once.
    pub max_slots: u32,
    /// Most tokens (context length) of one slot.
    pub max_tokens: u32,
    /// Bytes of one token in one tensor (one layer, K or V).
    pub bytes_per_token: u64,
    /// Back every unmapped page with one shared, read-only zero page.
    pub zero_page: bool,
}

/// A slot (request) handle. The generation makes a stale id an error, never another request's
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotId {
    index: u32,
    generation: u32,
}

impl SlotId {
    /// Position of the slot in every tensor (`slot_ptr = tensor_ptr + index × slot_stride`).
    pub fn index(self) -> u32 {
        self.index
    }

    /// Generation of the slot when this id was handed out.
    pub fn generation(self) -> u32 {
        self.generation
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Active,
    Deferred,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    generation: u32,
    state: SlotState,
    tokens: u32,
    /// Pages backed by pool pages in each tensor (the same in all of them).
    mapped: usize,
    /// Admitted from the deferred list: may hold more pages than its tokens need, until a shrink.
    reused: bool,
    /// Rows at the top of the extent (`mapped - owed..mapped`) that grows took from the
    /// background mapper and the tables have not filed yet (see "Filing" in `kv/ahead/mod.rs`).
    owed: usize,
}

/// KV-cache virtual tensors for `max_slots` requests of up to `max_tokens` tokens, `layers`
/// layers, K and V, backed on demand by pages of a [`PagePool`]. See the module documentation
/// for layout, zero page and deferred reclamation.
///
/// Owned by one engine thread: every mutation takes `&mut self`; the space is `Send`.
pub struct KvSpace {
    pool: Arc<PagePool>,
    backend: Arc<dyn Backend>,
    location: Location,
    config: KvConfig,
    page: u64,
    slot_stride: u64,
    pages_per_slot: usize,
    tensors: Vec<Tensor>,
    zero: Option<Arc<PhysicalMemory>>,
    slots: Vec<Slot>,
    /// Holes (evicted page indices below `mapped`) of each slot; empty unless the slot is active.
    holes: Vec<BTreeSet<usize>>,
    /// Free slot indices; popped from the end (lowest index first at creation).
    free: Vec<u32>,
    /// Deferred slot indices: admitted from the back (most recently freed), reclaimed from the
    /// front (longest parked).
    deferred: VecDeque<u32>,
    counters: Counters,
    /// The pool's `in_use` when the space was created (see [`KvSpace::check_invariants`]).
    pool_in_use_base: u64,
    /// The background mapper, once [`KvSpace::start_map_ahead`] started it.
    ahead: Option<ahead::MapAhead>,
}

impl std::fmt::Debug for KvSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSpace")
            .field("config", &self.config)
            .field("page", &self.page)
            .field("slot_stride", &self.slot_stride)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Address space one space's tensors may not reach together: x86-64's whole user address space,
/// which CUDA's unified addresses share (beyond it, reserving tensor after tensor would only
/// fail late, after bookkeeping for every page).
const MAX_SPACE_BYTES: u64 = 1 << 47;

/// Most pages of one space's tensors together: each has an entry in the space's tables (and,
/// with the zero page, a mapping from creation on). 2^24 covers a 405B-parameter model's KV of
/// 256 requests of 128K tokens at 2 MiB pages (8.3M) with room to spare.
const MAX_SPACE_PAGES: u64 = 1 << 24;

/// An empty vector with room for `n` entries of bookkeeping sized by the caller's counts: out
/// of host memory is an error, never an abort.
fn with_room<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        location: Location::Host,
        requested: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        available: 0,
    })?;
    Ok(v)
}

/// `n` copies of `value`, in a vector from [`with_room`].
fn try_vec<T: Clone>(n: usize, value: T) -> Result<Vec<T>> {
    let mut v = with_room(n)?;
    v.resize(n, value);
    Ok(v)
}

impl KvSpace {
    /// Reserves the `2 × layers` tensors (and, with [`KvConfig::zero_page`], creates the zero
    /// page, fills it with zeros and maps it read-only behind every page of every tensor: one map
    /// call per page and one `set_access` per tensor). No pool page is taken until a grow. Sizes
    /// that overflow are [`Error::Overflow`]; tensors of 2^47 bytes or more together (x86-64's
    /// whole user address space) are [`Error::OutOfAddressSpace`] before anything is reserved;
    /// more than 2^24 pages in all tensors (each has an entry in the space's tables) are
    /// [`Error::InvalidArgument`]; tables the host cannot hold are [`Error::OutOfMemory`].
    pub fn new(pool: Arc<PagePool>, config: KvConfig) -> Result<KvSpace> {
        if config.layers == 0
            || config.max_slots == 0
            || config.max_tokens == 0
            || config.bytes_per_token == 0
        {
            return Err(invalid(format!(
                "kv config needs non-zero layers, slots, tokens and bytes per token: {config:?}"
            )));
        }
        let page = pool.page_size();
        let backend = Arc::clone(pool.backend());
        let location = Location::Device(pool.device());
        let slot_bytes = u64::from(config.max_tokens)
            .checked_mul(config.bytes_per_token)
            .ok_or(Error::Overflow("kv slot bytes"))?;
        let slot_stride = round_up(slot_bytes, page).ok_or(Error::Overflow("kv slot stride"))?;
        let tensor_bytes = slot_stride
            .checked_mul(u64::from(config.max_slots))
            .ok_or(Error::Overflow("kv tensor bytes"))?;
        let pages_per_slot = usize::try_from(slot_stride / page)
            .map_err(|_| Error::Overflow("kv pages per slot"))?;
        let tensor_pages = pages_per_slot
            .checked_mul(config.max_slots as usize)
            .ok_or(Error::Overflow("kv pages per tensor"))?;
        let n_tensors = (config.layers as usize)
            .checked_mul(2)
            .ok_or(Error::Overflow("kv tensors"))?;
        let space_bytes = tensor_bytes
            .checked_mul(n_tensors as u64)
            .ok_or(Error::Overflow("kv space bytes"))?;
        if space_bytes >= MAX_SPACE_BYTES {
            // Refused before reserving tensor after tensor until the address space runs out.
            return Err(Error::OutOfAddressSpace {
                requested: space_bytes,
            });
        }
        let space_pages = (tensor_pages as u64).saturating_mul(n_tensors as u64);
        if space_pages > MAX_SPACE_PAGES {
            return Err(invalid(format!(
                "a kv space of {space_pages} pages in all its tensors (at most {MAX_SPACE_PAGES})"
            )));
        }
        let pool_in_use_base = pool.stats().in_use as u64;

        let mut space = KvSpace {
            pool,
            backend,
            location,
            config,
            page,
            slot_stride,
            pages_per_slot,
            tensors: with_room(n_tensors)?,
            zero: None,
            slots: try_vec(
                config.max_slots as usize,
                Slot {
                    generation: 0,
                    state: SlotState::Free,
                    tokens: 0,
                    mapped: 0,
                    reused: false,
                    owed: 0,
                },
            )?,
            holes: try_vec(config.max_slots as usize, BTreeSet::new())?,
            free: (0..config.max_slots).rev().collect(),
            deferred: VecDeque::new(),
            counters: Counters::default(),
            pool_in_use_base,
            ahead: None,
        };
        for _ in 0..n_tensors {
            let reservation = Arc::new(Reservation::new(&space.backend, tensor_bytes, page)?);
            let mut pages = with_room(tensor_pages)?;
            pages.resize_with(tensor_pages, || Backing::Unmapped);
            space.tensors.push(Tensor { reservation, pages });
        }
        if config.zero_page {
            space.zero = Some(space.make_zero_page()?);
            let env = Env {
                pool: &space.pool,
                backend: &space.backend,
                location,
                page,
                zero: space.zero.as_ref(),
            };
            let mut returned = Vec::new();
            for tensor in &mut space.tensors {
                tensor.unback(0, tensor_pages, &mut returned, &env, &mut space.counters)?;
            }
        }
        space.map_ahead_from_env()?;
        Ok(space)
    }

    /// One page of device memory, zero-filled through a temporary read-write mapping.
    fn make_zero_page(&mut self) -> Result<Arc<PhysicalMemory>> {
        let device = match self.location {
            Location::Device(d) => d,
            Location::Host => 0,
        };
        let phys = Arc::new(PhysicalMemory::create(
            &self.backend,
            self.location,
            self.page,
            CreateFlags::empty(),
        )?);
        let scratch = Arc::new(Reservation::new(&self.backend, self.page, self.page)?);
        let mapping = Mapping::new(
            &scratch,
            scratch.ptr(),
            Arc::clone(&phys),
            0,
            self.page,
            &[(self.location, Access::ReadWrite)],
        )?;
        self.counters.map_calls += 1;
        self.counters.set_access_calls += 1;
        let stream = Stream::new(&self.backend, device)?;
        self.backend
            .memset_async(stream.handle(), mapping.va(), 0, self.page)?;
        stream.synchronize()?;
        drop(stream);
        self.counters.unmap_calls += 1;
        mapping.unmap()?;
        Ok(phys)
    }

    /// The configuration the space was built with.
    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    /// The pool the pages come from.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    /// Page size (the pool's, the backend's granularity).
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Bytes between the starts of two consecutive slots in a tensor.
    pub fn slot_stride(&self) -> u64 {
        self.slot_stride
    }

    /// Pages per slot per tensor at full context.
    pub fn pages_per_slot(&self) -> usize {
        self.pages_per_slot
    }

    /// Number of tensors (`2 × layers`).
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Start of the K or V tensor of `layer` (fixed for the life of the space).
    ///
    /// # Panics
    ///
    /// When `layer >= config.layers`.
    pub fn tensor_ptr(&self, layer: u32, kind: Kind) -> DevicePtr {
        assert!(layer < self.config.layers, "kv layer {layer} out of range");
        self.tensors[layer as usize * 2 + kind.index()]
            .reservation
            .ptr()
    }

    /// The reservation of the K or V tensor of `layer` (for [`strata_vmm::CopyScope`]: copies
    /// in and out of a slot's pages name it as their scope).
    ///
    /// # Panics
    ///
    /// When `layer >= config.layers`.
    pub fn tensor_reservation(&self, layer: u32, kind: Kind) -> &Arc<Reservation> {
        assert!(layer < self.config.layers, "kv layer {layer} out of range");
        &self.tensors[layer as usize * 2 + kind.index()].reservation
    }

    /// Start of `slot` in the K or V tensor of `layer`.
    pub fn slot_ptr(&self, slot: SlotId, layer: u32, kind: Kind) -> Result<DevicePtr> {
        let index = self.active(slot)?;
        if layer >= self.config.layers {
            return Err(invalid(format!(
                "kv layer {layer} out of range (layers: {})",
                self.config.layers
            )));
        }
        Ok(self.tensor_ptr(layer, kind) + index as u64 * self.slot_stride)
    }

    /// Tokens of an active slot.
    pub fn tokens(&self, slot: SlotId) -> Result<u32> {
        Ok(self.slots[self.active(slot)?].tokens)
    }

    /// Pages backed by pool pages per tensor for an active slot (may exceed what its tokens need
    /// when the slot reused a deferred slot's capacity).
    pub fn mapped_pages(&self, slot: SlotId) -> Result<usize> {
        Ok(self.slots[self.active(slot)?].mapped)
    }

    /// The holes of an active slot: its page indices below its extent that
    /// [`KvSpace::evict_pages`] unmapped and no restore mapped again, ascending.
    pub fn evicted_pages(&self, slot: SlotId) -> Result<Vec<usize>> {
        Ok(self.holes[self.active(slot)?].iter().copied().collect())
    }

    /// Whether page `page` of an active slot is backed by pool pages (below the extent and not a
    /// hole).
    pub fn is_resident(&self, slot: SlotId, page: usize) -> Result<bool> {
        let index = self.active(slot)?;
        Ok(page < self.slots[index].mapped && !self.holes[index].contains(&page))
    }

    /// Pages per tensor that `tokens` tokens occupy.
    pub fn pages_for(&self, tokens: u32) -> usize {
        let bytes = u64::from(tokens.min(self.config.max_tokens)) * self.config.bytes_per_token;
        // Cannot overflow: bounded by the slot stride that `new` computed with checks.
        bytes.div_ceil(self.page) as usize
    }

    /// Index of `slot` if it is active with the same generation, else [`Error::StaleId`].
    fn active(&self, slot: SlotId) -> Result<usize> {
        match self.slots.get(slot.index as usize) {
            Some(s) if s.state == SlotState::Active && s.generation == slot.generation => {
                Ok(slot.index as usize)
            }
            _ => Err(Error::StaleId {
                kind: "kv slot",
                index: slot.index,
                generation: slot.generation,
            }),
        }
    }

    /// Admits a request: the most recently freed deferred slot (its mapped pages are reused
    /// without any driver call; tokens restart at 0), else a free slot. No free slot is
    /// [`Error::InvalidState`].
    pub fn admit(&mut self) -> Result<SlotId> {
        let (index, reused) = if let Some(i) = self.deferred.pop_back() {
            (i, true)
        } else if let Some(i) = self.free.pop() {
            (i, false)
        } else {
            return Err(Error::InvalidState(format!(
                "no free kv slot (all {} active)",
                self.config.max_slots
            )));
        };
        let slot = &mut self.slots[index as usize];
        slot.state = SlotState::Active;
        slot.tokens = 0;
        slot.reused = reused;
        if let Some(ahead) = &self.ahead {
            ahead.admit(index as usize, slot.mapped);
        }
        Ok(SlotId {
            index,
            generation: slot.generation,
        })
    }

    /// Grows `slot` to `tokens` tokens in total (not by `tokens`). Maps just the pages needed
    /// to cover them in every tensor: all of them are taken from the pool in one call; if the pool
    /// is out of memory, deferred slots are reclaimed and the take is retried once. Each tensor
    /// gets one `set_access` over its new contiguous run.
    ///
    /// On any error the slot keeps its previous length and backing (deferred slots may have been
    /// reclaimed). `tokens` beyond `max_tokens` or below the current length is
    /// [`Error::InvalidArgument`].
    pub fn grow(&mut self, slot: SlotId, tokens: u32) -> Result<()> {
        let index = self.active(slot)?;
        if tokens > self.config.max_tokens {
            return Err(invalid(format!(
                "kv grow to {tokens} tokens beyond max_tokens {}",
                self.config.max_tokens
            )));
        }
        let current = self.slots[index];
        if tokens < current.tokens {
            return Err(invalid(format!(
                "kv grow to {tokens} tokens below the current {} (use shrink)",
                current.tokens
            )));
        }
        let need = self.pages_for(tokens);
        if need > current.mapped {
            if self.ahead.is_some() {
                self.grow_ahead(index, current.mapped, need)?;
            } else {
                self.back_slot(index, current.mapped, need)?;
            }
            self.slots[index].mapped = need;
        }
        self.slots[index].tokens = tokens;
        Ok(())
    }

    /// Backs pages `from..to` of slot `index` in every tensor, all or nothing.
    #[cold]
    #[inline(never)]
    fn back_slot(&mut self, index: usize, from: usize, to: usize) -> Result<()> {
        let per_tensor = to - from;
        let total = per_tensor
            .checked_mul(self.tensors.len())
            .ok_or(Error::Overflow("kv grow pages"))?;
        let mut spare = self.take_pages(total)?;
        let base = index * self.pages_per_slot;
        let env = Env {
            pool: &self.pool,
            backend: &self.backend,
            location: self.location,
            page: self.page,
            zero: self.zero.as_ref(),
        };
        let mut failure = None;
        for (t, tensor) in self.tensors.iter_mut().enumerate() {
            if let Err(e) =
                tensor.back_real(base + from, base + to, &mut spare, &env, &mut self.counters)
            {
                failure = Some((t, e));
                break;
            }
        }
        let Some((failed, error)) = failure else {
            if !spare.is_empty() {
                self.pool.give(spare);
            }
            return Ok(());
        };
        // Roll back every tensor touched so far, the failed one included.
        for tensor in &mut self.tensors[..=failed] {
            if let Err(e) =
                tensor.unback(base + from, base + to, &mut spare, &env, &mut self.counters)
            {
                record_deferred(e);
            }
        }
        self.pool.give(spare);
        Err(error)
    }

    /// Shrinks `slot` to `tokens` tokens in total: pages no longer needed (reused surplus
    /// included) are unmapped, given back to the pool and, with a zero page, backed by it again.
    /// `tokens` above the current length is [`Error::InvalidArgument`].
    pub fn shrink(&mut self, slot: SlotId, tokens: u32) -> Result<()> {
        let index = self.active(slot)?;
        let current = self.slots[index];
        if tokens > current.tokens {
            return Err(invalid(format!(
                "kv shrink to {tokens} tokens above the current {} (use grow)",
                current.tokens
            )));
        }
        let need = self.pages_for(tokens);
        self.file_owed(index);
        // The tables give their pages up before the mapper's extent moves down to `need`: the
        // mapper claims rows from its extent on (see `kv/ahead/mod.rs`).
        let result = self.unback_slot(index, need, current.mapped);
        if let Some(ahead) = self.ahead.as_ref().filter(|_| need < current.mapped) {
            let rows = ahead.retire(index, need, true);
            ahead.release(rows);
            ahead.resume(index);
        }
        self.holes[index].retain(|&p| p < need);
        let slot = &mut self.slots[index];
        slot.tokens = tokens;
        slot.mapped = slot.mapped.min(need);
        slot.reused = false;
        result.map(drop).map_err(|(_, e)| e)
    }

    /// Frees `slot`: its id becomes stale at once; its pages stay mapped on the deferred list
    /// for the next [`KvSpace::admit`] (a slot with no pages becomes free directly).
    ///
    /// A slot with holes is first truncated to its first hole: the pages past it are unmapped and
    /// given back (with the zero page behind them again), so a deferred slot has none. The id is
    /// stale even when that unmapping reports an error (returned; the pages whose unmap failed
    /// are quarantined: never reused, never released).
    pub fn free(&mut self, slot: SlotId) -> Result<()> {
        let index = self.active(slot)?;
        let mut result = Ok(());
        self.retire_ahead(index);
        if let Some(&first) = self.holes[index].first() {
            let mapped = self.slots[index].mapped;
            result = self
                .unback_slot(index, first, mapped)
                .map(drop)
                .map_err(|(_, e)| e);
            self.holes[index].clear();
            self.slots[index].mapped = first;
        }
        let s = &mut self.slots[index];
        s.generation = s.generation.wrapping_add(1);
        s.tokens = 0;
        s.reused = false;
        if s.mapped > 0 {
            s.state = SlotState::Deferred;
            self.deferred.push_back(index as u32);
        } else {
            s.state = SlotState::Free;
            self.free.push(index as u32);
        }
        result
    }
}

impl Drop for KvSpace {
    /// Unmaps every pool page and gives it back to the pool (a page whose unmap failed is
    /// quarantined); zero-page mappings, the zero page
    /// and the reservations then go, in that order, through their owners. Once the process is
    /// exiting nothing calls the backend (the owners leak instead).
    fn drop(&mut self) {
        if process_is_exiting() {
            if let Some(ahead) = self.ahead.take() {
                std::mem::forget(ahead);
            }
            return;
        }
        // The mapper first: the tables file what they owe it, then it stops and unmaps what it
        // holds before the tables go.
        for index in 0..self.slots.len() {
            self.file_owed(index);
        }
        drop(self.ahead.take());
        let mut returned = Vec::new();
        let mut first_err = None;
        for tensor in &mut self.tensors {
            let n = tensor.pages.len();
            if let Err(stuck) = unmap_pages(&self.pool, tensor.take_real(0, n), &mut returned) {
                first_err.get_or_insert(stuck.first);
            }
        }
        if !returned.is_empty() {
            self.pool.give(returned);
        }
        if let Some(e) = first_err {
            record_deferred(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_space_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<KvSpace>();
    }

    #[test]
    fn slot_ids_compare_by_generation() {
        let a = SlotId {
            index: 3,
            generation: 1,
        };
        let b = SlotId {
            index: 3,
            generation: 2,
        };
        assert_ne!(a, b);
        assert_eq!(a.index(), b.index());
    }

    #[test]
    fn kind_indices_are_k_then_v() {
        assert_eq!(Kind::K.index(), 0);
        assert_eq!(Kind::V.index(), 1);
    }
}
