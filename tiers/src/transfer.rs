//! The transfer engine: dedicated copy streams per direction, coalescing of adjacent blocks,
//! batched submission, the block-copy kernel for many tiny blocks, and completion events.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use strata_kernels::blockcopy::{self, Method};
use strata_vmm::{
    copy_async_in, Backend, CopyDesc, CopyKind, CopyScope, DevicePtr, DeviceWork, Error, Event,
    Result, Stream, StreamHandle,
};

/// Direction of a copy between host memory and the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    HostToDevice,
    DeviceToHost,
}

/// How [`TransferEngine::submit`] executes a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Submission {
    /// One `copy_async` call per block (the baseline the others are measured against).
    Naive,
    /// Adjacent blocks merged, one `copy_async` batch.
    Coalesced,
    /// Coalesced, then [`blockcopy::choose`] picks DMA or the kernel (falling back to DMA where
    /// the backend cannot launch it).
    Auto,
    /// Always the block-copy kernel (no coalescing: one thread block per block).
    Kernel,
}

/// Merges block copies `(src, dst)` of `len` bytes whose sources and destinations both continue
/// the previous run. Input order is kept for the runs (callers sort when they want maximal runs).
pub fn coalesce(pairs: &[(DevicePtr, DevicePtr)], len: u64) -> Vec<CopyDesc> {
    let mut out: Vec<CopyDesc> = Vec::with_capacity(pairs.len());
    for &(src, dst) in pairs {
        if let Some(last) = out.last_mut() {
            if last.src + last.len == src && last.dst + last.len == dst {
                last.len += len;
                continue;
            }
        }
        out.push(CopyDesc { dst, src, len });
    }
    out
}

/// Counters of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    pub bytes_h2d: u64,
    pub bytes_d2h: u64,
    /// Blocks asked for.
    pub blocks: u64,
    /// Descriptors submitted (after coalescing).
    pub descriptors: u64,
    /// Block-copy kernel launches.
    pub kernel_launches: u64,
    /// `copy_async` batches.
    pub batches: u64,
}

#[derive(Default)]
struct Counters {
    bytes_h2d: AtomicU64,
    bytes_d2h: AtomicU64,
    blocks: AtomicU64,
    descriptors: AtomicU64,
    kernel_launches: AtomicU64,
    batches: AtomicU64,
}

/// Two dedicated streams (host→device, device→host) on one device, and the submission logic.
/// Copies go through the [`Backend`], the block-copy kernel through the backend's
/// [`DeviceWork`] (DMA only when it has none).
pub struct TransferEngine {
    backend: Arc<dyn Backend>,
    work: Option<Arc<dyn DeviceWork>>,
    h2d: Stream,
    d2h: Stream,
    kernel_ok: std::sync::atomic::AtomicBool,
    counters: Counters,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl TransferEngine {
    pub fn new(backend: &Arc<dyn Backend>, device: u32) -> Result<Self> {
        Ok(TransferEngine {
            backend: Arc::clone(backend),
            work: Arc::clone(backend).device_work(),
            h2d: Stream::new(backend, device)?,
            d2h: Stream::new(backend, device)?,
            kernel_ok: std::sync::atomic::AtomicBool::new(true),
            counters: Counters::default(),
        })
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The stream of a direction.
    pub fn stream(&self, dir: Direction) -> StreamHandle {
        match dir {
            Direction::HostToDevice => self.h2d.handle(),
            Direction::DeviceToHost => self.d2h.handle(),
        }
    }

    /// Makes the `dir` stream wait for `event` (cross-stream ordering, no host blocking).
    pub fn wait(&self, dir: Direction, event: &Event) -> Result<()> {
        self.backend
            .stream_wait_event(self.stream(dir), event.handle())
    }

    /// Queues block copies `(src, dst)` of `len` bytes on the `dir` stream and returns an event
    /// recorded after them. Host ranges must stay valid until the event completes (the store owns
    /// them). An error leaves nothing queued from this call's failing submission onwards.
    pub fn submit(
        &self,
        dir: Direction,
        pairs: &[(DevicePtr, DevicePtr)],
        len: u64,
        how: Submission,
        scope: CopyScope<'_>,
    ) -> Result<Arc<Event>> {
        let stream = self.stream(dir);
        if pairs.is_empty() || len == 0 {
            return copy_async_in(&self.backend, stream, CopyKind::Batch(&[]), scope);
        }
        let event = self.run(stream, pairs, len, how, scope)?;
        {
            let bytes = len * pairs.len() as u64;
            match dir {
                Direction::HostToDevice => &self.counters.bytes_h2d,
                Direction::DeviceToHost => &self.counters.bytes_d2h,
            }
            .fetch_add(bytes, Ordering::Relaxed);
            self.counters
                .blocks
                .fetch_add(pairs.len() as u64, Ordering::Relaxed);
        }
        Ok(event)
    }

    fn run(
        &self,
        stream: StreamHandle,
        pairs: &[(DevicePtr, DevicePtr)],
        len: u64,
        how: Submission,
        scope: CopyScope<'_>,
    ) -> Result<Arc<Event>> {
        match how {
            Submission::Naive => {
                let descs: Vec<CopyDesc> = pairs
                    .iter()
                    .map(|&(src, dst)| CopyDesc { dst, src, len })
                    .collect();
                let ev = copy_async_in(&self.backend, stream, CopyKind::Each(&descs), scope)?;
                self.counters
                    .batches
                    .fetch_add(descs.len() as u64, Ordering::Relaxed);
                self.counters
                    .descriptors
                    .fetch_add(descs.len() as u64, Ordering::Relaxed);
                Ok(ev)
            }
            Submission::Kernel => self.launch(stream, pairs, len, scope),
            Submission::Coalesced | Submission::Auto => {
                let mut sorted = pairs.to_vec();
                sorted.sort_unstable();
                let descs = coalesce(&sorted, len);
                let avg = descs.iter().map(|d| d.len).sum::<u64>() / descs.len().max(1) as u64;
                if how == Submission::Auto
                    && self.kernel_ok.load(Ordering::Relaxed)
                    && blockcopy::choose(descs.len(), avg) == Method::Kernel
                    && descs.iter().all(|d| d.len == len)
                {
                    match self.launch(stream, pairs, len, scope) {
                        Err(Error::Unsupported(_)) => {
                            // CUDA without NVRTC (or a kernel it cannot build): DMA from now on.
                            self.kernel_ok.store(false, Ordering::Relaxed);
                        }
                        // No device memory for the kernel's staging now: DMA this time.
                        Err(e) if e.is_out_of_memory() => {}
                        other => return other,
                    }
                }
                let ev = copy_async_in(&self.backend, stream, CopyKind::Batch(&descs), scope)?;
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .descriptors
                    .fetch_add(descs.len() as u64, Ordering::Relaxed);
                Ok(ev)
            }
        }
    }

    fn launch(
        &self,
        stream: StreamHandle,
        pairs: &[(DevicePtr, DevicePtr)],
        len: u64,
        scope: CopyScope<'_>,
    ) -> Result<Arc<Event>> {
        let Some(work) = self.work.as_deref() else {
            return Err(Error::Unsupported(format!(
                "no block-copy kernel on the {} backend",
                self.backend.kind()
            )));
        };
        let ev = copy_async_in(
            &self.backend,
            stream,
            CopyKind::Blocks { work, len, pairs },
            scope,
        )?;
        self.counters
            .kernel_launches
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .descriptors
            .fetch_add(pairs.len() as u64, Ordering::Relaxed);
        Ok(ev)
    }

    /// Blocks until both streams drained; reports asynchronous copy failures.
    pub fn synchronize(&self) -> Result<()> {
        let a = self.h2d.synchronize();
        let b = self.d2h.synchronize();
        a.and(b)
    }

    pub fn stats(&self) -> TransferStats {
        let c = &self.counters;
        TransferStats {
            bytes_h2d: c.bytes_h2d.load(Ordering::Relaxed),
            bytes_d2h: c.bytes_d2h.load(Ordering::Relaxed),
            blocks: c.blocks.load(Ordering::Relaxed),
            descriptors: c.descriptors.load(Ordering::Relaxed),
            kernel_launches: c.kernel_launches.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_runs_merge_and_gaps_split() {
        let pairs = [(0, 100), (8, 108), (16, 116), (40, 124), (48, 200)];
        let d = coalesce(&pairs, 8);
        assert_eq!(
            d,
            vec![
                CopyDesc {
                    src: 0,
                    dst: 100,
                    len: 24
                },
                CopyDesc {
                    src: 40,
                    dst: 124,
                    len: 8
                },
                CopyDesc {
                    src: 48,
                    dst: 200,
                    len: 8
                },
            ]
        );
    }
}
