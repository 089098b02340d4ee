//! Process-wide state behind the C ABI: the process's [`Runtime`] (backend, and per device one
//! page pool, the caching allocator over it, Harvest's lending over the same pools), created
//! lazily on first use, the tag-name registry and the per-thread tag stack.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;
use strata_allocator::{CachingConfig, PoolConfig, TagId, UNTAGGED};
use strata_runtime::{Runtime, RuntimeConfig};
use strata_vmm::{Error, Result};

/// Most tags the registry hands out (a guard against runaway tag creation).
const MAX_TAGS: usize = 1 << 16;
/// Longest tag name accepted.
pub const MAX_TAG_LEN: usize = 256;
/// Deepest per-thread tag stack accepted.
const MAX_TAG_DEPTH: usize = 1024;

/// The process's runtime, opening the backend on first use.
#[inline]
pub fn global() -> Result<&'static Runtime> {
    strata_runtime::global(|| RuntimeConfig {
        pool: PoolConfig::default(),
        caching: CachingConfig {
            // A library inside someone else's process: no leak report at teardown.
            report_leaks: false,
            ..CachingConfig::default()
        },
    })
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
