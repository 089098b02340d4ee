//! One [`Runtime`] per process, with one [`DeviceRuntime`] per device: the backend, one
//! [`PagePool`](strata_allocator::PagePool) (each page keeps its source: fresh, reclaimed,
//! borrowed), the [`CachingAllocator`] over that pool, and Harvest's lending and borrowing over
//! the same pools.
//! `libstrata.so` (the C ABI and its Harvest calls) and `libstrata_preload.so` each hold one,
//! so within a library a page is counted once and can move between uses: a page the allocator
//! frees to the pool can be lent, a lent page counts in its lender's `in_use` and `lent` only,
//! and Harvest's "free minus reserve" counts the pool's idle pages as free.
//!
//! Everything is created on first use: a device's pool and allocator when something first
//! allocates there, the Harvest controller (and with it every device's pool) on the first
//! Harvest call. A failed creation is retried on the next use.
//!
//! Each cdylib links its own copy of this crate, so a process that loads both `libstrata.so` and
//! `libstrata_preload.so` has one runtime in each.
#![deny(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod device;

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use strata_allocator::{CachingAllocator, CachingConfig, PoolConfig};
use strata_tiers::harvest::{HarvestConfig, HarvestController};
use strata_vmm::{Backend, DevicePtr, Error, Result};

pub use device::{set_limit, DeviceRuntime, DeviceStats};

/// How a runtime builds each device's pool and allocator.
#[derive(Clone, Debug, Default)]
pub struct RuntimeConfig {
    pub pool: PoolConfig,
    pub caching: CachingConfig,
}

/// The process's devices (see the crate docs).
pub struct Runtime {
    backend: Arc<dyn Backend>,
    devices: Box<[DeviceRuntime]>,
    harvest: OnceLock<Arc<HarvestController>>,
    harvest_init: Mutex<()>,
}

impl Runtime {
    /// A runtime over every device of `backend`; nothing is created until first use.
    pub fn new(backend: Arc<dyn Backend>, config: RuntimeConfig) -> Runtime {
        let devices = (0..backend.device_count())
            .map(|d| DeviceRuntime::new(Arc::clone(&backend), d, config.clone()))
            .collect();
        Runtime {
            backend,
            devices,
            harvest: OnceLock::new(),
            harvest_init: Mutex::new(()),
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Validates a device ordinal (C callers pass an `int`).
    #[inline]
    pub fn ordinal(&self, device: impl Into<i64>) -> Result<usize> {
        let device = device.into();
        match usize::try_from(device) {
            Ok(d) if d < self.devices.len() => Ok(d),
            _ => Err(Error::NoDevice(device)),
        }
    }

    /// The runtime of `device`.
    #[inline]
    pub fn device(&self, device: impl Into<i64>) -> Result<&DeviceRuntime> {
        Ok(&self.devices[self.ordinal(device)?])
    }

    /// Every device's runtime, in device order.
    pub fn devices(&self) -> &[DeviceRuntime] {
        &self.devices
    }

    /// The caching allocator of `device`, created on first use.
    #[inline]
    pub fn allocator(&self, device: impl Into<i64>) -> Result<&CachingAllocator> {
        self.device(device)?.allocator()
    }

    /// The allocator of `device` if it was already created.
    pub fn existing(&self, device: usize) -> Option<&CachingAllocator> {
        self.devices.get(device)?.existing_allocator()
    }

    /// Every allocator created so far, with its device.
    pub fn existing_all(&self) -> impl Iterator<Item = (usize, &CachingAllocator)> {
        self.devices
            .iter()
            .enumerate()
            .filter_map(|(d, rt)| rt.existing_allocator().map(|a| (d, a)))
    }

    /// The device whose allocator's arena holds `ptr`, among the allocators created so far.
    pub fn device_of(&self, ptr: DevicePtr) -> Option<usize> {
        self.existing_all()
            .find(|(_, a)| {
                let (start, size) = a.arena();
                ptr >= start && ptr - start < size
            })
            .map(|(d, _)| d)
    }

    /// The Harvest controller over every device's pool, created on first use (a single device
    /// lends to itself).
    pub fn harvest(&self) -> Result<&Arc<HarvestController>> {
        match self.harvest.get() {
            Some(c) => Ok(c),
            None => self.create_harvest(),
        }
    }

    #[cold]
    #[inline(never)]
    fn create_harvest(&self) -> Result<&Arc<HarvestController>> {
        let _guard = self.harvest_init.lock();
        if let Some(c) = self.harvest.get() {
            return Ok(c);
        }
        let pools = self
            .devices
            .iter()
            .map(|d| d.pool().map(Arc::clone))
            .collect::<Result<Vec<_>>>()?;
        let mut config = HarvestConfig::new(self.devices.len());
        config.allow_self = self.devices.len() == 1;
        let controller = HarvestController::with_pools(pools, config)?;
        Ok(self.harvest.get_or_init(|| controller))
    }

    /// The Harvest controller if it was already created.
    pub fn existing_harvest(&self) -> Option<&Arc<HarvestController>> {
        self.harvest.get()
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("backend", &self.backend.kind())
            .field("devices", &self.devices)
            .field("harvest", &self.harvest.get().is_some())
            .finish()
    }
}

static GLOBAL: OnceLock<Runtime> = OnceLock::new();
static GLOBAL_INIT: Mutex<()> = Mutex::new(());

/// The process's runtime, opening the backend (`strata_vmm::global()`, from `STRATA_BACKEND`)
/// with `config()` on first use; later calls ignore `config`. A failure to open the backend is
/// returned and retried on the next call.
#[inline]
pub fn global(config: impl FnOnce() -> RuntimeConfig) -> Result<&'static Runtime> {
    match GLOBAL.get() {
        Some(rt) => {
            // In a child forked after this, nothing of the runtime is usable (see
            // `strata_vmm::fork`).
            strata_vmm::fork::check()?;
            Ok(rt)
        }
        None => init_global(config),
    }
}

#[cold]
#[inline(never)]
fn init_global(config: impl FnOnce() -> RuntimeConfig) -> Result<&'static Runtime> {
    let _guard = GLOBAL_INIT.lock();
    if let Some(rt) = GLOBAL.get() {
        strata_vmm::fork::check()?;
        return Ok(rt);
    }
    strata_vmm::fork::arm();
    let backend = strata_vmm::global()?;
    Ok(GLOBAL.get_or_init(|| Runtime::new(backend, config())))
}

/// The process's runtime if [`global`] created it.
pub fn existing_global() -> Option<&'static Runtime> {
    GLOBAL.get()
}
