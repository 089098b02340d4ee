//! Process-wide state behind the C ABI: the process's [`Runtime`] (backend, and per device one
//! page pool, the caching allocator over it, Harvest's lending over the same pools), created
//! lazily on first use. Tags, sleeping and overflowing ones among them, live in `tags/`.

use strata_allocator::{CachingAllocator, CachingConfig, PoolConfig};
use strata_runtime::{Runtime, RuntimeConfig};
use strata_vmm::Result;

/// The process's runtime, opening the backend on first use; its creation starts publishing
/// the figures for `strata ps` (`ops.rs`), off the allocation path.
#[inline]
pub fn global() -> Result<&'static Runtime> {
    strata_runtime::global(|| {
        crate::ops::start();
        RuntimeConfig {
            pool: PoolConfig::default(),
            caching: CachingConfig {
                // A library inside someone else's process: no leak report at teardown.
                report_leaks: false,
                ..CachingConfig::default()
            },
        }
    })
}

/// The caching allocator of `device`, created on first use; a device first used while tags
/// sleep starts with them asleep (the tag table, `tags/`). Every allocator the C ABI creates comes
/// through here, under the sleeping set's lock.
#[inline]
pub fn allocator(rt: &Runtime, device: i32) -> Result<&CachingAllocator> {
    let d = rt.ordinal(device)?;
    match rt.existing(d) {
        Some(a) => Ok(a),
        None => create_allocator(rt, d),
    }
}

/// Creates `device`'s allocator with the sleeping and overflowing tags applied before any other
/// thread can reach it (a thread that found it half-configured could allocate under a sleeping
/// tag); if applying them fails, no allocator is left behind.
#[cold]
#[inline(never)]
fn create_allocator(rt: &Runtime, device: usize) -> Result<&CachingAllocator> {
    let sleeping = crate::tags::sleeping();
    let d = &rt.devices()[device];
    d.allocator_with(|a| crate::tags::apply_to_new_device(&sleeping, d, a))
}
