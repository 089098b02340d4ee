//! What the real driver charges, for the emulations: a [`Profile`] gives each driver call strata
//! makes a cost and each copy direction a bandwidth; [`Charger`] makes the calling thread pay
//! them. The host backend (`strata-vmm`) and the emulated driver (`tests/cuda-emu`) both read
//! `STRATA_HOST_LATENCY` ([`Profile::from_env`]):
//!
//! - `none` (the default, and what tests use): nothing is charged;
//! - `a100`: kvcached's published A100 figures ([`Profile::a100`]);
//! - `h200`: the first H200 run's totals split among the calls ([`Profile::h200`]);
//! - a path: a text file of `key=value` lines ([`Profile::parse_file`]).
//!
//! Costs under 100 µs are a spin on the monotonic clock (a sleep would oversleep by tens of
//! µs); longer ones sleep all but the last 100 µs, then spin. VMM calls are charged one at a
//! time per process (the driver serializes them; kvcached's `bench_map_parallelism`), stream
//! and event calls and copies concurrently.
//!
//! Reuse: `Profile::h200()` with `Charger::new` charges any code path the same way (a
//! background mapper measured under `h200`, a bench).

#![deny(unsafe_code)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

mod file;

/// The driver calls a profile prices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Call {
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    FreeVa,
    /// `cuMemCreate` (per call; a profile's figure is for one 2 MiB page).
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemExportToShareableHandle`.
    Export,
    /// `cuMemImportFromShareableHandle`.
    Import,
    /// `cuStreamCreate`.
    StreamCreate,
    /// `cuStreamDestroy`.
    StreamDestroy,
    /// `cuEventCreate`.
    EventCreate,
    /// `cuEventDestroy`.
    EventDestroy,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuStreamWaitEvent`.
    StreamWaitEvent,
    /// `cuMemHostAlloc` (pinned host memory).
    HostAlloc,
    /// `cuMemFreeHost`.
    HostFree,
}

impl Call {
    /// Every call, in the order of [`Call::key`]'s table.
    pub const ALL: [Call; 17] = [
        Call::Reserve,
        Call::FreeVa,
        Call::Create,
        Call::Release,
        Call::Map,
        Call::Unmap,
        Call::SetAccess,
        Call::Export,
        Call::Import,
        Call::StreamCreate,
        Call::StreamDestroy,
        Call::EventCreate,
        Call::EventDestroy,
        Call::EventRecord,
        Call::StreamWaitEvent,
        Call::HostAlloc,
        Call::HostFree,
    ];

    /// The key of this call in a profile file.
    pub fn key(self) -> &'static str {
        match self {
            Call::Reserve => "reserve",
            Call::FreeVa => "free_va",
            Call::Create => "create",
            Call::Release => "release",
            Call::Map => "map",
            Call::Unmap => "unmap",
            Call::SetAccess => "set_access",
            Call::Export => "export",
            Call::Import => "import",
            Call::StreamCreate => "stream_create",
            Call::StreamDestroy => "stream_destroy",
            Call::EventCreate => "event_create",
            Call::EventDestroy => "event_destroy",
            Call::EventRecord => "event_record",
            Call::StreamWaitEvent => "stream_wait_event",
            Call::HostAlloc => "host_alloc",
            Call::HostFree => "host_free",
        }
    }

    /// VMM calls (serialized by the driver); the rest are stream, event and host calls.
    pub fn is_vmm(self) -> bool {
        matches!(
            self,
            Call::Reserve
                | Call::FreeVa
                | Call::Create
                | Call::Release
                | Call::Map
                | Call::Unmap
                | Call::SetAccess
                | Call::Export
                | Call::Import
        )
    }

    /// Its slot in a profile's table ([`Call::ALL`] lists the calls in declaration order).
    fn index(self) -> usize {
        self as usize
    }
}

/// The direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// Costs of driver calls and copy bandwidths.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// What the profile is (`none`, `a100`, `h200`, or the file's path).
    pub name: String,
    costs: [Duration; Call::ALL.len()],
    /// Bytes per second per direction; `None`: copies are not charged.
    bandwidth: [Option<f64>; 3],
}

fn us(micros: f64) -> Duration {
    Duration::from_nanos((micros * 1000.0) as u64)
}

impl Profile {
    /// Nothing charged.
    pub fn none() -> Profile {
        Profile {
            name: "none".into(),
            costs: [Duration::ZERO; Call::ALL.len()],
            bandwidth: [None; 3],
        }
    }

    /// An A100: kvcached's published per-2-MiB-page figures, one thread
    /// (ovg-project/kvcached `benchmarks/bench_vmm/README.md`; REFERENCE.md §2): cuMemCreate
    /// 193 µs, cuMemMap 1.5 µs, cuMemSetAccess 36 µs, cuMemUnmap 26 µs, cuMemAddressReserve
    /// (8 GiB) 19 µs. Release, address free, export/import, streams, events and pinned memory
    /// are not published there: charged 0. Copies: PCIe 4.0 x16, 32 GB/s per direction (the
    /// A100 datasheet's 64 GB/s is both directions together); device to device not charged.
    pub fn a100() -> Profile {
        let mut p = Profile::none();
        p.name = "a100".into();
        p.set(Call::Create, us(193.0));
        p.set(Call::Map, us(1.5));
        p.set(Call::SetAccess, us(36.0));
        p.set(Call::Unmap, us(26.0));
        p.set(Call::Reserve, us(19.0));
        p.bandwidth[Direction::HostToDevice as usize] = Some(32e9);
        p.bandwidth[Direction::DeviceToHost as usize] = Some(32e9);
        p
    }

    /// An H200 (driver 580.159; `shared/gpu-runs/2026-11-27-h200`, strata's own benches), where
    /// only totals were measured, split among the calls:
    ///
    /// - `vmm_map` per page: map + set_access + unmap = 53.3 µs; with one set_access over a run
    ///   of 32 pages: 33.5 µs per page. The access call costs per call, not per byte (kvcached
    ///   `bench_layout`), so set_access = (53.3 − 33.5) · 32/31 = 20.4 µs and map + unmap =
    ///   32.9 µs, split by kvcached's A100 ratio 1.5 : 26: map 1.8 µs, unmap 31.1 µs.
    /// - `direct` 2 MiB round trip (create, reserve, map, set_access, unmap, release, free)
    ///   = 52.8 µs, no more than map + set_access + unmap alone: create, reserve, release and
    ///   free cost nothing these runs resolve, so they are charged 0 until per-call H200
    ///   figures exist (run `benches/driver_calls.rs` there).
    /// - Copies: host ↔ HBM 55 GB/s each way (`strata info`'s measured link on that machine);
    ///   device to device not charged. Streams, events and pinned memory: not measured, 0.
    pub fn h200() -> Profile {
        let mut p = Profile::none();
        p.name = "h200".into();
        p.set(Call::Map, us(1.8));
        p.set(Call::SetAccess, us(20.4));
        p.set(Call::Unmap, us(31.1));
        p.bandwidth[Direction::HostToDevice as usize] = Some(55e9);
        p.bandwidth[Direction::DeviceToHost as usize] = Some(55e9);
        p
    }

    /// `none`, `a100`, `h200`, or the path of a profile file.
    pub fn parse(spec: &str) -> Result<Profile, String> {
        match spec.trim() {
            "" | "none" => Ok(Profile::none()),
            "a100" => Ok(Profile::a100()),
            "h200" => Ok(Profile::h200()),
            path => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!("{path:?} is neither none, a100, h200 nor a readable file: {e}")
                })?;
                let mut p = Profile::parse_file(&text)?;
                p.name = path.to_string();
                Ok(p)
            }
        }
    }

    /// `STRATA_HOST_LATENCY` ([`Profile::parse`]); unset or empty: `none`.
    pub fn from_env() -> Result<Profile, String> {
        match std::env::var("STRATA_HOST_LATENCY") {
            Ok(v) => Profile::parse(&v).map_err(|e| format!("STRATA_HOST_LATENCY: {e}")),
            Err(_) => Ok(Profile::none()),
        }
    }

    /// True when nothing is charged.
    pub fn is_none(&self) -> bool {
        self.costs.iter().all(Duration::is_zero) && self.bandwidth.iter().all(Option::is_none)
    }

    /// The cost of one `call`.
    pub fn cost(&self, call: Call) -> Duration {
        self.costs[call.index()]
    }

    /// Sets the cost of `call`.
    pub fn set(&mut self, call: Call, cost: Duration) {
        self.costs[call.index()] = cost;
    }

    /// Bytes per second in `direction`; `None`: not charged.
    pub fn bandwidth(&self, direction: Direction) -> Option<f64> {
        self.bandwidth[direction as usize]
    }

    /// Sets the bandwidth in `direction` (`None`: not charged).
    pub fn set_bandwidth(&mut self, direction: Direction, bytes_per_second: Option<f64>) {
        self.bandwidth[direction as usize] = bytes_per_second.filter(|b| b.is_finite() && *b > 0.0);
    }

    /// How long moving `len` bytes in `direction` takes.
    pub fn copy_time(&self, direction: Direction, len: u64) -> Duration {
        match self.bandwidth(direction) {
            Some(b) => Duration::try_from_secs_f64(len as f64 / b).unwrap_or(Duration::ZERO),
            None => Duration::ZERO,
        }
    }
}

/// Charges a [`Profile`]'s costs to the calling thread.
#[derive(Debug)]
pub struct Charger {
    profile: Profile,
    /// Held while a VMM call's cost is paid: one at a time, as in the driver.
    vmm: Mutex<()>,
}

impl Charger {
    pub fn new(profile: Profile) -> Charger {
        Charger {
            profile,
            vmm: Mutex::new(()),
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Pays for one `call`.
    pub fn call(&self, call: Call) {
        let cost = self.profile.cost(call);
        if cost.is_zero() {
            return;
        }
        let _one_at_a_time = call
            .is_vmm()
            .then(|| self.vmm.lock().unwrap_or_else(|e| e.into_inner()));
        wait(cost);
    }

    /// Pays for moving `len` bytes in `direction`.
    pub fn copy(&self, direction: Direction, len: u64) {
        wait(self.profile.copy_time(direction, len));
    }
}

/// Below this a cost is spun, not slept.
pub const SPIN_BELOW: Duration = Duration::from_micros(100);

/// Blocks the calling thread for `d`: a spin on the monotonic clock for the last
/// [`SPIN_BELOW`] (all of it when shorter), a sleep before that.
pub fn wait(d: Duration) {
    if d.is_zero() {
        return;
    }
    let until = Instant::now() + d;
    if d > SPIN_BELOW {
        std::thread::sleep(d - SPIN_BELOW);
    }
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests;
