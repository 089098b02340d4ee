//! A discrete-event simulator for strata's tiering strategies: a virtual clock, a shared-link
//! model, hardware profiles and seeded workload generators. It drives the very policy and
//! controller objects the runtime uses (`strata_tiers::policy`, `strata_tiers::kvpr`,
//! `strata_tiers::pie`, `strata_tiers::mirage::plan`, `strata_tiers::harvest::fit`), so that
//! the papers' tables can be reproduced on a laptop.
//!
//! Everything is deterministic: the same configuration and seed give the same result.
#![deny(unsafe_code)]

pub mod harvest;
pub mod hw;
pub mod kvpr;
pub mod link;
pub mod mirage;
pub mod pie;
pub mod stats;
pub mod tierkv;
pub mod workload;

pub use hw::HardwareProfile;
pub use workload::{Request, Workload};
