//! Which tags sleep, process-wide, so that sleep and wake mean the same on every device: a tag
//! put to sleep before a device is first used sleeps there too once the device's allocator is
//! created ([`apply_to_new_device`]), and `strata_sleep` / `strata_wake` are serialized with
//! device creation and with each other (one gate), so a device cannot appear half-way through.

use std::collections::HashSet;
use std::sync::OnceLock;

use parking_lot::{Mutex, MutexGuard};
use strata_allocator::{CachingAllocator, TagId};
use strata_vmm::Result;

fn gate() -> &'static Mutex<HashSet<TagId>> {
    static SLEEPING: OnceLock<Mutex<HashSet<TagId>>> = OnceLock::new();
    SLEEPING.get_or_init(Mutex::default)
}

/// The set of sleeping tags, locked for a whole sleep, wake or device creation.
pub fn lock() -> MutexGuard<'static, HashSet<TagId>> {
    gate().lock()
}

/// Puts the sleeping tags to sleep on a device's new allocator (nothing to copy: the device
/// was never used). Called with the allocator not yet published, under [`lock`].
pub fn apply_to_new_device(sleeping: &HashSet<TagId>, allocator: &CachingAllocator) -> Result<()> {
    for &tag in sleeping {
        allocator.sleep(tag, false)?;
    }
    Ok(())
}
