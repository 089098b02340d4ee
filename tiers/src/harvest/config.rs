//! Configuration of the Harvest controller and the hints of one allocation.

use crate::object::Durability;

/// Which device pairs have a direct (NVLink-class) link. Symmetric; a device is always linked
/// to itself. On the host backend every link is whatever the test says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkMatrix {
    n: usize,
    direct: Vec<bool>,
}

impl LinkMatrix {
    /// `n` devices, every pair directly linked.
    pub fn all(n: usize) -> Self {
        LinkMatrix {
            n,
            direct: vec![true; n * n],
        }
    }

    /// `n` devices, no pair directly linked (everything goes over PCIe/host).
    pub fn none(n: usize) -> Self {
        let mut m = LinkMatrix {
            n,
            direct: vec![false; n * n],
        };
        for d in 0..n {
            m.direct[d * n + d] = true;
        }
        m
    }

    /// Sets whether `a` and `b` are directly linked (both directions).
    pub fn set(&mut self, a: u32, b: u32, direct: bool) -> &mut Self {
        let (a, b) = (a as usize, b as usize);
        if a < self.n && b < self.n && a != b {
            self.direct[a * self.n + b] = direct;
            self.direct[b * self.n + a] = direct;
        }
        self
    }

    /// True when `a` and `b` are directly linked (unknown devices: false).
    pub fn direct(&self, a: u32, b: u32) -> bool {
        let (a, b) = (a as usize, b as usize);
        a < self.n && b < self.n && self.direct[a * self.n + b]
    }
}

/// What a peer's owner keeps for itself and lends at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLimits {
    /// Bytes of free memory the owner keeps: never lent, and a pressure check revokes loans
    /// when free memory falls below it.
    pub reserve: u64,
    /// Most bytes lent from this peer at once.
    pub quota: u64,
}

impl Default for PeerLimits {
    fn default() -> Self {
        PeerLimits {
            reserve: 0,
            quota: u64::MAX,
        }
    }
}

/// Controller configuration: per-device limits and the link matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HarvestConfig {
    /// One entry per device (missing entries: [`PeerLimits::default`]).
    pub limits: Vec<PeerLimits>,
    pub links: LinkMatrix,
    /// Let a device lend to itself (one GPU: the device as its own peer, for testing the path).
    pub allow_self: bool,
}

impl HarvestConfig {
    /// `n` devices, all directly linked, no reserve, no quota.
    pub fn new(n: usize) -> Self {
        HarvestConfig {
            limits: vec![PeerLimits::default(); n],
            links: LinkMatrix::all(n),
            allow_self: false,
        }
    }

    pub fn limits_of(&self, device: u32) -> PeerLimits {
        self.limits
            .get(device as usize)
            .copied()
            .unwrap_or_default()
    }
}

/// Hints for one `harvest_alloc`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HarvestHints {
    /// The device whose copies will use the memory (access is granted to it).
    pub requester: u32,
    /// Peers to prefer, in no particular order (empty: no preference). A hint, not a limit.
    pub preferred: Vec<u32>,
    /// Only consider peers directly linked to the requester.
    pub direct_only: bool,
    /// What a revocation costs: `Backed` falls back to the host copy, `Lossy` is lost.
    pub durability: Durability,
}

impl HarvestHints {
    pub fn new(requester: u32, durability: Durability) -> Self {
        HarvestHints {
            requester,
            preferred: Vec::new(),
            direct_only: false,
            durability,
        }
    }
}
