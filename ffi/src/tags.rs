//! Tag names ↔ ids, process-wide, and the per-thread tag stack.
//!
//! Ids start at 1 (0 is untagged). At most [`MAX_TAGS`] names are registered at once; when
//! that many are, the names no longer in use are released (no thread has them pushed, no call
//! holds them, nothing of them is live or asleep on any device, not set to overflow) and their
//! ids reused, so a server using a tag per request never runs out. A released name starts again
//! from zero.
//!
//! Lock order: this registry, then the sleeping set (`sleeping.rs`), then the overflowing set
//! (`offload.rs`), then an allocator's state.
//! Nothing takes the registry while holding the sleeping set (a [`Lease`] outlives the sleeping
//! set's guard in `strata_sleep`/`strata_wake`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;
use strata_allocator::{TagId, UNTAGGED};
use strata_vmm::{Error, Result};

/// Most names registered at once (a guard against runaway tag creation).
const MAX_TAGS: usize = 1 << 16;
/// Longest tag name accepted.
pub const MAX_TAG_LEN: usize = 256;
/// Deepest per-thread tag stack accepted.
const MAX_TAG_DEPTH: usize = 1024;

#[derive(Default)]
struct Registry {
    ids: HashMap<String, TagId>,
    names: HashMap<TagId, String>,
    /// Stack entries and calls holding each id (absent: none).
    pins: HashMap<TagId, u32>,
    free_ids: Vec<TagId>,
    /// Ids handed out so far (the next fresh id is `issued + 1`).
    issued: TagId,
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

impl Registry {
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
        let sleeping = crate::sleeping::lock();
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
                    && !crate::offload::is_overflowing(*id)
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
        registry().lock().unpin(self.0);
    }
}

/// Holds the id of registered tag `name`; an unknown name is [`Error::InvalidArgument`].
pub fn lease(name: &str) -> Result<Lease> {
    check_name(name)?;
    let mut reg = registry().lock();
    let id = reg.lookup(name)?;
    reg.pin(id);
    Ok(Lease(id))
}

/// The name of tag `id`, if registered.
pub fn name_of(id: TagId) -> Option<String> {
    registry().lock().names.get(&id).cloned()
}

/// The calling thread's stack; entries are pinned in the registry and unpinned when popped or
/// when the thread exits.
struct Stack(Vec<TagId>);

impl Drop for Stack {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let mut reg = registry().lock();
            for id in self.0.drain(..) {
                reg.unpin(id);
            }
        }
    }
}

thread_local! {
    static STACK: RefCell<Stack> = const { RefCell::new(Stack(Vec::new())) };
}

/// The tag new allocations of the calling thread get (top of its stack, or untagged).
#[inline]
pub fn current() -> TagId {
    STACK
        .try_with(|s| s.borrow().0.last().copied().unwrap_or(UNTAGGED))
        .unwrap_or(UNTAGGED)
}

/// Pushes tag `name` (registered on first use) on the calling thread's stack.
pub fn push(name: &str) -> Result<()> {
    check_name(name)?;
    STACK
        .try_with(|s| {
            let mut s = s.borrow_mut();
            if s.0.len() >= MAX_TAG_DEPTH {
                return Err(Error::InvalidState(format!(
                    "tag stack deeper than {MAX_TAG_DEPTH} (unbalanced strata_tag_push?)"
                )));
            }
            let mut reg = registry().lock();
            let id = reg.register(name)?;
            reg.pin(id);
            s.0.push(id);
            Ok(())
        })
        .map_err(|_| Error::InvalidState("thread is exiting".into()))?
}

/// Pops the calling thread's stack; an empty stack is [`Error::InvalidState`].
pub fn pop() -> Result<()> {
    STACK
        .try_with(|s| {
            let id = s
                .borrow_mut()
                .0
                .pop()
                .ok_or_else(|| Error::InvalidState("tag stack is empty".into()))?;
            registry().lock().unpin(id);
            Ok(())
        })
        .map_err(|_| Error::InvalidState("thread is exiting".into()))?
}

/// Depth of the calling thread's stack.
pub fn depth() -> usize {
    STACK.try_with(|s| s.borrow().0.len()).unwrap_or(0)
}
