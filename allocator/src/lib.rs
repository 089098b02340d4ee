//! Placing allocations on pages: the per-device [`PagePool`], vAttention-style KV spaces and the
//! caching allocator for arbitrary sizes, all behind one [`MemoryResource`] trait.
//!
//! Strategy code works on offsets and ids; nothing here touches raw pointers.
#![deny(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod pool;
pub mod resource;

pub use pool::{Page, PagePool, PageSource, PoolConfig, PoolStats};
pub use resource::MemoryResource;
pub use strata_vmm::{Error, Result};
