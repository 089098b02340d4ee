//! Map-ahead: a background mapper that keeps pool pages mapped ahead of every growing slot, so a
//! grow only publishes pages that are already mapped (vAttention overlaps this mapping with
//! compute; on an H200 a fresh 4-layer row costs ~0.4 ms of driver calls on the caller's path).
//!
//! # Design
//!
//! - A *row* is page `p` of one slot in every tensor (`2 × layers` pool pages). For each active
//!   slot the mapper keeps *ready* rows `extent..extent + ready.len()` mapped read-write at their
//!   final addresses, where `extent` is the slot's mapped extent. Ready rows belong to the slot:
//!   they are counted in [`KvStats::pages_ahead`](super::KvStats::pages_ahead) and in the pool's
//!   `in_use`, and go with the slot (a free makes them part of the deferred slot's extent; a
//!   shrink, a reclaim or the space's drop unmaps them).
//! - The mapper maps one row at a time (its *in-flight* row) with no lock held across driver
//!   calls; it claims the row and later publishes it under [`Shared::state`], a lock that no
//!   caller holds across a driver call or a wait. A caller only waits (on a condition, holding
//!   nothing the mapper takes) for an in-flight row whose addresses it is about to map itself,
//!   which bounds the wait by one row's mapping (kvcached#371: no lock held across a wait on the
//!   refill thread; the mapper never takes the space's owner's locks).
//! - How many rows a slot keeps ahead follows its recent growth rate (rows per second, a moving
//!   average) times the mapper's measured time per row, with at least the last grow's size and
//!   one row (a newly admitted slot gets one row before its first grow); all ready and
//!   in-flight pages together never exceed the space's ahead budget.
//! - Synchronous callers come first: when a grow or restore finds the pool out of memory, every
//!   ready row of the space is unmapped and given back (after the in-flight row lands) before
//!   deferred slots are reclaimed, and the mapper stops refilling until the next grow. Out of
//!   memory stays a normal outcome for the caller; for the mapper it only means "not now".
//! - Each claimed row carries its slot's *epoch*; a shrink, free, reclaim or a failed grow bumps
//!   it, and a row that lands for an old epoch (or a slot whose extent moved) is unmapped.
//! - Not with a zero page: a row's addresses would first have to lose their zero mapping, an
//!   owner that stays with the space's tables (`KvSpace::start_map_ahead` refuses).

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use strata_vmm::{
    record_deferred, Access, Backend, DevicePtr, Location, Mapping, Reservation, Result,
};

use crate::mapped::{unmap_pages, MappedPage};
use crate::pool::{Page, PagePool};

/// One row: a mapped pool page per tensor, in tensor order.
pub(super) type Row = Vec<MappedPage>;

/// What the mapper did, for [`KvStats`](super::KvStats).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct AheadCounters {
    pub(super) map_calls: u64,
    pub(super) set_access_calls: u64,
    pub(super) unmap_calls: u64,
    pub(super) pages_mapped_total: u64,
    pub(super) pages_unmapped_total: u64,
    /// Ready pages now (rows not yet published).
    pub(super) pages_ready: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Job {
    slot: usize,
    row: usize,
    epoch: u64,
}

#[derive(Default)]
struct SlotAhead {
    active: bool,
    epoch: u64,
    extent: usize,
    ready: VecDeque<Row>,
    want: usize,
    last_grow: Option<Instant>,
    /// Rows per second, a moving average over the grows that needed pages.
    rate: f64,
}

struct State {
    slots: Vec<SlotAhead>,
    /// Most pages ready and in flight together.
    budget: usize,
    /// Pages ready and in flight now.
    held: usize,
    in_flight: Option<Job>,
    /// Where the next search for work starts (round robin over slots).
    cursor: usize,
    /// Seconds per row, a moving average of the mapper's own timings.
    row_secs: f64,
    stop: bool,
    counters: AheadCounters,
}

struct Shared {
    state: Mutex<State>,
    /// The mapper waits here for work.
    wake: Condvar,
    /// Callers wait here for the in-flight row to land.
    landed: Condvar,
    pool: Arc<PagePool>,
    backend: Arc<dyn Backend>,
    reservations: Vec<Arc<Reservation>>,
    location: Location,
    page: u64,
    pages_per_slot: usize,
}

/// The mapper of one space: its thread and the state it shares with the space.
pub(super) struct MapAhead {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Where the mapper of a space starts: what it maps and its budget.
pub(super) struct AheadSetup {
    pub(super) pool: Arc<PagePool>,
    pub(super) backend: Arc<dyn Backend>,
    pub(super) reservations: Vec<Arc<Reservation>>,
    pub(super) location: Location,
    pub(super) page: u64,
    pub(super) pages_per_slot: usize,
    pub(super) slots: usize,
    pub(super) budget_pages: usize,
}

impl MapAhead {
    pub(super) fn start(setup: AheadSetup) -> Result<MapAhead> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots: (0..setup.slots).map(|_| SlotAhead::default()).collect(),
                budget: setup.budget_pages,
                held: 0,
                in_flight: None,
                cursor: 0,
                row_secs: 0.0,
                stop: false,
                counters: AheadCounters::default(),
            }),
            wake: Condvar::new(),
            landed: Condvar::new(),
            pool: setup.pool,
            backend: setup.backend,
            reservations: setup.reservations,
            location: setup.location,
            page: setup.page,
            pages_per_slot: setup.pages_per_slot,
        });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("strata-kv-ahead".into())
            .spawn(move || worker.run())
            .map_err(|e| strata_vmm::Error::InvalidState(format!("kv mapper thread: {e}")))?;
        Ok(MapAhead {
            shared,
            thread: Some(thread),
        })
    }

    fn tensors(&self) -> usize {
        self.shared.reservations.len()
    }

    /// Slot `index` became active with `extent` pages mapped; one row goes ahead of it.
    pub(super) fn admit(&self, index: usize, extent: usize) {
        let mut g = self.shared.state.lock();
        let s = &mut g.slots[index];
        s.active = true;
        s.epoch += 1;
        s.extent = extent;
        // An admitted request is about to grow: its first row is mapped ahead at once.
        s.want = 1;
        s.rate = 0.0;
        s.last_grow = None;
        drop(g);
        self.shared.wake.notify_one();
    }

    /// A grow of slot `index` from `mapped` to `need` pages: waits for an in-flight row inside
    /// that run, then takes the ready rows that cover it (front first). The slot's extent is
    /// `need` from now on; the caller maps the rest itself, and calls [`MapAhead::put_back`] if
    /// that fails.
    pub(super) fn take_rows(&self, index: usize, mapped: usize, need: usize) -> Vec<Row> {
        let mut g = self.shared.state.lock();
        while g
            .in_flight
            .is_some_and(|j| j.slot == index && (mapped..need).contains(&j.row))
        {
            self.shared.landed.wait(&mut g);
        }
        let tensors = self.tensors();
        let row_secs = g.row_secs;
        let s = &mut g.slots[index];
        let k = s.ready.len().min(need - mapped);
        let rows: Vec<Row> = s.ready.drain(..k).collect();
        if k < need - mapped {
            s.epoch += 1;
        }
        s.extent = need;
        s.note_grow(need - mapped, row_secs);
        g.held -= k * tensors;
        g.counters.pages_ready -= (k * tensors) as u64;
        drop(g);
        self.shared.wake.notify_one();
        rows
    }

    /// Undoes a [`MapAhead::take_rows`] whose grow failed: the slot's extent is `mapped` again
    /// and `rows` its ready rows; rows mapped meanwhile past them come back to be unmapped.
    pub(super) fn put_back(&self, index: usize, mapped: usize, rows: Vec<Row>) -> Vec<Row> {
        let tensors = self.tensors();
        let mut g = self.shared.state.lock();
        let s = &mut g.slots[index];
        s.epoch += 1;
        s.extent = mapped;
        let stale: Vec<Row> = s.ready.drain(..).collect();
        let (back, gone) = (rows.len() * tensors, stale.len() * tensors);
        s.ready.extend(rows);
        g.held = g.held + back - gone;
        g.counters.pages_ready = g.counters.pages_ready + back as u64 - gone as u64;
        stale
    }

    /// Slot `index` shrinks to `extent` pages (`active`) or is freed or reclaimed (`!active`):
    /// its ready rows come back (the caller publishes or unmaps them); a row in flight for it
    /// will be unmapped when it lands.
    pub(super) fn retire(&self, index: usize, extent: usize, active: bool) -> Vec<Row> {
        let tensors = self.tensors();
        let mut g = self.shared.state.lock();
        let s = &mut g.slots[index];
        s.epoch += 1;
        s.active = active;
        s.extent = extent;
        let rows: Vec<Row> = s.ready.drain(..).collect();
        g.held -= rows.len() * tensors;
        g.counters.pages_ready -= (rows.len() * tensors) as u64;
        rows
    }

    /// The pool ran out for a synchronous caller: waits for the in-flight row, takes every ready
    /// row of the space, and stops refilling until the next grow.
    pub(super) fn drain_all(&self) -> Vec<Row> {
        let tensors = self.tensors();
        let mut g = self.shared.state.lock();
        while g.in_flight.is_some() {
            self.shared.landed.wait(&mut g);
        }
        let mut rows = Vec::new();
        for s in &mut g.slots {
            s.want = 0;
            rows.extend(s.ready.drain(..));
        }
        g.held -= rows.len() * tensors;
        g.counters.pages_ready -= (rows.len() * tensors) as u64;
        rows
    }

    /// Unmaps `rows` and gives their pages back to the pool (a page whose unmap failed is
    /// quarantined); errors are recorded. Counted as the mapper's unmaps.
    pub(super) fn release(&self, rows: Vec<Row>) {
        if rows.is_empty() {
            return;
        }
        let n: usize = rows.iter().map(Vec::len).sum();
        self.shared.release(rows);
        let mut g = self.shared.state.lock();
        g.counters.unmap_calls += n as u64;
        g.counters.pages_unmapped_total += n as u64;
    }

    pub(super) fn counters(&self) -> AheadCounters {
        self.shared.state.lock().counters
    }

    /// Runs `check` with the mapper idle (no row in flight, none claimed until it returns) on
    /// the pages held ahead and the addresses they must have; returns its result.
    pub(super) fn settled<R>(
        &self,
        check: impl FnOnce(usize) -> R,
    ) -> std::result::Result<R, String> {
        let mut g = self.shared.state.lock();
        while g.in_flight.is_some() {
            self.shared.landed.wait(&mut g);
        }
        self.check_rows(&g)?;
        Ok(check(g.held))
    }

    fn check_rows(&self, g: &MutexGuard<'_, State>) -> std::result::Result<(), String> {
        let mut ready = 0;
        for (i, s) in g.slots.iter().enumerate() {
            if !s.active && !s.ready.is_empty() {
                return Err(format!("slot {i} is not active but has rows ahead"));
            }
            for (k, row) in s.ready.iter().enumerate() {
                for (t, mapped) in row.iter().enumerate() {
                    if mapped.mapping.va() != self.shared.va(t, i, s.extent + k) {
                        return Err(format!("slot {i}: ahead row {k} of tensor {t} misplaced"));
                    }
                }
                ready += row.len();
            }
        }
        if ready != g.held || ready as u64 != g.counters.pages_ready {
            return Err(format!(
                "{ready} pages ready ahead but {} held, {} counted",
                g.held, g.counters.pages_ready
            ));
        }
        Ok(())
    }
}

impl Drop for MapAhead {
    /// Stops the mapper (it finishes its in-flight row) and unmaps every ready row.
    fn drop(&mut self) {
        self.shared.state.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let rows = {
            let mut g = self.shared.state.lock();
            g.slots
                .iter_mut()
                .flat_map(|s| s.ready.drain(..))
                .collect::<Vec<_>>()
        };
        self.shared.release(rows);
    }
}

impl SlotAhead {
    /// Updates the growth rate with a grow of `rows` rows and sizes the rows to keep ahead.
    fn note_grow(&mut self, rows: usize, row_secs: f64) {
        if rows == 0 {
            return;
        }
        let now = Instant::now();
        if let Some(last) = self.last_grow {
            let dt = now.duration_since(last).as_secs_f64().max(1e-6);
            let sample = rows as f64 / dt;
            self.rate = if self.rate == 0.0 {
                sample
            } else {
                0.75 * self.rate + 0.25 * sample
            };
        }
        self.last_grow = Some(now);
        // Rows consumed while the mapper refills what this grow took, with a margin of two.
        let refill = rows as f64 * row_secs.max(1e-6);
        let lead = (self.rate * refill * 2.0).ceil() as usize;
        self.want = lead.max(rows).max(1);
    }
}

impl State {
    /// The next row to map: round robin over active slots short of their want, within budget.
    fn next_job(&mut self, tensors: usize, pages_per_slot: usize) -> Option<Job> {
        if self.held + tensors > self.budget {
            return None;
        }
        let n = self.slots.len();
        for k in 0..n {
            let i = (self.cursor + k) % n;
            let s = &self.slots[i];
            let row = s.extent + s.ready.len();
            if s.active && s.ready.len() < s.want && row < pages_per_slot {
                self.cursor = (i + 1) % n;
                return Some(Job {
                    slot: i,
                    row,
                    epoch: s.epoch,
                });
            }
        }
        None
    }
}

impl Shared {
    fn va(&self, tensor: usize, slot: usize, row: usize) -> DevicePtr {
        self.reservations[tensor].ptr() + (slot * self.pages_per_slot + row) as u64 * self.page
    }

    fn run(&self) {
        let tensors = self.reservations.len();
        let mut g = self.state.lock();
        loop {
            if g.stop {
                return;
            }
            let Some(job) = g.next_job(tensors, self.pages_per_slot) else {
                self.wake.wait(&mut g);
                continue;
            };
            g.in_flight = Some(job);
            g.held += tensors;
            drop(g);
            let started = Instant::now();
            let mapped = self.map_row(job);
            let took = started.elapsed();
            g = self.state.lock();
            let mut stale = None;
            match mapped {
                Ok(row) => {
                    g.row_secs = average(g.row_secs, took);
                    g.counters.map_calls += tensors as u64;
                    g.counters.set_access_calls += tensors as u64;
                    g.counters.pages_mapped_total += tensors as u64;
                    let s = &mut g.slots[job.slot];
                    if s.active && s.epoch == job.epoch && s.extent + s.ready.len() == job.row {
                        s.ready.push_back(row);
                        g.counters.pages_ready += tensors as u64;
                    } else {
                        stale = Some(row);
                    }
                }
                Err(_) => {
                    // Out of memory or a driver refusal: not now; the next grow asks again.
                    g.slots[job.slot].want = 0;
                    g.held -= tensors;
                }
            }
            if let Some(row) = stale {
                // Still in flight (its addresses stay claimed) until it is unmapped.
                drop(g);
                self.release(vec![row]);
                g = self.state.lock();
                g.held -= tensors;
                g.counters.unmap_calls += tensors as u64;
                g.counters.pages_unmapped_total += tensors as u64;
            }
            g.in_flight = None;
            self.landed.notify_all();
        }
    }

    /// Takes a row's pages and maps them at the row's addresses, read-write, all or nothing.
    fn map_row(&self, job: Job) -> Result<Row> {
        let mut pages = self.pool.take(self.reservations.len())?;
        let mut row = Vec::with_capacity(pages.len());
        let grants = [(self.location, Access::ReadWrite)];
        for (t, reservation) in self.reservations.iter().enumerate() {
            let va = self.va(t, job.slot, job.row);
            let phys = Arc::clone(pages[pages.len() - 1].phys());
            let error = match Mapping::new(reservation, va, phys, 0, self.page, &[]) {
                Ok(mapping) => {
                    let page = pages.pop().expect("one page per tensor");
                    row.push(MappedPage { mapping, page });
                    match self.backend.set_access(va, self.page, &grants) {
                        Ok(()) => continue,
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            self.release(vec![row]);
            self.pool.give(pages);
            return Err(error);
        }
        Ok(row)
    }

    fn release(&self, rows: Vec<Row>) {
        let mut returned: Vec<Page> = Vec::new();
        if let Err(stuck) = unmap_pages(&self.pool, rows.into_iter().flatten(), &mut returned) {
            record_deferred(stuck.first);
        }
        if !returned.is_empty() {
            self.pool.give(returned);
        }
    }
}

fn average(avg: f64, sample: Duration) -> f64 {
    let s = sample.as_secs_f64();
    if avg == 0.0 {
        s
    } else {
        0.8 * avg + 0.2 * s
    }
}
