//! The tag table: everything the process knows about tags, in one structure ([`TagTable`]):
//! names ↔ ids, which tags sleep, which overflow and where. The per-thread tag stack is in
//! `stack.rs`; `strata_sleep`/`strata_wake` (and `strata_sleep_to_disk`) are next to the table,
//! in `../sleep.rs`. The table is below everything else in the crate (it uses only the
//! runtime).
//!
//! Ids start at 1 (0 is untagged). At most [`MAX_TAGS`] names are registered at once; when
//! that many are, the names no longer in use are released (no thread has them pushed, no call
//! holds them, nothing of them is live or asleep on any device, not set to overflow) and their
//! ids reused, so a server using a tag per request never runs out. A released name starts again
//! from zero.
//!
//! Sleep and overflow mean the same on every device: a device's allocator created after a tag
//! was put to sleep or set to overflow onto host memory gets the setting before anyone can
//! reach it ([`apply_to_new_device`]), and `strata_sleep`/`strata_wake` are serialized with
//! device creation and with each other (the sleeping set's lock is held throughout).
//!
//! # Lock order
//!
//! The table has one lock per part, always taken in this order: `names`, then `sleeping`,
//! then `overflowing`, then an allocator's state. Nothing takes `names` while holding
//! `sleeping` (a [`Lease`] outlives the sleeping set's guard in `strata_sleep`/`strata_wake`).

mod stack;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};
use strata_allocator::{CachingAllocator, TagId};
use strata_runtime::DeviceRuntime;
use strata_vmm::{Error, Result};

pub use stack::{current, depth, pop, push};

/// Most names registered at once (a guard against runaway tag creation).
const MAX_TAGS: usize = 1 << 16;
/// Longest tag name accepted.
pub const MAX_TAG_LEN: usize = 256;

/// Where a tag overflows (the last `strata_set_overflow` or `strata_set_overflow_peer` wins).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Host memory, on every device's allocator, existing and created later
    /// ([`apply_to_new_device`]).
    Host,
    /// The pages of device `lender`, on the allocators that existed when it was set, until
    /// `lender` revokes them.
    Peer(usize),
}

/// The process's tags (see the module documentation for the lock order).
#[derive(Default)]
struct TagTable {
    names: Mutex<Names>,
    /// Tags asleep; locked for a whole sleep, wake or device creation.
    sleeping: Mutex<HashSet<TagId>>,
    /// Tags allowed to overflow. A tag here is in use: its name is not released, so its id (and
    /// the setting that goes with it) never passes to another name.
    overflowing: Mutex<HashMap<TagId, Overflow>>,
}

fn table() -> &'static TagTable {
    static TABLE: OnceLock<TagTable> = OnceLock::new();
    TABLE.get_or_init(TagTable::default)
}

fn names() -> MutexGuard<'static, Names> {
    table().names.lock()
}

/// The set of sleeping tags, locked for a whole sleep, wake or device creation.
pub fn sleeping() -> MutexGuard<'static, HashSet<TagId>> {
    table().sleeping.lock()
}

/// The tags set to overflow, and where.
pub fn overflowing() -> MutexGuard<'static, HashMap<TagId, Overflow>> {
    table().overflowing.lock()
}

/// Applies the sleeping tags (held: `sleeping`) and the tags overflowing onto host memory to
/// `device`'s new allocator `a`, not yet published (nothing to copy: the device was never
/// used).
pub fn apply_to_new_device(
    sleeping: &HashSet<TagId>,
    device: &DeviceRuntime,
    a: &CachingAllocator,
) -> Result<()> {
    for &tag in sleeping {
        a.sleep(tag, false)?;
    }
    for (&id, &to) in overflowing().iter() {
        if to == Overflow::Host {
            set_overflow(device, a, id, true)?;
        }
    }
    Ok(())
}

/// Lets tag `id` overflow onto `device`'s host pool on allocator `a`, or stops it.
pub fn set_overflow(
    device: &DeviceRuntime,
    a: &CachingAllocator,
    id: TagId,
    on: bool,
) -> Result<()> {
    let to = if on {
        Some(Arc::clone(device.host_pool()?))
    } else {
        None
    };
    a.set_overflow(id, to)
}

#[derive(Default)]
struct Names {
    ids: HashMap<String, TagId>,
    names: HashMap<TagId, String>,
    /// Stack entries and calls holding each id (absent: none).
    pins: HashMap<TagId, u32>,
    free_ids: Vec<TagId>,
    /// Ids handed out so far (the next fresh id is `issued + 1`).
    issued: TagId,
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

impl Names {
    fn lookup(&self, name: &str) -> Result<TagId> {
        self.ids.get(name).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "unknown tag {name:?} (no strata_tag_push named it, or it was released)"
            ))
        })
    }

    fn register(&mut self, name: &str) -> Result<TagId> {
        if let Some(&id) = self.ids.get(name) {
            return Ok(id);
        }
        if self.free_ids.is_empty() && self.issued as usize >= MAX_TAGS {
            self.release_unused();
        }
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None if (self.issued as usize) < MAX_TAGS => {
                self.issued += 1;
                self.issued
            }
            None => {
                return Err(Error::InvalidState(format!(
                    "{MAX_TAGS} tag names are in use (pushed, live or asleep); cannot register \
                     {name:?}"
                )))
            }
        };
        self.ids.insert(name.to_string(), id);
        self.names.insert(id, name.to_string());
        Ok(id)
    }

    fn pin(&mut self, id: TagId) {
        *self.pins.entry(id).or_insert(0) += 1;
    }

    fn unpin(&mut self, id: TagId) {
        if let Some(n) = self.pins.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                self.pins.remove(&id);
            }
        }
    }

    /// Releases every name nothing uses (see the module documentation).
    #[cold]
    #[inline(never)]
    fn release_unused(&mut self) {
        let sleeping = sleeping();
        let overflowing = overflowing();
        let allocators: Vec<_> = strata_runtime::existing_global()
            .map(|g| g.existing_all().map(|(_, a)| a).collect())
            .unwrap_or_default();
        let unpinned: Vec<TagId> = self
            .names
            .keys()
            .copied()
            .filter(|id| {
                !self.pins.contains_key(id)
                    && !sleeping.contains(id)
                    && !overflowing.contains_key(id)
            })
            .collect();
        // Nobody can allocate under, sleep or push an unpinned id while the lock is held, so
        // an idle tag stays idle between the check and the release.
        for id in unpinned {
            if allocators.iter().all(|a| a.tag_is_idle(id)) {
                for a in &allocators {
                    a.retire_tag(id);
                }
                if let Some(name) = self.names.remove(&id) {
                    self.ids.remove(&name);
                }
                self.free_ids.push(id);
            }
        }
    }
}

/// An id held for the length of a call (sleep, wake, stats), so it is not released under it.
pub struct Lease(TagId);

impl Lease {
    pub fn id(&self) -> TagId {
        self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        names().unpin(self.0);
    }
}

/// Holds the id of registered tag `name`; an unknown name is [`Error::InvalidArgument`].
pub fn lease(name: &str) -> Result<Lease> {
    check_name(name)?;
    let mut reg = names();
    let id = reg.lookup(name)?;
    reg.pin(id);
    Ok(Lease(id))
}

/// The name of tag `id`, if registered.
pub fn name_of(id: TagId) -> Option<String> {
    names().names.get(&id).cloned()
}
