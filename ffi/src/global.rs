//! Process-wide state behind the C ABI: the backend (`strata_vmm::global()`), one
//! [`CachingAllocator`] per device (each over its own [`PagePool`]), created lazily on first use,
//! the tag-name registry and the per-thread tag stack.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use strata_allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig, TagId, UNTAGGED};
use strata_vmm::{Backend, DevicePtr, Error, Result};

/// Most tags the registry hands out (a guard against runaway tag creation).
const MAX_TAGS: usize = 1 << 16;
/// Longest tag name accepted.
pub const MAX_TAG_LEN: usize = 256;
/// Deepest per-thread tag stack accepted.
const MAX_TAG_DEPTH: usize = 1024;

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

/// Tag names ↔ ids, process-wide. Ids start at 1 (0 is untagged) and are never reused.
#[derive(Default)]
struct Registry {
    ids: HashMap<String, TagId>,
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("tag name is empty".into()));
    }
    if name.len() > MAX_TAG_LEN {
        return Err(Error::InvalidArgument(format!(
            "tag name of {} bytes (at most {MAX_TAG_LEN})",
            name.len()
        )));
    }
    Ok(())
}

/// The id of tag `name`, registering it on first use.
pub fn tag_id_or_register(name: &str) -> Result<TagId> {
    check_name(name)?;
    let mut reg = registry().lock();
    if let Some(&id) = reg.ids.get(name) {
        return Ok(id);
    }
    if reg.ids.len() >= MAX_TAGS {
        return Err(Error::InvalidState(format!(
            "too many tags ({MAX_TAGS}); cannot register {name:?}"
        )));
    }
    let id = reg.ids.len() as TagId + 1;
    reg.ids.insert(name.to_string(), id);
    Ok(id)
}

/// The id of a registered tag; a name never pushed is [`Error::InvalidArgument`].
pub fn tag_id(name: &str) -> Result<TagId> {
    check_name(name)?;
    registry().lock().ids.get(name).copied().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "unknown tag {name:?} (no strata_tag_push ever named it)"
        ))
    })
}

/// The name of tag `id`, if registered.
pub fn tag_name(id: TagId) -> Option<String> {
    let reg = registry().lock();
    reg.ids
        .iter()
        .find_map(|(name, &i)| (i == id).then(|| name.clone()))
}

thread_local! {
    static TAG_STACK: RefCell<Vec<TagId>> = const { RefCell::new(Vec::new()) };
}

/// The tag new allocations of the calling thread get (top of its stack, or untagged).
#[inline]
pub fn current_tag() -> TagId {
    TAG_STACK
        .try_with(|s| s.borrow().last().copied().unwrap_or(UNTAGGED))
        .unwrap_or(UNTAGGED)
}

/// Pushes `tag` on the calling thread's stack.
pub fn push_tag(tag: TagId) -> Result<()> {
    TAG_STACK
        .try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() >= MAX_TAG_DEPTH {
                return Err(Error::InvalidState(format!(
                    "tag stack deeper than {MAX_TAG_DEPTH} (unbalanced strata_tag_push?)"
                )));
            }
            s.push(tag);
            Ok(())
        })
        .map_err(|_| Error::InvalidState("thread is exiting".into()))?
}

/// Pops the calling thread's stack; an empty stack is [`Error::InvalidState`].
pub fn pop_tag() -> Result<()> {
    TAG_STACK
        .try_with(|s| {
            s.borrow_mut()
                .pop()
                .map(|_| ())
                .ok_or_else(|| Error::InvalidState("tag stack is empty".into()))
        })
        .map_err(|_| Error::InvalidState("thread is exiting".into()))?
}

/// Depth of the calling thread's stack.
pub fn tag_depth() -> usize {
    TAG_STACK.try_with(|s| s.borrow().len()).unwrap_or(0)
}
