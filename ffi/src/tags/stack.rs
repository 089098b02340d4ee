//! The per-thread tag stack: the tag new allocations of a thread get. Entries are pinned in the
//! tag table's names, so a pushed name is never released.

use std::cell::RefCell;

use strata_allocator::{TagId, UNTAGGED};
use strata_vmm::{Error, Result};

use super::{check_name, names};

/// Deepest per-thread tag stack accepted.
const MAX_TAG_DEPTH: usize = 1024;

/// The calling thread's stack; entries are pinned in the registry and unpinned when popped or
/// when the thread exits.
struct Stack(Vec<TagId>);

impl Drop for Stack {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let mut reg = names();
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
            let mut reg = names();
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
            names().unpin(id);
            Ok(())
        })
        .map_err(|_| Error::InvalidState("thread is exiting".into()))?
}

/// Depth of the calling thread's stack.
pub fn depth() -> usize {
    STACK.try_with(|s| s.borrow().0.len()).unwrap_or(0)
}
