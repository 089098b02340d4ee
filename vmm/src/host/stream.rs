//! Streams as in-order worker threads, and events as epoch counters.
//!
//! An event counts its records (`recorded`) and the highest record whose preceding work finished
//! (`completed`); it is complete when `completed >= recorded`. A wait captures the epoch of the
//! latest record at enqueue time, so later re-records do not change what it waits for.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// A unit of stream work: runs on the worker, its error becomes the stream's pending error.
pub(crate) type Task = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// An event's counters.
#[derive(Debug, Default)]
struct Epochs {
    recorded: u64,
    completed: u64,
}

/// The shared state of one event.
#[derive(Debug, Default)]
pub(crate) struct EventShared {
    epochs: Mutex<Epochs>,
    cv: Condvar,
}

impl EventShared {
    /// Starts a record: returns its epoch (to complete when the work before it is done).
    pub(crate) fn begin_record(&self) -> u64 {
        let mut e = self.epochs.lock();
        e.recorded += 1;
        e.recorded
    }

    /// Marks record `epoch` (and everything before it) complete.
    pub(crate) fn complete(&self, epoch: u64) {
        let mut e = self.epochs.lock();
        if epoch > e.completed {
            e.completed = epoch;
        }
        self.cv.notify_all();
    }

    /// The epoch of the latest record (what a wait enqueued now waits for).
    pub(crate) fn latest(&self) -> u64 {
        self.epochs.lock().recorded
    }

    /// True when the latest record completed (or there was none).
    pub(crate) fn is_complete(&self) -> bool {
        let e = self.epochs.lock();
        e.completed >= e.recorded
    }

    /// Blocks until record `epoch` completed.
    pub(crate) fn wait_for(&self, epoch: u64) {
        let mut e = self.epochs.lock();
        while e.completed < epoch {
            self.cv.wait(&mut e);
        }
    }
}

enum Job {
    Run(Task),
    Record(Arc<EventShared>, u64),
    Wait(Arc<EventShared>, u64),
}

struct Queue {
    jobs: VecDeque<Job>,
    submitted: u64,
    completed: u64,
    error: Option<String>,
    shutdown: bool,
}

/// One created stream: a queue and the worker thread that drains it in order.
pub(crate) struct StreamShared {
    id: u64,
    device: u32,
    queue: Mutex<Queue>,
    cv: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl StreamShared {
    /// Starts the worker of stream `id` on `device`.
    pub(crate) fn spawn(id: u64, device: u32) -> Result<Arc<StreamShared>> {
        let shared = Arc::new(StreamShared {
            id,
            device,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                submitted: 0,
                completed: 0,
                error: None,
                shutdown: false,
            }),
            cv: Condvar::new(),
            worker: Mutex::new(None),
        });
        let runner = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name(format!("strata-stream-{id}"))
            .spawn(move || runner.run())
            .map_err(|source| Error::Os {
                call: "spawn stream worker",
                source,
            })?;
        *shared.worker.lock() = Some(handle);
        Ok(shared)
    }

    /// The device this stream belongs to.
    pub(crate) fn device(&self) -> u32 {
        self.device
    }

    fn push(&self, job: Job) -> Result<()> {
        let mut q = self.queue.lock();
        if q.shutdown {
            return Err(Error::InvalidHandle {
                kind: "stream",
                id: self.id,
            });
        }
        q.jobs.push_back(job);
        q.submitted += 1;
        self.cv.notify_all();
        Ok(())
    }

    /// Queues a task.
    pub(crate) fn submit(&self, task: Task) -> Result<()> {
        self.push(Job::Run(task))
    }

    /// Queues a record of `event` (its epoch is taken now).
    pub(crate) fn record(&self, event: &Arc<EventShared>) -> Result<()> {
        let mut q = self.queue.lock();
        if q.shutdown {
            return Err(Error::InvalidHandle {
                kind: "stream",
                id: self.id,
            });
        }
        let epoch = event.begin_record();
        q.jobs.push_back(Job::Record(Arc::clone(event), epoch));
        q.submitted += 1;
        self.cv.notify_all();
        Ok(())
    }

    /// Queues a wait for the latest record of `event` as of now.
    pub(crate) fn wait_event(&self, event: &Arc<EventShared>) -> Result<()> {
        let epoch = event.latest();
        self.push(Job::Wait(Arc::clone(event), epoch))
    }

    /// Blocks until everything queued so far ran; reports (and clears) a pending failure.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let mut q = self.queue.lock();
        let target = q.submitted;
        while q.completed < target {
            self.cv.wait(&mut q);
        }
        match q.error.take() {
            Some(message) => Err(Error::Async {
                stream: self.id,
                message,
            }),
            None => Ok(()),
        }
    }

    /// Lets the worker finish the queue, then joins it. Returns a pending failure, if any.
    pub(crate) fn shutdown(&self) -> Result<()> {
        {
            let mut q = self.queue.lock();
            q.shutdown = true;
            self.cv.notify_all();
        }
        let handle = self.worker.lock().take();
        if let Some(handle) = handle {
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
        match self.queue.lock().error.take() {
            Some(message) => Err(Error::Async {
                stream: self.id,
                message,
            }),
            None => Ok(()),
        }
    }

    fn run(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.shutdown {
                        return;
                    }
                    self.cv.wait(&mut q);
                }
            };
            let failure = match job {
                Job::Run(task) => match catch_unwind(AssertUnwindSafe(task)) {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some("a stream task panicked".to_string()),
                },
                Job::Record(event, epoch) => {
                    event.complete(epoch);
                    None
                }
                Job::Wait(event, epoch) => {
                    event.wait_for(epoch);
                    None
                }
            };
            let mut q = self.queue.lock();
            if let Some(message) = failure {
                q.error.get_or_insert(message);
            }
            q.completed += 1;
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn tasks_run_in_order_and_errors_surface_once() {
        let s = StreamShared::spawn(1, 0).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..10 {
            let log = Arc::clone(&log);
            s.submit(Box::new(move || {
                log.lock().push(i);
                Ok(())
            }))
            .unwrap();
        }
        s.submit(Box::new(|| Err(Error::InvalidState("boom".into()))))
            .unwrap();
        let ev = Arc::new(EventShared::default());
        s.record(&ev).unwrap();
        assert!(matches!(
            s.synchronize(),
            Err(Error::Async { stream: 1, .. })
        ));
        assert!(ev.is_complete());
        assert!(s.synchronize().is_ok());
        assert_eq!(*log.lock(), (0..10).collect::<Vec<_>>());
        s.shutdown().unwrap();
        assert!(s.submit(Box::new(|| Ok(()))).is_err());
    }

    #[test]
    fn wait_orders_across_streams() {
        let a = StreamShared::spawn(1, 0).unwrap();
        let b = StreamShared::spawn(2, 0).unwrap();
        let ev = Arc::new(EventShared::default());
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let seen = Arc::new(AtomicU64::new(0));
        let g = Arc::clone(&gate);
        a.submit(Box::new(move || {
            let mut open = g.0.lock();
            while !*open {
                g.1.wait(&mut open);
            }
            Ok(())
        }))
        .unwrap();
        a.record(&ev).unwrap();
        b.wait_event(&ev).unwrap();
        let s2 = Arc::clone(&seen);
        b.submit(Box::new(move || {
            s2.store(1, Ordering::SeqCst);
            Ok(())
        }))
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(seen.load(Ordering::SeqCst), 0);
        assert!(!ev.is_complete());
        *gate.0.lock() = true;
        gate.1.notify_all();
        b.synchronize().unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 1);
        a.shutdown().unwrap();
        b.shutdown().unwrap();
    }
}
