//! The disk tier: one file in a configured directory, fixed-size block slots, space capped, an
//! I/O thread pool, and `O_DIRECT` where the filesystem allows it (falling back when it does not).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};
use strata_vmm::{Error, HostBuffer, Result};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The completion of one I/O request.
#[derive(Clone, Default)]
pub struct IoTicket {
    inner: Arc<(Mutex<Option<Result<()>>>, Condvar)>,
}

impl IoTicket {
    fn complete(&self, r: Result<()>) {
        let (m, cv) = &*self.inner;
        *m.lock() = Some(r);
        cv.notify_all();
    }

    /// Waits for the request and returns its outcome (once; later calls return `Ok`).
    pub fn wait(&self) -> Result<()> {
        let (m, cv) = &*self.inner;
        let mut g = m.lock();
        while g.is_none() {
            cv.wait(&mut g);
        }
        g.replace(Ok(())).unwrap_or(Ok(()))
    }
}

/// A fixed pool of I/O threads.
pub struct IoPool {
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl IoPool {
    pub fn new(threads: usize) -> Result<Self> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            let h = std::thread::Builder::new()
                .name(format!("strata-io-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .map_err(|source| Error::Os {
                    call: "spawn io thread",
                    source,
                })?;
            handles.push(h);
        }
        Ok(IoPool {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(handles),
        })
    }

    /// Runs `f` on a pool thread; its outcome completes the returned ticket.
    pub fn submit(&self, f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<IoTicket> {
        let ticket = IoTicket::default();
        let t = ticket.clone();
        let job: Job = Box::new(move || t.complete(f()));
        self.tx
            .lock()
            .as_ref()
            .ok_or_else(|| Error::InvalidState("io pool shut down".into()))?
            .send(job)
            .map_err(|_| Error::InvalidState("io pool threads are gone".into()))?;
        Ok(ticket)
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        drop(self.tx.lock().take());
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
    }
}

/// Fault injection for tests: while a [`ReadHold`] lives, reads of its file wait (writes do not).
/// Lets a test show what proceeds while a disk read is slow.
#[derive(Default)]
struct ReadGate {
    held: AtomicBool,
    /// Reads waiting at the gate.
    waiting: Mutex<usize>,
    changed: Condvar,
}

impl ReadGate {
    #[cold]
    #[inline(never)]
    fn pass(&self) {
        let mut waiting = self.waiting.lock();
        *waiting += 1;
        self.changed.notify_all();
        while self.held.load(Ordering::Acquire) {
            self.changed.wait(&mut waiting);
        }
        *waiting -= 1;
    }
}

/// Holds the reads of a [`DiskFile`] until dropped ([`DiskFile::hold_reads`]).
pub struct ReadHold {
    gate: Arc<ReadGate>,
}

impl ReadHold {
    /// Waits until `n` reads wait at the hold, for at most `timeout`; false on timeout.
    pub fn wait_for_readers(&self, n: usize, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut waiting = self.gate.waiting.lock();
        while *waiting < n {
            if self
                .gate
                .changed
                .wait_until(&mut waiting, deadline)
                .timed_out()
            {
                return *waiting >= n;
            }
        }
        true
    }
}

impl Drop for ReadHold {
    fn drop(&mut self) {
        let _waiting = self.gate.waiting.lock();
        self.gate.held.store(false, Ordering::Release);
        self.gate.changed.notify_all();
    }
}

/// The file behind the disk tier.
pub struct DiskFile {
    path: PathBuf,
    /// Buffered descriptor (always open).
    buffered: File,
    /// `O_DIRECT` descriptor while the filesystem accepts it.
    direct: Mutex<Option<Arc<File>>>,
    direct_disabled: AtomicBool,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    gate: Arc<ReadGate>,
}

impl std::fmt::Debug for DiskFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskFile")
            .field("path", &self.path)
            .field("direct", &self.is_direct())
            .finish()
    }
}

static FILE_SEQ: AtomicU64 = AtomicU64::new(0);

impl DiskFile {
    /// Creates a fresh file in `dir` (which must exist and be writable). Tries `O_DIRECT` with
    /// `want_direct`; a filesystem that refuses it (EINVAL, e.g. tmpfs) gets buffered I/O.
    pub fn create(dir: &Path, want_direct: bool) -> Result<Self> {
        let meta = std::fs::metadata(dir).map_err(|source| Error::Os {
            call: "disk tier directory",
            source,
        })?;
        if !meta.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "disk tier directory {} is not a directory",
                dir.display()
            )));
        }
        let name = format!(
            "strata-tier-{}-{}.blocks",
            std::process::id(),
            FILE_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| Error::Os {
                call: "create disk tier file",
                source,
            })?;
        let direct = if want_direct {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .ok()
                .map(Arc::new)
        } else {
            None
        };
        Ok(DiskFile {
            path,
            buffered,
            direct_disabled: AtomicBool::new(direct.is_none()),
            direct: Mutex::new(direct),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            gate: Arc::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True while I/O goes through `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        !self.direct_disabled.load(Ordering::Relaxed)
    }

    fn with_fallback(&self, op: impl Fn(&File) -> Result<()>) -> Result<()> {
        let direct = if self.is_direct() {
            self.direct.lock().clone()
        } else {
            None
        };
        if let Some(f) = direct {
            match op(&f) {
                Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
                    // The filesystem (or this alignment) refuses direct I/O: buffered from now on.
                    self.direct_disabled.store(true, Ordering::Relaxed);
                    *self.direct.lock() = None;
                }
                other => return other,
            }
        }
        op(&self.buffered)
    }

    /// Fault injection for tests: reads that start while the returned hold lives wait until it
    /// is dropped (one hold at a time).
    pub fn hold_reads(&self) -> ReadHold {
        self.gate.held.store(true, Ordering::Release);
        ReadHold {
            gate: Arc::clone(&self.gate),
        }
    }

    /// Reads `len` bytes at `file_offset` into `buf` at `offset`.
    pub fn read_into(
        &self,
        buf: &HostBuffer,
        offset: u64,
        file_offset: u64,
        len: u64,
    ) -> Result<()> {
        if self.gate.held.load(Ordering::Acquire) {
            self.gate.pass();
        }
        self.with_fallback(|f| buf.read_from_file(f, file_offset, offset, len))?;
        self.bytes_read.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `len` bytes of `buf` at `offset` to `file_offset`.
    pub fn write_from(
        &self,
        buf: &HostBuffer,
        offset: u64,
        file_offset: u64,
        len: u64,
    ) -> Result<()> {
        self.with_fallback(|f| buf.write_to_file(f, file_offset, offset, len))?;
        self.bytes_written.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
