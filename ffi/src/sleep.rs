//! Sleep and wake of a tag on every device: `strata_sleep` (host copies or none),
//! `strata_sleep_to_disk` (torch_memory_saver's disk backup: the contents in an unlinked file,
//! restored by `strata_wake` with the file reads and the device writes pipelined) and
//! `strata_wake`, next to the tag table (`tags/`): the sleeping set is the table's; its lock is
//! held for a whole sleep or wake.

use std::ffi::{c_char, c_int};
use std::path::Path;

use strata_allocator::{CachingAllocator, TagId};
use strata_vmm::{Error, Result};

use crate::global::global;
use crate::{boundary, tags};

/// Puts tag `tag` to sleep on every device: waits for the streams using its memory, copies its
/// live allocations to host memory when `keep_host_copy` is non-zero, then unmaps and releases
/// its pages; pointers keep their addresses. Allocating under a sleeping tag fails
/// (`STRATA_INVALID_STATE`); freeing its pointers works. A device first used while the tag
/// sleeps starts with it asleep. All or nothing: a tag already asleep on some device is
/// refused before anything changes, and if one device fails, those already put to sleep by
/// this call are woken again; should that wake fail too, the status is
/// `STRATA_INVALID_STATE` and the message names the devices left asleep (`strata_wake` wakes
/// them).
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_sleep(tag: *const c_char, keep_host_copy: c_int) -> c_int {
    boundary::status("strata_sleep", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        sleep_tag(name, |a, id| a.sleep(id, keep_host_copy != 0))
    })
}

/// Puts tag `name` to sleep on every device with `put` (host copies, none, or a file), all or
/// nothing: a tag already asleep anywhere is refused before anything changes, and a device's
/// failure wakes the devices this call put to sleep (see [`roll_back_sleep`]).
pub(crate) fn sleep_tag(
    name: &str,
    put: impl Fn(&CachingAllocator, TagId) -> Result<()>,
) -> Result<()> {
    let lease = tags::lease(name)?;
    let id = lease.id();
    let g = global()?;
    let mut sleeping = tags::sleeping();
    let asleep_on: Vec<String> = g
        .existing_all()
        .filter(|(_, a)| a.is_asleep(id))
        .map(|(d, _)| d.to_string())
        .collect();
    if sleeping.contains(&id) || !asleep_on.is_empty() {
        let place = match asleep_on.len() {
            0 => String::new(),
            1 => format!(" on device {}", asleep_on[0]),
            _ => format!(" on devices {}", asleep_on.join(", ")),
        };
        return Err(Error::InvalidState(format!(
            "tag {name:?} is already asleep{place}"
        )));
    }
    let mut slept: Vec<(usize, &CachingAllocator)> = Vec::new();
    for (d, a) in g.existing_all() {
        if let Err(e) = put(a, id) {
            return Err(roll_back_sleep(name, id, d, e, &slept));
        }
        slept.push((d, a));
    }
    sleeping.insert(id);
    Ok(())
}

/// Wakes the devices a failed `strata_sleep` already put to sleep. The sleep's error is what
/// the caller sees, unless a wake fails too: then the state no longer matches that error, and
/// the caller is told which devices stay asleep.
#[cold]
#[inline(never)]
fn roll_back_sleep(
    name: &str,
    id: TagId,
    failed_on: usize,
    error: Error,
    slept: &[(usize, &CachingAllocator)],
) -> Error {
    let stuck: Vec<String> = slept
        .iter()
        .filter_map(|(d, a)| a.wake(id).err().map(|e| format!("device {d} ({e})")))
        .collect();
    if stuck.is_empty() {
        return error;
    }
    Error::InvalidState(format!(
        "putting tag {name:?} to sleep failed on device {failed_on} ({error}), and waking it \
         back failed on {}: the tag stays asleep there; strata_wake wakes it",
        stuck.join(", ")
    ))
}

/// Wakes tag `tag` on every device where it sleeps: maps fresh pages at the same addresses and
/// restores the host copies (or zeros). A tag asleep nowhere is `STRATA_INVALID_STATE`. On
/// failure (out of memory included) the devices not yet woken stay asleep; call again.
///
/// # Safety
///
/// `tag` is NULL (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn strata_wake(tag: *const c_char) -> c_int {
    boundary::status("strata_wake", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        wake_tag(name)
    })
}

/// Wakes tag `name` on every device where it sleeps (see `strata_wake`).
pub(crate) fn wake_tag(name: &str) -> Result<()> {
    let lease = tags::lease(name)?;
    let id = lease.id();
    let g = global()?;
    let mut sleeping = tags::sleeping();
    let mut woke = sleeping.contains(&id);
    for (_, a) in g.existing_all() {
        if a.is_asleep(id) {
            a.wake(id)?;
            woke = true;
        }
    }
    if !woke {
        return Err(Error::InvalidState(format!("tag {name:?} is not asleep")));
    }
    sleeping.remove(&id);
    Ok(())
}

/// Puts tag `tag` to sleep on every device in use, its live allocations copied into an unlinked
/// file in directory `dir`. All or nothing across devices. See `include/strata.h`.
///
/// # Safety
///
/// `tag` and `dir` are NULL (an error) or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn strata_sleep_to_disk(tag: *const c_char, dir: *const c_char) -> c_int {
    boundary::status("strata_sleep_to_disk", || {
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { boundary::c_str("tag", tag) }?;
        // SAFETY: as above.
        let dir = Path::new(unsafe { boundary::c_str("dir", dir) }?);
        sleep_tag(name, |a, id| a.sleep_to_disk(id, dir))
    })
}
