//! Object ids with generations, durability, and the tiers an object can live in.

use std::fmt;

/// An object (KV block, layer, expert) in a [`TierStore`](crate::TierStore). The generation makes
/// a stale id an error ([`Error::StaleId`](strata_vmm::Error::StaleId)), never another object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl ObjectId {
    pub fn index(self) -> u32 {
        self.index
    }
    pub fn generation(self) -> u32 {
        self.generation
    }
    /// The id packed into one `u64` (what policies see).
    pub fn key(self) -> u64 {
        (u64::from(self.index) << 32) | u64::from(self.generation)
    }
    /// Inverse of [`ObjectId::key`].
    pub fn from_key(key: u64) -> Self {
        ObjectId {
            index: (key >> 32) as u32,
            generation: key as u32,
        }
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "object {}/{}", self.index, self.generation)
    }
}

/// What losing the fast copy of an object costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Durability {
    /// An authoritative copy always lives in host memory or on disk: revoking HBM loses nothing.
    Backed,
    /// Reconstructible (recompute, reload): may live in HBM only; revocation reports it lost.
    Lossy,
}

/// A storage tier.
pub use crate::policy::Tier;

/// What the owner's callback hears during a revocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The HBM copy was revoked; the object falls back to its copy in host memory or on disk.
    FellBack { id: ObjectId, owner: u64 },
    /// The only copy was revoked: the object is lost (reported exactly once).
    Lost { id: ObjectId, owner: u64 },
}

/// Where an object's copies are (slot numbers in each tier).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    pub hbm: Option<u32>,
    pub host: Option<u32>,
    pub disk: Option<u32>,
}

impl Residency {
    /// The fastest tier holding a copy.
    pub fn fastest(&self) -> Option<Tier> {
        if self.hbm.is_some() {
            Some(Tier::Hbm)
        } else if self.host.is_some() {
            Some(Tier::Host)
        } else if self.disk.is_some() {
            Some(Tier::Disk)
        } else {
            None
        }
    }
}
