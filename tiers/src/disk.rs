//! The disk tier: one file in a configured directory, fixed-size block slots, space capped, an
//! I/O thread pool whose demand requests go before background ones ([`Lane`]), and `O_DIRECT`
//! where the filesystem allows it (falling back when it does not).

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// Which queue of an [`IoPool`] a request joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Needed now (a restore waits for it): runs before every background request not yet
    /// started.
    Demand,
    /// Ahead of need (staging): starts only while no demand request is queued and no
    /// [`DemandGuard`] lives.
    Background,
}

type Jobs = (VecDeque<Job>, VecDeque<Job>);

#[derive(Default)]
struct Queues {
    jobs: Jobs,
    /// Live [`DemandGuard`]s.
    demand_ops: usize,
    closed: bool,
}

impl Queues {
    fn next(&mut self) -> Option<Job> {
        if let Some(job) = self.jobs.0.pop_front() {
            return Some(job);
        }
        if self.demand_ops == 0 {
            return self.jobs.1.pop_front();
        }
        None
    }
}

#[derive(Default)]
struct Shared {
    queues: Mutex<Queues>,
    changed: Condvar,
}

/// A fixed pool of I/O threads with two lanes: demand requests first, background requests only
/// while no demand is pending ([`Lane`]). A request already running is never interrupted.
pub struct IoPool {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// While it lives, background requests of its [`IoPool`] do not start (see
/// [`IoPool::demand`]).
pub struct DemandGuard<'p> {
    shared: &'p Shared,
}

impl Drop for DemandGuard<'_> {
    fn drop(&mut self) {
        self.shared.queues.lock().demand_ops -= 1;
        self.shared.changed.notify_all();
    }
}

impl IoPool {
    pub fn new(threads: usize) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let worker = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name(format!("strata-io-{i}"))
                .spawn(move || loop {
                    let mut q = worker.queues.lock();
                    let job = loop {
                        if let Some(job) = q.next() {
                            break Some(job);
                        }
                        if q.closed && q.jobs.0.is_empty() && q.jobs.1.is_empty() {
                            break None;
                        }
                        worker.changed.wait(&mut q);
                    };
                    drop(q);
                    match job {
                        Some(job) => job(),
                        None => return,
                    }
                })
                .map_err(|source| Error::Os {
                    call: "spawn io thread",
                    source,
                });
            match h {
                Ok(h) => handles.push(h),
                Err(e) => {
                    let pool = IoPool {
                        shared,
                        threads: Mutex::new(handles),
                    };
                    drop(pool);
                    return Err(e);
                }
            }
        }
        Ok(IoPool {
            shared,
            threads: Mutex::new(handles),
        })
    }

    /// Runs `f` on a pool thread in `lane`; its outcome completes the returned ticket.
    pub fn submit(
        &self,
        lane: Lane,
        f: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<IoTicket> {
        let ticket = IoTicket::default();
        let t = ticket.clone();
        let job: Job = Box::new(move || t.complete(f()));
        let mut q = self.shared.queues.lock();
        if q.closed {
            return Err(Error::InvalidState("io pool shut down".into()));
        }
        match lane {
            Lane::Demand => q.jobs.0.push_back(job),
            Lane::Background => q.jobs.1.push_back(job),
        }
        drop(q);
        self.shared.changed.notify_one();
        Ok(ticket)
    }

    /// Holds back background requests not yet started until the guard drops: for an operation
    /// whose demand requests come in rounds (a background read must not slip in between).
    pub fn demand(&self) -> DemandGuard<'_> {
        self.shared.queues.lock().demand_ops += 1;
        DemandGuard {
            shared: &self.shared,
        }
    }

    /// Requests waiting to start: (demand, background).
    pub fn queued(&self) -> (usize, usize) {
        let q = self.shared.queues.lock();
        (q.jobs.0.len(), q.jobs.1.len())
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.shared.queues.lock().closed = true;
        self.shared.changed.notify_all();
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
        self.with_fallback(|f| buf.write_to_file(f, file_offset, offset, len))
            .map_err(|e| disk_full(e, len))?;
        self.bytes_written.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
}

/// A write the filesystem had no room for (ENOSPC, EDQUOT) is the disk tier out of space, as a
/// full tier is; other errors stay as they are.
fn disk_full(e: Error, len: u64) -> Error {
    match &e {
        Error::Os { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            Error::OutOfTierSpace {
                tier: "disk",
                requested: len,
                available: 0,
            }
        }
        _ => e,
    }
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    /// A full filesystem (`/dev/full` answers every write with ENOSPC) is the disk tier out of
    /// space: STRATA_OUT_OF_MEMORY through the C ABI, as a full tier.
    #[test]
    fn a_full_filesystem_is_out_of_tier_space() {
        let Ok(full) = OpenOptions::new().write(true).open("/dev/full") else {
            eprintln!("skipping: no /dev/full");
            return;
        };
        let backend = strata_vmm::host_or_cuda(strata_vmm::HostConfig {
            devices: vec![64 << 20],
            ..strata_vmm::HostConfig::default()
        })
        .unwrap();
        let buf = HostBuffer::new(&backend, 4096).unwrap();
        let err = buf.write_to_file(&full, 0, 0, 4096).unwrap_err();
        let err = disk_full(err, 4096);
        assert!(
            matches!(
                err,
                Error::OutOfTierSpace {
                    tier: "disk",
                    requested: 4096,
                    ..
                }
            ),
            "{err}"
        );
        let other = disk_full(Error::InvalidState("x".into()), 1);
        assert!(matches!(other, Error::InvalidState(_)));
    }

    use super::*;

    /// A pool whose one thread is busy until the returned sender sends (or drops).
    fn busy_pool() -> (IoPool, mpsc::Sender<()>, IoTicket) {
        let pool = IoPool::new(1).unwrap();
        let (go, wait) = mpsc::channel::<()>();
        let (started, running) = mpsc::channel::<()>();
        let busy = pool
            .submit(Lane::Demand, move || {
                started.send(()).unwrap();
                let _ = wait.recv();
                Ok(())
            })
            .unwrap();
        running.recv().unwrap();
        (pool, go, busy)
    }

    fn logging(
        log: &Arc<Mutex<Vec<&'static str>>>,
        name: &'static str,
    ) -> impl FnOnce() -> Result<()> {
        let log = Arc::clone(log);
        move || {
            log.lock().push(name);
            Ok(())
        }
    }

    #[test]
    fn a_demand_request_overtakes_queued_background_ones() {
        let (pool, go, busy) = busy_pool();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut tickets = Vec::new();
        for name in ["b1", "b2", "b3"] {
            tickets.push(pool.submit(Lane::Background, logging(&log, name)).unwrap());
        }
        tickets.push(pool.submit(Lane::Demand, logging(&log, "d")).unwrap());
        assert_eq!(pool.queued(), (1, 3));
        go.send(()).unwrap();
        busy.wait().unwrap();
        for t in tickets {
            t.wait().unwrap();
        }
        assert_eq!(*log.lock(), ["d", "b1", "b2", "b3"]);
    }

    #[test]
    fn background_requests_wait_while_a_demand_guard_lives() {
        let pool = IoPool::new(2).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let guard = pool.demand();
        let background = pool.submit(Lane::Background, logging(&log, "b")).unwrap();
        // Both threads are idle, yet the background request waits; demand ones run.
        pool.submit(Lane::Demand, logging(&log, "d"))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(*log.lock(), ["d"]);
        assert_eq!(pool.queued(), (0, 1));
        drop(guard);
        background.wait().unwrap();
        assert_eq!(*log.lock(), ["d", "b"]);
    }
}
