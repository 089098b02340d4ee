//! Fork detection. Device memory, streams and their worker threads do not survive `fork()`:
//! the host backend's memfds would be shared with the parent (a child's write changes the
//! parent's data) and its stream threads are gone (a synchronize would wait forever), and CUDA
//! refuses a context inherited over fork. A process that opened strata calls [`arm`]; in a
//! child forked after that, [`check`] fails with a readable [`Error::InvalidState`], so every
//! call is refused instead of aliasing, corrupting or hanging. A child may still `exec`.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Once;

use crate::error::{Error, Result};

static FORKED: AtomicBool = AtomicBool::new(false);
static ARMED_PID: AtomicI32 = AtomicI32::new(0);

extern "C" fn in_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Records this process as the one that owns strata's state and registers a `pthread_atfork`
/// child handler that marks forked children. Idempotent; call it before opening a backend.
pub fn arm() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: getpid has no preconditions.
        ARMED_PID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
        // SAFETY: `in_child` is async-signal-safe (one atomic store) and lives as long as this
        // library: glibc unregisters the handlers of a shared object when it is unloaded.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            // Without the handler forks go undetected, as before; nothing else changes.
            ARMED_PID.store(0, Ordering::Relaxed);
        }
    });
}

/// True in a child forked after [`arm`].
#[inline]
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Fails in a child forked after [`arm`] (see the module documentation).
#[inline]
pub fn check() -> Result<()> {
    if forked() {
        return Err(forked_error());
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn forked_error() -> Error {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    Error::InvalidState(format!(
        "strata was initialised in process {} and this is a forked child ({pid}): device \
         memory, streams and the driver context do not survive fork, and re-initialising \
         after fork is not supported (exec, or initialise strata after forking)",
        ARMED_PID.load(Ordering::Relaxed)
    ))
}
