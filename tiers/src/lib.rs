//! Where bytes live and how they move: host and disk tiers, the transfer engine, residency,
//! durability, revocation, eviction and prefetch policies, page sources and controllers.
//!
//! Filled by the tiered-spill and page-sources issues; the foundation only reserves the crate.
#![deny(unsafe_code)]
