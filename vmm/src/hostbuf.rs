//! [`HostBuffer`]: host memory for the tiers, allocated through [`Backend::host_alloc`] (pinned on
//! CUDA, so DMA runs at full speed), with bounds-checked byte and file I/O.
//!
//! Host memory is CPU-accessible on every backend (it is not device memory), so reading and
//! writing it here is allowed in strict mode. The buffer never hands out references into its
//! memory: bytes move with `memcpy`, `pread` and `pwrite` on raw pointers, so a copy engine
//! writing one range while the CPU touches another is sound. Ordering accesses to the *same*
//! range against in-flight copies (events) is the caller's job, as with device memory.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use parking_lot::Mutex;

use crate::raii::{process_is_exiting, record_deferred, Event, Reservation};
use crate::types::{CopyDesc, DevicePtr, Location, StreamHandle};
use crate::work::DeviceWork;

/// Most bytes one [`Backend::host_alloc`] call takes: pinning (`cudaHostRegister`) of 512 GiB or
/// more in one call fails; vLLM registers in chunks of at most 64 GiB (REFERENCE.md §6).
pub const MAX_HOST_CHUNK: u64 = 64 << 30;

/// A zeroed `Vec<u8>` of `len` bytes whose allocation may fail: exhaustion of host memory is
/// [`Error::OutOfMemory`] on [`Location::Host`], never an abort. For buffers sized by a caller
/// (host copies, staging), where `vec![0; len]` would kill the process.
pub fn try_host_vec(len: u64) -> Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(|_| Error::Overflow("host buffer size"))?;
    let mut v = Vec::new();
    if v.try_reserve_exact(n).is_err() {
        return Err(host_out_of_memory(len));
    }
    v.resize(n, 0);
    Ok(v)
}

/// [`Error::OutOfMemory`] on the host for a request of `requested` bytes.
#[cold]
pub(crate) fn host_out_of_memory(requested: u64) -> Error {
    Error::OutOfMemory {
        location: Location::Host,
        requested,
        available: available_host_memory(),
    }
}

/// Free host memory in bytes (`_SC_AVPHYS_PAGES`), 0 when unknown.
fn available_host_memory() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_AVPHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    u64::try_from(pages)
        .ok()
        .zip(u64::try_from(page).ok())
        .and_then(|(n, p)| n.checked_mul(p))
        .unwrap_or(0)
}

/// An owned host allocation of one backend; freed on drop.
pub struct HostBuffer {
    backend: Arc<dyn Backend>,
    ptr: DevicePtr,
    size: u64,
    /// Events recorded after copies queued through [`copy_async_in`] that touch this buffer:
    /// dropping the buffer waits for them, so its memory outlives every copy.
    inflight: Mutex<Vec<Arc<Event>>>,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .finish()
    }
}

impl HostBuffer {
    /// Allocates `size` bytes (at most [`MAX_HOST_CHUNK`]) of page-aligned host memory.
    pub fn new(backend: &Arc<dyn Backend>, size: u64) -> Result<Self> {
        crate::raii::check_deferred()?;
        let ptr = backend.host_alloc(size)?;
        Ok(HostBuffer {
            backend: Arc::clone(backend),
            ptr,
            size,
            inflight: Mutex::new(Vec::new()),
        })
    }

    /// Address of the first byte (usable as a copy source or destination).
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    fn range(&self, offset: u64, len: usize) -> Result<*mut u8> {
        let end = offset
            .checked_add(len as u64)
            .ok_or(Error::Overflow("host buffer offset + length"))?;
        if end > self.size {
            return Err(Error::InvalidArgument(format!(
                "host buffer range {offset:#x}+{len:#x} beyond its {:#x} bytes",
                self.size
            )));
        }
        let base = usize::try_from(self.ptr).map_err(|_| Error::Overflow("host address"))?;
        Ok((base + offset as usize) as *mut u8)
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        let p = self.range(offset, src.len())?;
        // SAFETY: `p..p+len` lies inside this live allocation (checked above); `src` is a
        // distinct Rust slice, so the ranges do not overlap; no reference into the buffer exists.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        Ok(())
    }

    /// Copies bytes of the buffer at `offset` into `dst`.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let p = self.range(offset, dst.len())?;
        // SAFETY: as in `write_at`, with the roles swapped; `dst` is exclusively borrowed.
        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Reads `len` bytes of `file` at `file_offset` into the buffer at `offset` (`pread`, looping
    /// over short reads; a read past the end of the file is [`Error::InvalidState`]). With
    /// `O_DIRECT`, offsets and lengths must suit the device (`EINVAL` otherwise).
    pub fn read_from_file(
        &self,
        file: &File,
        file_offset: u64,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        self.file_io(file, file_offset, offset, len, FileIo::Read)
    }

    /// Writes `len` bytes of the buffer at `offset` to `file` at `file_offset` (`pwrite`,
    /// looping over short writes).
    pub fn write_to_file(
        &self,
        file: &File,
        file_offset: u64,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        self.file_io(file, file_offset, offset, len, FileIo::Write)
    }

    /// `pread`/`pwrite` of `len` bytes between the buffer at `offset` and `file` at `file_offset`,
    /// looping over short transfers and `EINTR`.
    fn file_io(
        &self,
        file: &File,
        file_offset: u64,
        offset: u64,
        len: u64,
        io: FileIo,
    ) -> Result<()> {
        let n = usize::try_from(len).map_err(|_| Error::Overflow("file I/O length"))?;
        let p = self.range(offset, n)?;
        let mut done = 0usize;
        while done < n {
            let off = file_offset
                .checked_add(done as u64)
                .and_then(|o| libc::off_t::try_from(o).ok())
                .ok_or(Error::Overflow("file offset"))?;
            // SAFETY: `p+done..p+n` lies inside this live allocation (checked by `range`) and no
            // Rust reference points into it (pread writes it, pwrite only reads it); the
            // descriptor stays open for the borrow of `file`.
            let r = unsafe {
                match io {
                    FileIo::Read => {
                        libc::pread(file.as_raw_fd(), p.add(done).cast(), n - done, off)
                    }
                    FileIo::Write => libc::pwrite(
                        file.as_raw_fd(),
                        p.add(done).cast_const().cast(),
                        n - done,
                        off,
                    ),
                }
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Os {
                    call: io.call(),
                    source: e,
                });
            }
            if r == 0 {
                return Err(Error::InvalidState(format!(
                    "{} moved nothing after {done} of {n} bytes at file offset {file_offset:#x}",
                    io.call()
                )));
            }
            done += r as usize;
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum FileIo {
    Read,
    Write,
}

impl FileIo {
    fn call(self) -> &'static str {
        match self {
            FileIo::Read => "pread",
            FileIo::Write => "pwrite",
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if process_is_exiting() {
            return;
        }
        for ev in self.inflight.get_mut().drain(..) {
            if let Err(e) = ev.synchronize() {
                record_deferred(e);
            }
        }
        // SAFETY: `ptr`/`size` came from `host_alloc` of this backend; the buffer is going away,
        // so no one reads or writes it any more (owners wait for their copies before dropping).
        if let Err(e) = unsafe { self.backend.host_free(self.ptr, self.size) } {
            record_deferred(e);
        }
    }
}

/// Where the ranges of a safe copy may lie: inside one of `buffers` (host memory this backend
/// allocated) or inside one of `reservations` (device VA, validated by the backend).
#[derive(Clone, Copy)]
pub struct CopyScope<'a> {
    pub buffers: &'a [&'a HostBuffer],
    pub reservations: &'a [&'a Reservation],
}

impl CopyScope<'_> {
    fn check(&self, addr: DevicePtr, len: u64) -> Result<Option<usize>> {
        if let Some(i) = self.buffers.iter().position(|b| {
            addr >= b.ptr && addr.checked_add(len).is_some_and(|e| e <= b.ptr + b.size)
        }) {
            return Ok(Some(i));
        }
        if self.reservations.iter().any(|r| r.contains(addr, len)) {
            return Ok(None);
        }
        Err(Error::IllegalAccess {
            va: addr,
            size: len,
            reason: "copy range lies in no given host buffer or reservation",
        })
    }
}

/// How [`copy_async_in`] submits.
#[derive(Clone, Copy)]
pub enum CopyKind<'a> {
    /// `Backend::copy_async` with these descriptors (one batch).
    Batch(&'a [CopyDesc]),
    /// One `Backend::copy_async` call per descriptor (the naive baseline).
    Each(&'a [CopyDesc]),
    /// `DeviceWork::copy_blocks_async` of `work` (the same backend's): `(src, dst)` pairs of
    /// `len` bytes (one kernel launch).
    Blocks {
        work: &'a dyn DeviceWork,
        len: u64,
        pairs: &'a [(DevicePtr, DevicePtr)],
    },
}

/// The safe way to queue copies: every range must lie inside a buffer or a reservation of
/// `scope`; an event recorded after the copies is kept by every buffer touched, and a buffer's
/// drop waits for it, so host memory outlives the copies. Returns that event.
pub fn copy_async_in(
    backend: &Arc<dyn Backend>,
    stream: StreamHandle,
    what: CopyKind<'_>,
    scope: CopyScope<'_>,
) -> Result<Arc<Event>> {
    let mut touched = vec![false; scope.buffers.len()];
    let mut mark = |addr: DevicePtr, len: u64| -> Result<()> {
        if len > 0 {
            if let Some(i) = scope.check(addr, len)? {
                touched[i] = true;
            }
        }
        Ok(())
    };
    match what {
        CopyKind::Batch(copies) | CopyKind::Each(copies) => {
            for c in copies {
                mark(c.src, c.len)?;
                mark(c.dst, c.len)?;
            }
        }
        CopyKind::Blocks { len, pairs, .. } => {
            for &(s, d) in pairs {
                mark(s, len)?;
                mark(d, len)?;
            }
        }
    }
    let event = Arc::new(Event::new(backend)?);
    // Register before submitting: a buffer dropped concurrently then waits for this event
    // (an unrecorded event reports complete, and nothing was queued yet).
    for (b, t) in scope.buffers.iter().zip(&touched) {
        if *t {
            let mut inflight = b.inflight.lock();
            inflight.retain(|e| !matches!(e.query(), Ok(true)));
            inflight.push(Arc::clone(&event));
        }
    }
    // SAFETY: every host range lies inside a live `HostBuffer` of `scope` (checked above); each
    // touched buffer keeps `event` (recorded after these copies) and its drop waits for it, so
    // the memory stays valid until the copies complete. Ranges inside reservations are device
    // VA, validated by the backend. Concurrent CPU writes to the same bytes are ordered by the
    // caller with the returned event (a byte race, not a memory-safety one).
    unsafe {
        match what {
            CopyKind::Batch(copies) => backend.copy_async(stream, copies)?,
            CopyKind::Each(copies) => {
                for c in copies {
                    backend.copy_async(stream, std::slice::from_ref(c))?;
                }
            }
            CopyKind::Blocks { work, len, pairs } => work.copy_blocks_async(stream, len, pairs)?,
        }
    }
    event.record(stream)?;
    Ok(event)
}
