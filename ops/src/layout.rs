//! The files' layout (JSON, version [`LAYOUT_VERSION`]): a reader skips any other version.

use serde::{Deserialize, Serialize};

/// The version of [`ProcessFigures`] and [`LimitRequest`]; bumped on any incompatible change.
pub const LAYOUT_VERSION: u32 = 1;

/// One library's figures in one process (`<pid>.<library>.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessFigures {
    pub version: u32,
    pub pid: u32,
    /// `"strata"` (`libstrata.so`) or `"preload"` (`libstrata_preload.so`).
    pub library: String,
    /// The process's start in clock ticks after boot (`/proc/<pid>/stat`), which tells a
    /// reused pid from the process that wrote the file.
    pub start_ticks: u64,
    /// The process's command name (`/proc/<pid>/comm`).
    pub command: String,
    /// `host` or `cuda`.
    pub backend: String,
    /// When the figures were taken, in milliseconds since the Unix epoch.
    pub updated_unix_ms: u64,
    pub devices: Vec<DeviceFigures>,
    /// Why the last limit request could not be applied (`None`: it was, or none came).
    pub limit_error: Option<String>,
}

/// One device of a process: its caching allocator, pool, tags and KV spaces. Counters
/// (`allocs`, `frees`, `ooms`, `moved_bytes`) only grow.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceFigures {
    pub device: u32,
    pub total_bytes: u64,
    /// Bytes of pages the caching allocator holds mapped.
    pub reserved_bytes: u64,
    /// Requested bytes of live allocations.
    pub allocated_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// The cap on the device's own memory (`strata_set_memory_fraction`, `strata limit`).
    pub limit_bytes: Option<u64>,
    pub allocs: u64,
    pub frees: u64,
    /// Out-of-memory and limit failures.
    pub ooms: u64,
    /// The allocator's pages and the KV spaces' blocks by where their bytes are.
    pub tiers: TierBytes,
    /// Bytes moved between tiers since the process started (offload, onload, KV spills and
    /// restores).
    pub moved_bytes: u64,
    /// Bytes of this device's pool pages in use (allocator, KV spaces, lent pages).
    pub pool_in_use_bytes: u64,
    /// Of those, bytes lent to peers; and peers' bytes this device borrowed.
    pub lent_bytes: u64,
    pub borrowed_bytes: u64,
    pub tags: Vec<TagFigures>,
    pub kv_spaces: Vec<KvFigures>,
}

/// Bytes by tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierBytes {
    /// The device's own memory.
    pub device: u64,
    /// Pages borrowed from a peer device.
    pub peer: u64,
    /// Host memory (mapped for the device, or copies of sleeping tags).
    pub host: u64,
    pub disk: u64,
}

impl TierBytes {
    pub fn add(&mut self, other: TierBytes) {
        self.device += other.device;
        self.peer += other.peer;
        self.host += other.host;
        self.disk += other.disk;
    }
}

/// A tag's state on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TagState {
    Awake,
    /// `strata_sleep` (pages released; copies on the host or disk).
    Asleep,
    /// Awake with some pages in host memory (`strata_offload`, overflow).
    Offloaded,
}

impl TagState {
    pub fn as_str(self) -> &'static str {
        match self {
            TagState::Awake => "awake",
            TagState::Asleep => "asleep",
            TagState::Offloaded => "offloaded",
        }
    }
}

/// A tag on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TagFigures {
    pub name: String,
    pub state: TagState,
    /// Requested bytes of its live allocations.
    pub allocated_bytes: u64,
    /// Its pages (and sleeping copies) by tier.
    pub bytes: TierBytes,
}

/// A KV space on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvFigures {
    /// The space's serial in its process.
    pub id: u64,
    /// Tokens of its live requests, and the requests.
    pub tokens: u64,
    pub requests: u64,
    /// Its blocks by tier.
    pub bytes: TierBytes,
    /// Restores done ahead of need (hinted) and on demand.
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    /// Bytes copied to and from the device.
    pub moved_bytes: u64,
}

/// A cap an operator asks a process to apply to one device (`<pid>.<library>.limit.<device>`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LimitRequest {
    pub version: u32,
    pub device: u32,
    pub limit: LimitValue,
}

/// A cap: bytes, a fraction of the device's memory (`strata_set_memory_fraction`), or none.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitValue {
    Bytes(u64),
    Fraction(f64),
    None,
}

impl LimitValue {
    /// The cap in bytes on a device of `total` bytes (`None`: no cap; a fraction of 1 is none,
    /// as in `strata_set_memory_fraction`).
    pub fn resolve(self, total: u64) -> Option<u64> {
        match self {
            LimitValue::Bytes(b) => Some(b),
            LimitValue::Fraction(f) if f < 1.0 => Some((total as f64 * f) as u64),
            LimitValue::Fraction(_) | LimitValue::None => None,
        }
    }
}
