//! Placing allocations on pages: the per-device [`PagePool`], vAttention-style [`KvSpace`]s and
//! the [`CachingAllocator`] for arbitrary sizes.
//!
//! Strategy code works on offsets and ids; nothing here touches raw pointers.
#![deny(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub use strata_vmm::{Error, Result};
