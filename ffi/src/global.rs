//! Process-wide state behind the C ABI: the backend (`strata_vmm::global()`) and one
//! [`CachingAllocator`] per device (each over its own [`PagePool`]), created lazily on first
//! use. Tags live in `tags.rs`.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use strata_allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata_vmm::{Backend, DevicePtr, Error, Result};

/// One device's allocator, created on first use; a failed creation is retried next time.
struct DeviceSlot {
    allocator: OnceLock<Arc<CachingAllocator>>,
    init: Mutex<()>,
}

/// The backend and the per-device slots.
pub struct Global {
    pub backend: Arc<dyn Backend>,
    devices: Vec<DeviceSlot>,
}

static GLOBAL: OnceLock<Global> = OnceLock::new();
static GLOBAL_INIT: Mutex<()> = Mutex::new(());

/// The process-wide state, opening the backend on first use.
#[inline]
pub fn global() -> Result<&'static Global> {
    match GLOBAL.get() {
        Some(g) => {
            strata_vmm::fork::check()?;
            Ok(g)
        }
        None => init_global(),
    }
}

/// The process-wide state if it was opened (never opens it).
pub fn opened() -> Option<&'static Global> {
    GLOBAL.get()
}

#[cold]
#[inline(never)]
fn init_global() -> Result<&'static Global> {
    let _guard = GLOBAL_INIT.lock();
    if let Some(g) = GLOBAL.get() {
        strata_vmm::fork::check()?;
        return Ok(g);
    }
    strata_vmm::fork::arm();
    let backend = strata_vmm::global()?;
    let devices = (0..backend.device_count())
        .map(|_| DeviceSlot {
            allocator: OnceLock::new(),
            init: Mutex::new(()),
        })
        .collect();
    Ok(GLOBAL.get_or_init(|| Global { backend, devices }))
}

impl Global {
    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Validates a C device ordinal.
    #[inline]
    pub fn ordinal(&self, device: i32) -> Result<usize> {
        match usize::try_from(device) {
            Ok(d) if d < self.devices.len() => Ok(d),
            _ => Err(Error::NoDevice(device.into())),
        }
    }

    /// The allocator of `device`, created on first use.
    #[inline]
    pub fn allocator(&self, device: i32) -> Result<&CachingAllocator> {
        let d = self.ordinal(device)?;
        match self.devices[d].allocator.get() {
            Some(a) => Ok(a),
            None => self.create(d),
        }
    }

    /// The allocator of `device` if it was already created.
    pub fn existing(&self, device: usize) -> Option<&CachingAllocator> {
        self.devices.get(device)?.allocator.get().map(|a| &**a)
    }

    /// Every allocator created so far, with its device.
    pub fn existing_all(&self) -> impl Iterator<Item = (usize, &CachingAllocator)> {
        (0..self.devices.len()).filter_map(|d| self.existing(d).map(|a| (d, a)))
    }

    /// The device whose arena holds `ptr`, among the allocators created so far.
    pub fn device_of(&self, ptr: DevicePtr) -> Option<usize> {
        self.existing_all()
            .find(|(_, a)| {
                let (start, size) = a.arena();
                ptr >= start && ptr - start < size
            })
            .map(|(d, _)| d)
    }

    #[cold]
    #[inline(never)]
    fn create(&self, d: usize) -> Result<&CachingAllocator> {
        let slot = &self.devices[d];
        let _guard = slot.init.lock();
        if let Some(a) = slot.allocator.get() {
            return Ok(a);
        }
        let sleeping = crate::sleeping::lock();
        let pool = PagePool::new(Arc::clone(&self.backend), d as u32, PoolConfig::default())?;
        let allocator = CachingAllocator::new(
            pool,
            CachingConfig {
                // A library inside someone else's process: no leak report at teardown.
                report_leaks: false,
                ..CachingConfig::default()
            },
        )?;
        crate::sleeping::apply_to_new_device(&sleeping, &allocator)?;
        Ok(slot.allocator.get_or_init(|| Arc::new(allocator)))
    }
}
