//! Placing allocations on pages: the per-device [`PagePool`], vAttention-style KV spaces and the
//! caching allocator for arbitrary sizes, all behind one [`MemoryResource`] trait.
//!
//! Strategy code works on offsets and ids; nothing here touches raw pointers.
#![deny(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod caching;
pub mod direct;
pub mod kv;
pub mod mapped;
pub mod pool;
pub mod resource;

pub use caching::{
    AllocatorCounts, AllocatorStats, CachingAllocator, CachingConfig, LiveAllocation, Moved,
    Revoked, SpillCounts, SpillStats, TagId, TagStats, TierBytes, UNTAGGED,
};
pub use direct::DirectResource;
pub use kv::{Kind, KvConfig, KvSpace, KvStats, SlotId};
pub use mapped::{unmap_pages, MappedPage, MappedRun, Migrated, PageLease, Return, StillMapped};
pub use pool::{Page, PagePool, PageSource, PoolConfig, PoolStats};
pub use resource::MemoryResource;
pub use strata_vmm::{Error, Result};
