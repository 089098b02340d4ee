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
//! - **Filing.** A grow that ready rows cover entirely moves no page: it moves the rows from the
//!   slot's ready queue to its *owed* queue (row headers, under the lock) and its extent up, and
//!   touches none of the space's tables. After a decode step's idle gap every line a grow
//!   touches is cold (~0.5 µs a miss on the bench VM), and writing a row's pages into
//!   `2 × layers` tables made the first append of a step cost 5–10 µs. Owed rows are the
//!   space's pages below the extent; the space files them into its tables before any other
//!   operation on the slot reads or changes its tables (a grow that maps pages itself, shrink,
//!   free, evict, restore, the drop) and its invariant check counts them.
//! - The mapper maps one *job* at a time: up to [`MAX_BATCH`] consecutive rows of one slot, one
//!   map call per page and one `set_access` per tensor over the job's run (the access call costs
//!   per call: 20 µs on the H200). It claims the job and later publishes its rows under
//!   [`Shared::state`], with no lock held across driver calls; no caller holds that lock across
//!   a driver call or a wait. A caller only waits (on a condition, holding nothing the mapper
//!   takes) for an in-flight job whose addresses it is about to map itself, which bounds the
//!   wait by one job's mapping (kvcached#371: no lock held across a wait on the refill thread;
//!   the mapper never takes the space's owner's locks).
//! - How many rows a slot keeps ahead follows its recent growth rate (rows per second, a moving
//!   average): the rows it consumes in twice the mapper's reaction time (its polling interval
//!   plus one job per growing slot, the jobs timed as they run), one more for a late poll, and
//!   at least the last grow's size (a newly admitted slot gets one row before its first grow).
//!   All ready and in-flight pages together never exceed the space's ahead budget; the slot with
//!   the fewest ready rows is served first.
//! - No syscall on the caller's path while growth is steady: while any slot has grown recently
//!   (within [`IDLE_AFTER`], or eight of its own intervals; any slot within [`IDLE_AFTER`], so
//!   a request that ends and the next in its slot keep it polling) the mapper looks for work every
//!   quarter of the fastest slot's interval ([`POLL_MIN`]..[`POLL_MAX`]) with a timed wait, so a
//!   grow only changes the state under the lock and never wakes it. Only when nothing grows does
//!   the mapper park without a timeout (`State::parked`); the next grow or admit then wakes it
//!   (one `notify` after a pause, never in steady growth).
//! - Synchronous callers come first: when a grow or restore finds the pool out of memory, every
//!   ready row of the space is unmapped and given back (after the in-flight job lands) before
//!   deferred slots are reclaimed, and the mapper stops refilling until the slot's next grow. Out
//!   of memory stays a normal outcome for the caller; for the mapper it only means "not now".
//! - Each claimed job carries its slot's *epoch*; a shrink, free, reclaim or a failed grow bumps
//!   it, and a job that lands for an old epoch (or a slot whose extent moved) is unmapped.
//! - With a zero page ([`KvConfig::zero_page`](super::KvConfig::zero_page)) every row past the
//!   extent is mapped read-only to the shared zero page, a mapping the space's tables own
//!   (`Backing::Zero`). A claimed row's zero mappings are *lent* to the mapper: it unmaps them
//!   (outside the lock, like its maps) just before it maps the fresh pages, and whenever it gives
//!   a row up unpublished (a shrink, free with holes, out of memory, a stale job, the space's
//!   drop) it unmaps the fresh pages and lays the zero page back (read-only, one `set_access`
//!   per run) before the row leaves its hands; filing a grown row into the tables consumes
//!   their zero mapping without a driver call (`Mapping::disown`: the address is the fresh
//!   page's now). The mapper zero-fills a job's fresh pages (a memset on its own stream, waited
//!   for) before it publishes the job, so outside a job every address past a slot's extent
//!   reads zeros as before (masked attention never meets stale bytes there), and a row grown
//!   from ahead starts as zeros (a row a grow maps itself holds whatever its pool page held).
//! - **The swap window.** The driver has no atomic remap: from the zero page's unmap to the
//!   run's `set_access` (per tensor of a job: an unmap and a map per page and one access call;
//!   on an H200 roughly the 53 µs per page of map, access and unmap, derived from the issue's
//!   figures, not measured for this path) a row past the extent has no readable mapping, and
//!   until the job's memset lands it reads stale bytes. A kernel that
//!   reads past a slot's extent (masked attention over the whole range, a CUDA graph over
//!   `max_tokens`) *while the mapper swaps that row* faults on a GPU. Grows on the caller's path
//!   have the same window over the rows they map, but only while the caller is inside the grow;
//!   the mapper's window is at any time. So map-ahead stays off by default, and an engine whose
//!   kernels read past the extent turns it on only if its reads past the extent stop short of
//!   the rows the mapper may claim (beyond the ready rows) or its steps do not overlap growth.
//!
//! # Why the caller and the mapper cannot race
//!
//! - Every page address of a slot has at most one owner at a time, and only its owner maps or
//!   unmaps it: the space's tables (pages below `extent`: grows, shrinks, evictions, restores,
//!   reclaims and the drop touch only these, under the space's `&mut self`; the slot's owed
//!   rows, `extent - owed.len()..extent`, are the tables' too, waiting to be filed), the slot's
//!   ready queue (`extent..extent + ready.len()`), the in-flight job (its claimed rows), or
//!   nobody.
//! - The mapper claims rows only at `extent + ready.len()` and beyond, under the lock, so never
//!   an address the tables or the ready queue own. Ready rows move to the tables (or to the owed
//!   queue) only in [`MapAhead::take_rows`] (or back to the tables on free), under the lock,
//!   front first.
//! - `extent` moves past a claimed row only in [`MapAhead::take_rows`], which first waits, under
//!   the lock, until no job in flight overlaps the pages the grow will own; a job that lands for
//!   an old epoch or a moved extent stays in flight until the mapper has unmapped it, so the
//!   caller never maps an address the mapper still holds. Shrinks, frees and reclaims move
//!   `extent` down (bumping the epoch), which cannot reach a claimed row above it, and only
//!   after the tables gave those pages up (a shrink unmaps first, then retires; a free makes
//!   the slot inactive, so nothing is claimed until the next admit sets the extent again).
//! - With a zero page, a row's zero mappings follow the row: the tables own them (as
//!   `Backing::Zero`) at every address, but while the row is claimed or ready the mapper holds
//!   the address (zero page lifted, fresh page mapped) and the tables touch neither (nor while
//!   it is owed); the mapper
//!   lays the zero page back before a row it gives up leaves the in-flight job or the ready
//!   queue (under the rules above, before the tables or a later job may own the address again),
//!   and filing a row (owed by a grow, or ready when a free keeps it) disowns the tables' zero
//!   mapping, whose address the fresh page now holds. Shrinks, truncating frees, reclaims and
//!   evictions lay the zero page behind the tables' own pages as without a mapper.
//! - Rows the caller takes back to unmap (a shrink's ready rows, a failed grow's stale ones) are
//!   unmapped outside the lock, after their slot's extent moved below them: the slot takes no
//!   claims until the caller has unmapped them and resumes it. (Without that the mapper claimed
//!   a row a shrink was still unmapping: `random_walk_fake` saw "already mapped" about once in
//!   100 runs of one case.)
//! - A job that finds its addresses already mapped would mean these rules broke: it is kept
//!   in `State::overlap` and [`MapAhead::settled`] (the space's invariant check) reports it.
//! - Page counts: the pool counts ready and in-flight pages in `in_use` from the take on, and
//!   `State::held` counts them against the budget until they are published or given back.
//! - Wake-ups: `parked` is set and read under the lock, and the mapper's condition wait drops
//!   the lock atomically, so a grow either sees the mapper parked (and notifies) or the mapper
//!   sees the grow's state before it waits (timed or not); no wake-up is lost. A timed wait only
//!   delays a refill, never the caller.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use strata_vmm::{DevicePtr, Location, PhysicalMemory, Reservation};
use strata_vmm::{Result, Stream};

mod check;
mod plan;
mod zero;

use zero::{ZeroCalls, ZeroPage};

use crate::mapped::MappedPage;
use crate::pool::PagePool;

/// One row: a mapped pool page per tensor, in tensor order.
pub(super) type Row = Vec<MappedPage>;

/// The ready rows a grow took ([`MapAhead::take_rows`]).
pub(super) enum Taken {
    /// They covered the grow and stay with the mapper, owed to the space: this many rows.
    Owed(usize),
    /// They covered part of it (maybe none): the caller files them and maps the rest.
    Rows(Vec<Row>),
}

/// Most rows one job maps (one `set_access` per tensor over all of them).
const MAX_BATCH: usize = 4;
/// Shortest interval between the mapper's looks at growing slots.
const POLL_MIN: Duration = Duration::from_micros(200);
/// Longest interval between the mapper's looks at growing slots.
const POLL_MAX: Duration = Duration::from_millis(20);
/// A slot that has not grown for this long (or eight of its intervals, if longer) is idle.
const IDLE_AFTER: Duration = Duration::from_millis(100);
/// Rows per second assumed for a slot that grew only once (polls every 1 ms until it grows
/// again).
const UNKNOWN_RATE: f64 = 250.0;
/// Seconds per job assumed until the mapper has timed one.
const JOB_SECS_GUESS: f64 = 200e-6;

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
    /// Grows and admits that found the mapper parked and woke it (admits always notify).
    pub(super) wakeups: u64,
}

/// Rows `row..row + rows` of a slot, claimed by the mapper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Job {
    slot: usize,
    row: usize,
    rows: usize,
    epoch: u64,
}

impl Job {
    fn overlaps(&self, slot: usize, from: usize, to: usize) -> bool {
        self.slot == slot && self.row < to && from < self.row + self.rows
    }
}

#[derive(Default)]
struct SlotAhead {
    active: bool,
    epoch: u64,
    extent: usize,
    ready: VecDeque<Row>,
    /// Rows below the extent that grows took from `ready` and the space's tables have not filed
    /// yet (`extent - owed.len()..extent`): the space's pages, kept here so that a grow moves
    /// no page (see "Filing" above); the mapper never touches them.
    owed: VecDeque<Row>,
    /// Rows to keep ready (set by [`State::plan`]).
    want: usize,
    /// Out of memory: no refill until the next grow.
    held_off: bool,
    /// Rows handed back to the caller (a shrink's ready rows, a failed grow's stale ones) are
    /// being unmapped by it outside the lock: no claims for this slot until [`MapAhead::resume`].
    unmapping: bool,
    /// Rows the last grow needed (1 before the first).
    last_rows: usize,
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
    /// Where the search for the next job starts among equally short slots (round robin).
    cursor: usize,
    /// Seconds per job, a moving average of the mapper's own timings.
    job_secs: f64,
    /// The last grow of any slot (a request that ends and the next that starts in its slot
    /// keep the mapper polling).
    last_grow: Option<Instant>,
    /// The mapper waits with no timeout: a grow or admit must wake it.
    parked: bool,
    /// A job found its addresses already mapped: the ownership rules below were broken
    /// (reported by [`MapAhead::settled`]).
    overlap: Option<String>,
    stop: bool,
    counters: AheadCounters,
}

pub(super) struct Shared {
    state: Mutex<State>,
    /// The mapper waits here for work.
    wake: Condvar,
    /// Callers wait here for the in-flight job to land.
    landed: Condvar,
    pool: Arc<PagePool>,
    reservations: Vec<Arc<Reservation>>,
    location: Location,
    page: u64,
    pages_per_slot: usize,
    /// The space's zero page, lifted off a row before it is mapped and laid back when a row is
    /// given up unpublished.
    zero: Option<ZeroPage>,
}

/// The mapper of one space: its thread and the state it shares with the space.
pub(super) struct MapAhead {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Where the mapper of a space starts: what it maps and its budget.
pub(super) struct AheadSetup {
    pub(super) pool: Arc<PagePool>,
    pub(super) reservations: Vec<Arc<Reservation>>,
    pub(super) location: Location,
    pub(super) page: u64,
    pub(super) pages_per_slot: usize,
    pub(super) slots: usize,
    pub(super) budget_pages: usize,
    pub(super) zero: Option<Arc<PhysicalMemory>>,
}

impl MapAhead {
    pub(super) fn start(setup: AheadSetup) -> Result<MapAhead> {
        let zero = match setup.zero {
            Some(phys) => {
                let device = match setup.location {
                    Location::Device(d) => d,
                    Location::Host => 0,
                };
                Some(ZeroPage {
                    phys,
                    location: setup.location,
                    page: setup.page,
                    stream: Stream::new(setup.pool.backend(), device)?,
                })
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots: (0..setup.slots).map(|_| SlotAhead::default()).collect(),
                budget: setup.budget_pages,
                held: 0,
                in_flight: None,
                cursor: 0,
                job_secs: 0.0,
                last_grow: None,
                parked: false,
                overlap: None,
                stop: false,
                counters: AheadCounters::default(),
            }),
            wake: Condvar::new(),
            landed: Condvar::new(),
            pool: setup.pool,
            reservations: setup.reservations,
            location: setup.location,
            page: setup.page,
            pages_per_slot: setup.pages_per_slot,
            zero,
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

    /// Wakes the mapper if (and only if) it is parked with no timeout; drops `g` first.
    fn wake_if_parked(&self, mut g: MutexGuard<'_, State>) {
        let parked = g.parked;
        if parked {
            g.counters.wakeups += 1;
        }
        drop(g);
        if parked {
            self.shared.wake.notify_one();
        }
    }

    /// Slot `index` became active with `extent` pages mapped; one row goes ahead of it.
    pub(super) fn admit(&self, index: usize, extent: usize) {
        let mut g = self.shared.state.lock();
        let s = &mut g.slots[index];
        s.active = true;
        s.epoch += 1;
        s.extent = extent;
        // An admitted request is about to grow: its first row is mapped ahead at once.
        s.held_off = false;
        s.last_rows = 1;
        // `rate` stays: the slot's next request most likely decodes at the engine's cadence.
        s.last_grow = None;
        // Woken even from a timed wait: admits are rare and off the append path, and the first
        // row should not wait for the next poll.
        g.counters.wakeups += u64::from(g.parked);
        drop(g);
        self.shared.wake.notify_one();
    }

    /// A grow of slot `index` from `mapped` to `need` pages: waits for an in-flight job inside
    /// that run, then takes the ready rows that cover it (front first); the slot's extent is
    /// `need` from now on. When they cover the whole grow they stay here, owed to the space
    /// ([`Taken::Owed`]: the grow moves no page and touches none of the space's tables); else
    /// they come to the caller, who maps the rest itself and calls [`MapAhead::put_back`] if
    /// that fails. No syscall unless the mapper is parked (it polls while slots grow), and no
    /// allocation once the slot's queues have grown (BENCHMARKS.md, kv_append).
    pub(super) fn take_rows(&self, index: usize, mapped: usize, need: usize) -> Taken {
        let mut g = self.shared.state.lock();
        while g.in_flight.is_some_and(|j| j.overlaps(index, mapped, need)) {
            self.shared.landed.wait(&mut g);
        }
        let tensors = self.tensors();
        let s = &mut g.slots[index];
        let k = s.ready.len().min(need - mapped);
        let taken = if k == need - mapped {
            for _ in 0..k {
                let row = s.ready.pop_front().expect("k ready rows");
                s.owed.push_back(row);
            }
            Taken::Owed(k)
        } else {
            s.epoch += 1;
            Taken::Rows(s.ready.drain(..k).collect())
        };
        s.extent = need;
        s.note_grow(need - mapped);
        g.last_grow = s.last_grow.or(g.last_grow);
        g.held -= k * tensors;
        g.counters.pages_ready -= (k * tensors) as u64;
        self.wake_if_parked(g);
        taken
    }

    /// The rows grows of slot `index` took and the space has not filed (oldest first: they
    /// sit at `extent - n..extent`), for its tables.
    pub(super) fn take_owed(&self, index: usize) -> Vec<Row> {
        self.shared.state.lock().slots[index]
            .owed
            .drain(..)
            .collect()
    }

    /// Undoes a [`MapAhead::take_rows`] whose grow failed: the slot's extent is `mapped` again
    /// and `rows` its ready rows; rows mapped meanwhile past them come back to be unmapped
    /// (then [`MapAhead::resume`]).
    pub(super) fn put_back(&self, index: usize, mapped: usize, rows: Vec<Row>) -> Vec<Row> {
        let tensors = self.tensors();
        let mut g = self.shared.state.lock();
        let s = &mut g.slots[index];
        s.epoch += 1;
        s.extent = mapped;
        // As in `retire`: the caller unmaps `stale` outside the lock, then resumes the slot.
        s.unmapping = true;
        let stale: Vec<Row> = s.ready.drain(..).collect();
        let (back, gone) = (rows.len() * tensors, stale.len() * tensors);
        s.ready.extend(rows);
        g.held = g.held + back - gone;
        g.counters.pages_ready = g.counters.pages_ready + back as u64 - gone as u64;
        stale
    }

    /// Slot `index` shrinks to `extent` pages (`active`) or is freed or reclaimed (`!active`):
    /// its ready rows come back (the caller publishes or unmaps them, then calls
    /// [`MapAhead::resume`] for an active slot); a job in flight for it will be unmapped when it
    /// lands.
    pub(super) fn retire(&self, index: usize, extent: usize, active: bool) -> Vec<Row> {
        let tensors = self.tensors();
        let mut g = self.shared.state.lock();
        let s = &mut g.slots[index];
        s.epoch += 1;
        s.active = active;
        s.extent = extent;
        // The caller unmaps the rows outside the lock and then resumes the slot; until then the
        // mapper must not claim their addresses again (an inactive slot is never claimed).
        s.unmapping = active;
        let rows: Vec<Row> = s.ready.drain(..).collect();
        g.held -= rows.len() * tensors;
        g.counters.pages_ready -= (rows.len() * tensors) as u64;
        rows
    }

    /// The caller unmapped the rows [`MapAhead::retire`] or [`MapAhead::put_back`] handed it:
    /// the mapper may claim slot `index`'s rows again.
    pub(super) fn resume(&self, index: usize) {
        let mut g = self.shared.state.lock();
        g.slots[index].unmapping = false;
        self.wake_if_parked(g);
    }

    /// The pool ran out for a synchronous caller: waits for the in-flight job, takes every ready
    /// row of the space, and stops refilling each slot until its next grow.
    pub(super) fn drain_all(&self) -> Vec<Row> {
        let tensors = self.tensors();
        let mut g = self.shared.state.lock();
        while g.in_flight.is_some() {
            self.shared.landed.wait(&mut g);
        }
        let mut rows = Vec::new();
        for s in &mut g.slots {
            s.want = 0;
            s.held_off = true;
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
        let zero = self.shared.release(rows);
        let mut g = self.shared.state.lock();
        g.counters.unmap_calls += n as u64;
        g.counters.pages_unmapped_total += n as u64;
        g.counters.add_zero(zero);
    }

    pub(super) fn counters(&self) -> AheadCounters {
        self.shared.state.lock().counters
    }
}

impl Drop for MapAhead {
    /// Stops the mapper (it finishes its in-flight job) and unmaps every ready row.
    fn drop(&mut self) {
        self.shared.state.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let rows = {
            let mut g = self.shared.state.lock();
            // Owed rows are none here: the space files them before it drops its mapper.
            g.slots
                .iter_mut()
                .flat_map(|s| s.ready.drain(..).chain(s.owed.drain(..)))
                .collect::<Vec<_>>()
        };
        self.shared.release(rows);
    }
}

impl AheadCounters {
    /// Counts the zero-page swaps' driver calls.
    fn add_zero(&mut self, calls: ZeroCalls) {
        self.map_calls += calls.map;
        self.unmap_calls += calls.unmap;
        self.set_access_calls += calls.set_access;
    }
}

impl Shared {
    fn va(&self, tensor: usize, slot: usize, row: usize) -> DevicePtr {
        self.reservations[tensor].ptr() + (slot * self.pages_per_slot + row) as u64 * self.page
    }

    fn run(&self) {
        let tensors = self.reservations.len();
        let mut g = self.state.lock();
        while !g.stop {
            let now = Instant::now();
            let poll = g.plan(now);
            if let Some(job) = g.next_job(tensors, self.pages_per_slot, now) {
                g = self.work(g, job, tensors);
                continue;
            }
            match poll {
                Some(interval) => {
                    self.wake.wait_for(&mut g, interval);
                }
                None => {
                    g.parked = true;
                    self.wake.wait(&mut g);
                    g.parked = false;
                }
            }
        }
    }

    /// Maps `job` with the lock released, then publishes its rows (or unmaps them, for a slot
    /// that moved on meanwhile); the job stays in flight until either is done.
    fn work<'a>(
        &'a self,
        mut g: MutexGuard<'a, State>,
        job: Job,
        tensors: usize,
    ) -> MutexGuard<'a, State> {
        let pages = job.rows * tensors;
        g.in_flight = Some(job);
        g.held += pages;
        drop(g);
        let started = Instant::now();
        let mut zero = ZeroCalls::default();
        let mapped = self.map_rows(job, &mut zero);
        let took = started.elapsed().as_secs_f64();
        let mut g = self.state.lock();
        g.counters.add_zero(zero);
        match mapped {
            Ok(rows) => {
                g.job_secs = if g.job_secs == 0.0 {
                    took
                } else {
                    0.8 * g.job_secs + 0.2 * took
                };
                g.counters.map_calls += pages as u64;
                g.counters.set_access_calls += tensors as u64;
                g.counters.pages_mapped_total += pages as u64;
                let s = &mut g.slots[job.slot];
                if s.active && s.epoch == job.epoch && s.extent + s.ready.len() == job.row {
                    s.ready.extend(rows);
                    g.counters.pages_ready += pages as u64;
                } else {
                    // Still in flight (its addresses stay claimed) until it is unmapped.
                    drop(g);
                    let zero = self.release(rows);
                    g = self.state.lock();
                    g.counters.add_zero(zero);
                    g.held -= pages;
                    g.counters.unmap_calls += pages as u64;
                    g.counters.pages_unmapped_total += pages as u64;
                }
            }
            Err(e) => {
                if let strata_vmm::Error::AlreadyMapped { .. } = e {
                    g.overlap.get_or_insert(format!("{job:?}: {e}"));
                }
                // Out of memory or a driver refusal: not now; the next grow asks again.
                g.slots[job.slot].held_off = true;
                g.held -= pages;
            }
        }
        g.in_flight = None;
        self.landed.notify_all();
        g
    }
}
