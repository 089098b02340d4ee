//! Device I/O of the store: addresses of its slots, the transfer engine's submission with the
//! store's copy scope, and [`Batch`], the one way a batch of block copies is queued (stream
//! waits, submit, then stamp the event on what the copies touched; on error nothing is
//! stamped and the batch's slot leases go back).

use std::sync::Arc;

use strata_vmm::{CopyScope, DevicePtr, Error, Event, HostBuffer, Location, Reservation, Result};

use super::state::State;
use super::TierStore;
use crate::disk::{DiskFile, IoPool};
use crate::transfer::{Direction, Submission};

/// Waits on the CPU for `ev` when there is one.
pub(super) fn sync(ev: &Option<Arc<Event>>) -> Result<()> {
    match ev {
        Some(e) => e.synchronize(),
        None => Ok(()),
    }
}

/// Block copies for one stream, the events they wait for, and per copy what
/// [`TierStore::queue_batch`] hands back to stamp once they are queued (`T`: indices, slot leases).
pub(super) struct Batch<T> {
    dir: Direction,
    after: Vec<Arc<Event>>,
    copies: Vec<(DevicePtr, DevicePtr)>,
    items: Vec<T>,
}

impl<T> Batch<T> {
    pub(super) fn new(dir: Direction) -> Self {
        Batch {
            dir,
            after: Vec::new(),
            copies: Vec::new(),
            items: Vec::new(),
        }
    }

    /// The stream waits for `ev` (device side) before the batch's copies.
    pub(super) fn after(&mut self, ev: Option<&Arc<Event>>) {
        if let Some(ev) = ev {
            if !self.after.iter().any(|e| Arc::ptr_eq(e, ev)) {
                self.after.push(Arc::clone(ev));
            }
        }
    }

    pub(super) fn push(&mut self, src: DevicePtr, dst: DevicePtr, item: T) {
        self.copies.push((src, dst));
        self.items.push(item);
    }
}

impl TierStore {
    /// Queues block copies on the `dir` stream through the transfer engine, with the store's
    /// host buffers, its HBM reservation and `outside` (device ranges of other owners, e.g. a
    /// `KvSpace`'s tensors) as the copy scope.
    pub(super) fn submit(
        &self,
        dir: Direction,
        pairs: &[(DevicePtr, DevicePtr)],
        len: u64,
        how: Submission,
        outside: &[&Reservation],
    ) -> Result<Arc<Event>> {
        let mut buffers: Vec<&HostBuffer> = self.host_chunks.iter().map(|b| &**b).collect();
        buffers.push(&self.staging);
        let mut reservations = vec![&*self.reservation];
        reservations.extend_from_slice(outside);
        let scope = CopyScope {
            buffers: &buffers,
            reservations: &reservations,
        };
        self.engine.submit(dir, pairs, len, how, scope)
    }

    /// Queues `batch` with the store's submission mode: its stream waits, then its copies. Once
    /// they are queued, `stamp` runs for each item with their event (under the lock the caller
    /// holds). On error nothing is stamped and the items drop (their leases go back).
    pub(super) fn queue_batch<T>(
        &self,
        st: &mut State,
        batch: Batch<T>,
        outside: &[&Reservation],
        mut stamp: impl FnMut(&mut State, T, &Arc<Event>),
    ) -> Result<Arc<Event>> {
        for ev in &batch.after {
            self.engine.wait(batch.dir, ev)?;
        }
        let ev = self.submit(
            batch.dir,
            &batch.copies,
            self.config.block_size,
            self.config.submission,
            outside,
        )?;
        for item in batch.items {
            stamp(st, item, &ev);
        }
        Ok(ev)
    }

    /// An event after every copy queued so far on the `dir` stream.
    pub(super) fn all_queued(&self, dir: Direction) -> Result<Arc<Event>> {
        self.submit(dir, &[], 0, Submission::Coalesced, &[])
    }

    pub(super) fn hbm_va(&self, slot: u32) -> DevicePtr {
        self.reservation.ptr() + u64::from(slot) * self.config.block_size
    }

    pub(super) fn host_chunk(&self, slot: u32) -> (&Arc<HostBuffer>, u64) {
        let s = u64::from(slot);
        let chunk = (s / self.blocks_per_chunk) as usize;
        let off = (s % self.blocks_per_chunk) * self.config.block_size;
        (&self.host_chunks[chunk], off)
    }

    pub(super) fn host_ptr(&self, slot: u32) -> DevicePtr {
        let (buf, off) = self.host_chunk(slot);
        buf.ptr() + off
    }

    pub(super) fn staging_ptr(&self, i: usize) -> DevicePtr {
        self.staging.ptr() + i as u64 * self.config.block_size
    }

    pub(super) fn disk(&self) -> Result<(&Arc<DiskFile>, &IoPool)> {
        match (&self.disk, &self.io) {
            (Some(d), Some(io)) => Ok((d, io)),
            _ => Err(Error::InvalidState("the store has no disk tier".into())),
        }
    }

    /// The disk tier, where a copy that does not fit in host memory goes (none: host memory is
    /// out of space).
    pub(super) fn overflow_disk(&self) -> Result<&Arc<DiskFile>> {
        self.disk().map(|(d, _)| d).map_err(|_| Error::OutOfMemory {
            location: Location::Host,
            requested: self.config.block_size,
            available: 0,
        })
    }

    pub(super) fn disk_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.config.block_size
    }

    pub(super) fn hbm_oom(&self, n: u64) -> Error {
        Error::OutOfMemory {
            location: Location::Device(self.config.device),
            requested: n * self.config.block_size,
            available: 0,
        }
    }
}
