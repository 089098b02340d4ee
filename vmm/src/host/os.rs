//! Thin wrappers over the Linux calls the host backend uses: memfds, mmap, mprotect, fallocate.
//!
//! Every wrapper returns [`Error::Os`] with `errno` instead of panicking. The functions that
//! replace or protect pages at a caller-chosen address are `unsafe`: whoever calls them must own
//! that address range.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};
use crate::types::{Access, DevicePtr};

/// The OS page size (at least 4096).
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096).max(4096)
}

/// Physical memory of the machine in bytes (1 GiB if it cannot be read).
pub(crate) fn physical_memory() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    u64::try_from(pages)
        .ok()
        .and_then(|p| p.checked_mul(page_size()))
        .filter(|&b| b > 0)
        .unwrap_or(1 << 30)
}

fn to_usize(value: u64, what: &'static str) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::Overflow(what))
}

fn to_off(value: u64, what: &'static str) -> Result<libc::off_t> {
    libc::off_t::try_from(value).map_err(|_| Error::Overflow(what))
}

/// Creates a close-on-exec memfd of `size` bytes (sparse: no memory is used until written).
pub(crate) fn memfd(name: &CStr, size: u64) -> Result<OwnedFd> {
    let len = to_off(size, "memfd size")?;
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(Error::os("memfd_create"));
    }
    // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate on a descriptor we own has no memory-safety preconditions.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(Error::os("ftruncate"));
    }
    Ok(fd)
}

/// `fstat` of a descriptor.
pub(crate) fn fstat(fd: BorrowedFd<'_>) -> Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat` and `fd` is open for the borrow's duration.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::os("fstat"));
    }
    Ok(st)
}

/// Bytes of memory the file really holds (`st_blocks * 512`).
pub(crate) fn resident(fd: BorrowedFd<'_>) -> Result<u64> {
    let st = fstat(fd)?;
    u64::try_from(st.st_blocks)
        .ok()
        .and_then(|b| b.checked_mul(512))
        .ok_or(Error::Overflow("st_blocks * 512"))
}

/// Frees `len` bytes at `offset` of the file (the size stays).
pub(crate) fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<()> {
    let off = to_off(offset, "punch offset")?;
    let n = to_off(len, "punch length")?;
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on an open descriptor has no memory-safety preconditions; punching only
    // zeroes file contents, which every mapping of the file may observe safely.
    if unsafe { libc::fallocate(fd.as_raw_fd(), mode, off, n) } != 0 {
        return Err(Error::os("fallocate(PUNCH_HOLE)"));
    }
    Ok(())
}

/// Duplicates a descriptor with close-on-exec set.
pub(crate) fn dup_cloexec(fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on an open descriptor has no memory-safety preconditions.
    let raw = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if raw < 0 {
        return Err(Error::os("fcntl(F_DUPFD_CLOEXEC)"));
    }
    // SAFETY: `raw` is a freshly duplicated descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn prot(access: Access) -> libc::c_int {
    match access {
        Access::None => libc::PROT_NONE,
        Access::Read => libc::PROT_READ,
        Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
    }
}

/// A read-write shared mapping of a whole file (the backend's "shadow" view), unmapped
/// on drop. The address is kept as an integer: the region is only ever accessed through raw
/// pointers derived from it by the backend, under the pinning rules of the handle table.
#[derive(Debug)]
pub(crate) struct Region {
    base: usize,
    len: usize,
}

impl Region {
    /// Maps `len` bytes of `fd` read-write, shared, anywhere.
    pub(crate) fn shared(fd: BorrowedFd<'_>, len: u64) -> Result<Region> {
        let n = to_usize(len, "shadow length")?;
        if n == 0 {
            return Err(Error::InvalidArgument("cannot map an empty file".into()));
        }
        // SAFETY: a fresh mapping at a kernel-chosen address replaces nothing; `fd` is open.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::os("mmap(shadow)"));
        }
        Ok(Region {
            base: p as usize,
            len: n,
        })
    }

    /// Start address of the region.
    pub(crate) fn base(&self) -> usize {
        self.base
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is a mapping this `Region` created and owns; nothing refers
        // to it after drop (copies pin their handles, and the backend drops regions last).
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// Reserves `size` bytes of address space aligned to `alignment`: inaccessible, no memory
/// committed. Over-allocates by `alignment` and trims both ends.
pub(crate) fn reserve(size: u64, alignment: u64) -> Result<DevicePtr> {
    let n = to_usize(size, "reservation size")?;
    let align = to_usize(alignment, "reservation alignment")?;
    let total = n
        .checked_add(align)
        .ok_or(Error::Overflow("reservation size + alignment"))?;
    // SAFETY: a fresh PROT_NONE anonymous mapping at a kernel-chosen address replaces nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let err = Error::os("mmap(reserve)");
        return Err(match &err {
            Error::Os { source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                Error::OutOfAddressSpace { requested: size }
            }
            _ => err,
        });
    }
    let raw = p as usize;
    let rem = raw % align;
    let start = if rem == 0 { raw } else { raw + (align - rem) };
    let head = start - raw;
    let tail = total - head - n;
    if head > 0 {
        // SAFETY: `raw..start` is the unaligned head of the mapping just created; nothing uses it.
        unsafe { libc::munmap(raw as *mut libc::c_void, head) };
    }
    if tail > 0 {
        // SAFETY: `start+n..raw+total` is the unused tail of the mapping just created.
        unsafe { libc::munmap((start + n) as *mut libc::c_void, tail) };
    }
    Ok(start as DevicePtr)
}

/// Returns a reservation's address space to the OS.
///
/// # Safety
///
/// The caller owns `va..va+size` (a reservation it made) and nothing will access it again.
pub(crate) unsafe fn release(va: DevicePtr, size: u64) -> Result<()> {
    let n = to_usize(size, "reservation size")?;
    // SAFETY: the caller owns the range and guarantees nothing accesses it any more.
    if unsafe { libc::munmap(va as usize as *mut libc::c_void, n) } != 0 {
        return Err(Error::os("munmap"));
    }
    Ok(())
}

/// Maps `size` bytes of `fd` from `offset` at exactly `va`, shared, with no access.
///
/// # Safety
///
/// The caller owns `va..va+size` (part of one of its reservations); whatever was mapped there is
/// replaced, so no Rust reference may point into it.
pub(crate) unsafe fn map_fixed(
    va: DevicePtr,
    size: u64,
    fd: BorrowedFd<'_>,
    offset: u64,
) -> Result<()> {
    let n = to_usize(size, "mapping size")?;
    let off = to_off(offset, "mapping offset")?;
    let want = va as usize as *mut libc::c_void;
    // SAFETY: the caller owns the target range; MAP_FIXED replaces only pages inside it.
    let p = unsafe {
        libc::mmap(
            want,
            n,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            off,
        )
    };
    if p == libc::MAP_FAILED {
        let err = Error::os("mmap(MAP_FIXED)");
        // ENOMEM: the process's mappings are at their limit (`vm.max_map_count`), as CUDA's VA
        // bookkeeping runs out: address space, not an OS failure.
        return Err(match &err {
            Error::Os { source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                Error::OutOfAddressSpace { requested: size }
            }
            _ => err,
        });
    }
    Ok(())
}

/// Puts an inaccessible, uncommitted reservation back over `va..va+size`.
///
/// # Safety
///
/// The caller owns `va..va+size` and no Rust reference points into it.
pub(crate) unsafe fn unmap_to_reserved(va: DevicePtr, size: u64) -> Result<()> {
    let n = to_usize(size, "mapping size")?;
    // SAFETY: the caller owns the range; MAP_FIXED replaces only pages inside it.
    let p = unsafe {
        libc::mmap(
            va as usize as *mut libc::c_void,
            n,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::os("mmap(MAP_FIXED, PROT_NONE)"));
    }
    Ok(())
}

/// Changes the CPU protection of `va..va+size` to match `access`.
///
/// # Safety
///
/// The caller owns `va..va+size`; removing access must not invalidate a live Rust reference.
pub(crate) unsafe fn protect(va: DevicePtr, size: u64, access: Access) -> Result<()> {
    let n = to_usize(size, "protect size")?;
    // SAFETY: the caller owns the range and guarantees no reference relies on its protection.
    if unsafe { libc::mprotect(va as usize as *mut libc::c_void, n, prot(access)) } != 0 {
        return Err(Error::os("mprotect"));
    }
    Ok(())
}

/// Maps `len` bytes of zeroed, page-aligned, private anonymous memory read-write. The memory
/// is committed (no `MAP_NORESERVE`), as pinned host memory is on CUDA: a request the host
/// cannot back is [`Error::OutOfMemory`] now rather than a kill when touched later.
pub(crate) fn anon(len: u64) -> Result<DevicePtr> {
    let n = to_usize(len, "host allocation length")?;
    // SAFETY: a fresh private mapping at a kernel-chosen address replaces nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let err = Error::os("mmap(host allocation)");
        if matches!(&err, Error::Os { source, .. } if source.raw_os_error() == Some(libc::ENOMEM)) {
            return Err(crate::hostbuf::host_out_of_memory(len));
        }
        return Err(err);
    }
    Ok(p as DevicePtr)
}

/// Unmaps memory from [`anon`].
///
/// # Safety
///
/// `ptr..ptr+len` is exactly one mapping returned by [`anon`], and nothing uses it afterwards.
pub(crate) unsafe fn unmap_anon(ptr: DevicePtr, len: u64) -> Result<()> {
    let n = to_usize(len, "host allocation length")?;
    // SAFETY: the caller guarantees the range is one of our anonymous mappings, no longer used.
    if unsafe { libc::munmap(ptr as usize as *mut libc::c_void, n) } != 0 {
        return Err(Error::os("munmap(host allocation)"));
    }
    Ok(())
}
