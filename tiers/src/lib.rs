//! Where bytes live and how they move: tiers (HBM pages, host memory, disk), objects with
//! generations and durability, a residency table, the transfer engine (per-direction streams,
//! coalescing, the block-copy kernel, events, the two-hop disk path), revocation, and pure
//! eviction/prefetch policies (LRU, frequency, scheduler lookahead, oracle; TierKV Eq. 1–2), Pie's
//! layer swapping ([`pie`]) with TierKV's overlap condition per layer ([`overlap`]), and
//! MIRAGE's parameter remapping ([`mirage`]).
#![deny(unsafe_code)]

pub mod calibrate;
pub mod disk;
pub mod harvest;
pub mod kv;
pub mod kvpr;
pub mod mirage;
pub mod object;
pub mod overlap;
pub mod pie;
pub mod policy;
pub mod store;
pub mod transfer;

pub use calibrate::{CalibrationConfig, LinkFit, MeasuredLinks};
pub use harvest::{HarvestConfig, HarvestController, HarvestHandle, HarvestHints};
pub use kv::{
    KvBlockManager, KvBlocksConfig, KvBlocksStats, KvRevocation, RequestId, TokenCopy,
    TokenCopyDirection,
};
pub use mirage::Mirage;
pub use object::{Durability, Notice, ObjectId, Residency, Tier};
pub use policy::{EvictionPolicy, PolicyKind};
pub use store::{DiskConfig, Revocation, StoreConfig, StoreStats, TierSpec, TierStore};
pub use transfer::{Direction, Submission, TransferEngine, TransferStats};
