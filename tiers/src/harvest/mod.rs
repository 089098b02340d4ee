//! Harvest (Gopal & Kaffes): unused HBM on peer GPUs as an opportunistic, revocable cache tier.
//!
//! - [`HarvestController`]: tracks each peer's harvestable capacity (free memory minus the
//!   reserve its owner keeps, capped by a per-peer quota), picks a peer by best fit (least
//!   leftover) after preferring directly linked and hinted peers ([`fit`]), takes pages from
//!   that device's `PagePool` (counted `lent` there), adopts them in the requester's pool as
//!   `PageSource::Borrowed { lender }` (counted `borrowed`), and maps them into one VA range
//!   (a `MappedRun`) with access granted to the requesting device. With
//!   [`HarvestController::with_pools`] the pools are the ones the devices' other users share.
//! - Data moves only with explicit backend copies ([`HarvestController::copy_in`] /
//!   [`HarvestController::copy_out`]); nothing dereferences another device's memory.
//! - Revocation, in Harvest's order: stop new copies → drain in-flight copies (events) →
//!   invalidate the placement (the handle goes stale) → call back → return the pages.
//!   [`Durability::Backed`](crate::Durability) objects are reported as fallen back to their
//!   authoritative host copy, lossy ones as lost, each exactly once.
//! - [`ExpertResidency`]: the paper's expert residency map (local / peer / host per expert).
//! - [`remote`]: lending across processes over a Unix socket (descriptors by `SCM_RIGHTS`,
//!   `SO_PEERCRED` checks, revocations acknowledged within a deadline).

mod config;
mod controller;
mod experts;
pub mod fit;
pub mod remote;

pub use config::{HarvestConfig, HarvestHints, LinkMatrix, PeerLimits};
pub use controller::{
    Endpoint, HarvestController, HarvestHandle, HarvestStats, PeerCapacity, ReclaimReport,
    RevokeCallback, RevokeReason, Revoked,
};
pub use experts::{ExpertResidency, ExpertTier};
