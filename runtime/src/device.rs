//! [`DeviceRuntime`]: what one device's users share.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use strata_allocator::{AllocatorStats, CachingAllocator, PagePool, PoolStats};
use strata_tiers::mirage::Mirage;
use strata_vmm::{Backend, Error, Result};

use crate::RuntimeConfig;

/// One device of a [`Runtime`](crate::Runtime): its page pool and the users drawing on it.
///
/// The pool is the device's only one: the caching allocator maps its pages, Harvest lends them
/// to peers (and adopts peers' pages here as borrowed), and KV spaces and tier stores should take
/// theirs from [`DeviceRuntime::pool`] too, so that `PoolStats` tells the whole story.
///
/// # Adding a registry (KV spaces, tier stores)
///
/// A per-device registry is a field of this struct, created empty in `DeviceRuntime::new`
/// (or lazily behind a `OnceLock`, like `allocator`), whose entries are built over
/// [`DeviceRuntime::pool`]; give it an accessor here and count it in [`DeviceStats`]. Fields
/// drop in declaration order: declare registries before `allocator` and `pool`, so that their
/// pages go back before the allocator and the pool go.
pub struct DeviceRuntime {
    backend: Arc<dyn Backend>,
    device: u32,
    config: RuntimeConfig,
    /// MIRAGE's state over the device's pool, created on first use (see
    /// [`DeviceRuntime::with_mirage`]).
    mirage: Mutex<Option<Mirage>>,
    allocator: OnceLock<CachingAllocator>,
    /// Whether the first [`DeviceRuntime::allocator_once`] created the allocator.
    allocator_asked: OnceLock<bool>,
    /// Host-memory pages mapped for this device (offloaded tags), created on first use.
    host_pool: OnceLock<Arc<PagePool>>,
    pool: OnceLock<Arc<PagePool>>,
    /// One creation lock per lazily created field, so that an allocator's `init` may create
    /// the host pool (see [`DeviceRuntime::allocator_with`]).
    allocator_init: Mutex<()>,
    host_pool_init: Mutex<()>,
    pool_init: Mutex<()>,
}

/// A snapshot of a device's runtime (`None`: not created yet).
#[derive(Clone, Debug, Default)]
pub struct DeviceStats {
    pub pool: Option<PoolStats>,
    pub allocator: Option<AllocatorStats>,
}

impl DeviceRuntime {
    pub(crate) fn new(backend: Arc<dyn Backend>, device: u32, config: RuntimeConfig) -> Self {
        DeviceRuntime {
            backend,
            device,
            config,
            mirage: Mutex::new(None),
            allocator: OnceLock::new(),
            allocator_asked: OnceLock::new(),
            host_pool: OnceLock::new(),
            pool: OnceLock::new(),
            allocator_init: Mutex::new(()),
            host_pool_init: Mutex::new(()),
            pool_init: Mutex::new(()),
        }
    }

    pub fn device(&self) -> u32 {
        self.device
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The device's page pool, created on first use.
    pub fn pool(&self) -> Result<&Arc<PagePool>> {
        match self.pool.get() {
            Some(p) => Ok(p),
            None => init_once(&self.pool, &self.pool_init, || {
                PagePool::new(
                    Arc::clone(&self.backend),
                    self.device,
                    self.config.pool.clone(),
                )
            }),
        }
    }

    /// The pool if it was already created.
    pub fn existing_pool(&self) -> Option<&Arc<PagePool>> {
        self.pool.get()
    }

    /// The pool of host-memory pages this device maps (accounted to the host, not the
    /// device), created on first use with the device pool's configuration; the caching
    /// allocator offloads tags onto it ([`CachingAllocator::offload`]). A backend without
    /// host VMM memory is [`Error::Unsupported`](strata_vmm::Error::Unsupported).
    pub fn host_pool(&self) -> Result<&Arc<PagePool>> {
        init_once(&self.host_pool, &self.host_pool_init, || {
            PagePool::new_host(
                Arc::clone(&self.backend),
                self.device,
                self.config.pool.clone(),
            )
        })
    }

    /// The host pool if it was already created.
    pub fn existing_host_pool(&self) -> Option<&Arc<PagePool>> {
        self.host_pool.get()
    }

    /// The caching allocator over [`DeviceRuntime::pool`], created on first use.
    #[inline]
    pub fn allocator(&self) -> Result<&CachingAllocator> {
        match self.allocator.get() {
            Some(a) => Ok(a),
            None => self.allocator_with(|_| Ok(())),
        }
    }

    /// [`DeviceRuntime::allocator`]; when this call creates it, `init` configures it first
    /// (tags asleep, overflow), before any other caller can reach it: [`existing_allocator`]
    /// and every other thread see the allocator only once `init` succeeded. If `init` fails,
    /// the allocator is dropped and the error returned; the next call creates it again.
    /// `init` may create the host pool, not the allocator.
    ///
    /// [`existing_allocator`]: DeviceRuntime::existing_allocator
    #[cold]
    #[inline(never)]
    pub fn allocator_with(
        &self,
        init: impl FnOnce(&CachingAllocator) -> Result<()>,
    ) -> Result<&CachingAllocator> {
        if let Some(a) = self.allocator.get() {
            return Ok(a);
        }
        let pool = Arc::clone(self.pool()?);
        init_once(&self.allocator, &self.allocator_init, || {
            let allocator = CachingAllocator::new(pool, self.config.caching.clone())?;
            init(&allocator)?;
            Ok(allocator)
        })
    }

    /// [`DeviceRuntime::allocator`], asked for once: the first call creates it and, if that
    /// fails, hands the error to `refused`; from then on every call returns `None` without
    /// trying again (the preload shim's policy: a device strata cannot serve passes through for
    /// good, with one message).
    pub fn allocator_once(&self, refused: impl FnOnce(&Error)) -> Option<&CachingAllocator> {
        let created = self
            .allocator_asked
            .get_or_init(|| self.allocator().map_err(|e| refused(&e)).is_ok());
        if *created {
            self.allocator.get()
        } else {
            None
        }
    }

    /// Runs `f` on the device's MIRAGE state, created on first use over [`DeviceRuntime::pool`]
    /// (its parameter pool and KV pool alike), behind the device's MIRAGE lock.
    pub fn with_mirage<T>(&self, f: impl FnOnce(&mut Mirage) -> Result<T>) -> Result<T> {
        let mut slot = self.mirage.lock();
        let mirage = match &mut *slot {
            Some(m) => m,
            None => {
                let pool = Arc::clone(self.pool()?);
                slot.insert(Mirage::new(Arc::clone(&pool), pool)?)
            }
        };
        f(mirage)
    }

    /// The allocator if it was already created.
    #[inline]
    pub fn existing_allocator(&self) -> Option<&CachingAllocator> {
        self.allocator.get()
    }

    /// The pool's and the allocator's counters.
    pub fn stats(&self) -> DeviceStats {
        DeviceStats {
            pool: self.pool.get().map(|p| p.stats()),
            allocator: self.allocator.get().map(CachingAllocator::stats),
        }
    }
}

/// Caps the device memory `allocator` holds at `limit` (`None`: no cap), pool pages included:
/// live allocations stay, growth beyond the cap is out of memory, and cached memory above it is
/// given back (`strata_set_memory_fraction`, `strata limit`).
pub fn set_limit(allocator: &CachingAllocator, limit: Option<u64>) -> Result<()> {
    allocator.set_limit(limit)?;
    // The cap covers the pool's free pages too: all that strata holds on the device.
    allocator.pool().set_limit(limit);
    Ok(())
}

/// `cell`'s value, made by `make` under `lock` by the first caller (one `make` at a time; a
/// failure is returned and the next call tries again).
#[cold]
#[inline(never)]
fn init_once<'a, T>(
    cell: &'a OnceLock<T>,
    lock: &Mutex<()>,
    make: impl FnOnce() -> Result<T>,
) -> Result<&'a T> {
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let _guard = lock.lock();
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let v = make()?;
    Ok(cell.get_or_init(|| v))
}

impl std::fmt::Debug for DeviceRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRuntime")
            .field("device", &self.device)
            .field("pool", &self.pool.get().is_some())
            .field("allocator", &self.allocator.get().is_some())
            .finish()
    }
}
