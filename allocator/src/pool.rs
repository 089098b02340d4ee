//! `PagePool`: granularity-sized physical pages of one device, kept between watermarks.
//!
//! A background thread tops the free list up to the high watermark when it falls below the low
//! one, and trims it back when the pool has been idle. `take` never waits for that thread: when
//! the free list is short it creates the missing pages itself, with no lock held across the
//! driver calls (kvcached#371: no lock held while waiting on the refill thread).

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use strata_vmm::{Backend, CreateFlags, Error, Location, PhysicalMemory, Result};

/// Where a page's physical memory came from, so that borrowed memory can be given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageSource {
    /// Created on this device for the pool.
    Fresh,
    /// Reclaimed from the parameters of a model (MIRAGE); `owner` names the model it came from
    /// (provenance only: the model may since have been unregistered, and model ids are never
    /// reused; a reversion takes any reclaimed page back as `Fresh`).
    Reclaimed { owner: u32 },
    /// Borrowed from a peer device (Harvest); `lender` is its ordinal.
    Borrowed { lender: u32 },
}

/// One granularity-sized page of physical memory, its source and its home: the pool that
/// created or adopted it and counts it. Pages go back through [`PagePool::give`],
/// [`PagePool::release`] or [`PagePool::detach`] of *any* pool: each page is routed to its
/// home, so an owner holding pages of several pools (device pages next to host pages after a
/// migration) gives them all back to the one pool it knows. Dropping one elsewhere releases
/// its memory but leaves the pool's counters behind.
#[derive(Debug)]
pub struct Page {
    phys: Arc<PhysicalMemory>,
    source: PageSource,
    /// The pool that counts this page (weak: pages on a pool's own free list point at it).
    home: Weak<Inner>,
}

impl Page {
    pub fn phys(&self) -> &Arc<PhysicalMemory> {
        &self.phys
    }

    pub fn source(&self) -> PageSource {
        self.source
    }

    pub fn size(&self) -> u64 {
        self.phys.size()
    }

    /// Whether `pool` counts this page (took or adopted it).
    pub fn is_home(&self, pool: &PagePool) -> bool {
        std::ptr::eq(self.home.as_ptr(), Arc::as_ptr(&pool.inner))
    }
}

/// Watermarks, limit and background behaviour of a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// The refill thread tops up when fewer free pages than this remain.
    pub low_watermark: usize,
    /// ... up to this many free pages; above it, free pages are trimmed.
    pub high_watermark: usize,
    /// Most bytes of pages the pool may hold at once (free and in use); the starting value of
    /// [`PagePool::set_limit`].
    pub limit: Option<u64>,
    /// Trim free pages down to the low watermark after this long without `take`/`give`.
    pub idle_trim_after: Option<Duration>,
    /// Run the refill/trim thread (off: `take` creates on demand, trimming is explicit).
    pub background: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            low_watermark: 4,
            high_watermark: 16,
            limit: None,
            idle_trim_after: Some(Duration::from_secs(5)),
            background: true,
        }
    }
}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub page_size: u64,
    /// Free pages held.
    pub free: usize,
    /// Pages of this device handed out and not yet given back (lent ones included).
    pub in_use: usize,
    /// Of `in_use`, pages lent to a peer device (Harvest placements, [`PageLease::lend`](crate::PageLease::lend)).
    pub lent: usize,
    /// Pages of peer devices adopted here as [`PageSource::Borrowed`] and in use: not this
    /// device's memory, so not in `in_use` or [`held_bytes`](Self::held_bytes) (a lent page
    /// is counted once, by its lender).
    pub borrowed: usize,
    /// Pages created through the driver, ever.
    pub created_total: u64,
    /// Pages released to the driver, ever.
    pub released_total: u64,
    /// Pages created by `take` itself because the free list was short.
    pub created_on_demand: u64,
    /// Pages not created here (reclaimed or borrowed) adopted, ever.
    pub adopted_total: u64,
    /// Pages whose unmap failed, kept out of the free list and never released (their memory
    /// may still be mapped): leaked on purpose, ever.
    pub quarantined: u64,
    pub limit: Option<u64>,
}

impl PoolStats {
    /// Bytes of this device's physical memory the pool holds (free and in use).
    pub fn held_bytes(&self) -> u64 {
        (self.free + self.in_use) as u64 * self.page_size
    }
}

/// How often a take that ran out of memory while pages were settling looks again.
const SETTLE_RETRIES: u32 = 3;
/// The longest a take waits for pages being created or released to settle.
const SETTLE_WAIT: Duration = Duration::from_secs(2);

struct State {
    free: Vec<Page>,
    in_use: usize,
    lent: usize,
    borrowed: usize,
    /// Pages being created outside the lock, counted against the limit.
    pending: usize,
    /// Pages being released outside the lock (trims, releases): their memory is not back yet.
    releasing: usize,
    /// Times memory moved: pages created or released outside the lock settled (landed in the
    /// free list, went to a caller, or back to the driver) or pages were given back. A take
    /// that ran out of memory looks again when this changed while it tried.
    settles: u64,
    created_total: u64,
    released_total: u64,
    created_on_demand: u64,
    adopted_total: u64,
    quarantined: u64,
    last_activity: Instant,
    /// The last refill ran out of memory: wait for pages to come back before trying again.
    refill_blocked: bool,
    /// An explicit [`PagePool::trim`] emptied the pool on purpose: no refill until the next
    /// `take` (demand), so an idle process keeps holding nothing.
    refill_after_demand: bool,
    /// Most bytes of pages held at once (free, in use and being created).
    limit: Option<u64>,
    shutdown: bool,
}

struct Inner {
    backend: Arc<dyn Backend>,
    device: u32,
    /// Where the pages' memory lives: `Device(device)`, or `Host` for a host-memory pool.
    location: Location,
    page_size: u64,
    config: PoolConfig,
    state: Mutex<State>,
    wake_worker: Condvar,
    /// Notified when pages being created or released outside the lock have settled.
    settled: Condvar,
}

/// Physical pages of one device. Shared as `Arc<PagePool>`.
pub struct PagePool {
    inner: Arc<Inner>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl PagePool {
    /// A pool of `device`'s granularity-sized pages.
    pub fn new(
        backend: Arc<dyn Backend>,
        device: u32,
        config: PoolConfig,
    ) -> Result<Arc<PagePool>> {
        PagePool::new_at(backend, device, Location::Device(device), config)
    }

    /// A pool of pages in host memory (host-NUMA VMM memory on CUDA) for `device` to map: the
    /// memory is accounted to the host, not to the device. Its pages have the device's page
    /// size, so they can stand in for the device's own pages behind a mapped run
    /// ([`MappedRun::migrate`](crate::MappedRun::migrate)); a host granularity that does not
    /// divide it is [`Error::Unsupported`].
    pub fn new_host(
        backend: Arc<dyn Backend>,
        device: u32,
        config: PoolConfig,
    ) -> Result<Arc<PagePool>> {
        PagePool::new_at(backend, device, Location::Host, config)
    }

    fn new_at(
        backend: Arc<dyn Backend>,
        device: u32,
        location: Location,
        config: PoolConfig,
    ) -> Result<Arc<PagePool>> {
        if config.low_watermark > config.high_watermark {
            return Err(Error::InvalidArgument(format!(
                "low watermark {} above high watermark {}",
                config.low_watermark, config.high_watermark
            )));
        }
        if device >= backend.device_count() {
            return Err(Error::NoDevice(device.into()));
        }
        let page_size = backend.granularity(Location::Device(device))?;
        let own = backend.granularity(location)?;
        if own == 0 || page_size % own != 0 {
            return Err(Error::Unsupported(format!(
                "{location} granularity {own} does not divide device {device}'s page of {page_size}"
            )));
        }
        let inner = Arc::new(Inner {
            backend,
            device,
            location,
            page_size,
            state: Mutex::new(State {
                free: Vec::new(),
                in_use: 0,
                lent: 0,
                borrowed: 0,
                pending: 0,
                created_total: 0,
                released_total: 0,
                created_on_demand: 0,
                adopted_total: 0,
                quarantined: 0,
                last_activity: Instant::now(),
                releasing: 0,
                settles: 0,
                refill_blocked: false,
                refill_after_demand: false,
                limit: config.limit,
                shutdown: false,
            }),
            wake_worker: Condvar::new(),
            settled: Condvar::new(),
            config,
        });
        let worker = if inner.config.background {
            let inner = Arc::clone(&inner);
            let handle = std::thread::Builder::new()
                .name(format!("strata-pool-{device}"))
                .spawn(move || inner.run_worker())
                .map_err(|source| Error::Os {
                    call: "spawn pool thread",
                    source,
                })?;
            Some(handle)
        } else {
            None
        };
        Ok(Arc::new(PagePool {
            inner,
            worker: Mutex::new(worker),
        }))
    }

    pub fn page_size(&self) -> u64 {
        self.inner.page_size
    }

    /// The device that maps these pages (whose pool this is).
    pub fn device(&self) -> u32 {
        self.inner.device
    }

    /// Where the pages' memory lives.
    pub fn location(&self) -> Location {
        self.inner.location
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// Takes `n` pages: all of them, or none with the error (out of memory, limit; `n` pages of
    /// more bytes than a `u64` counts are out of memory at once).
    pub fn take(&self, n: usize) -> Result<Vec<Page>> {
        if (n as u64).checked_mul(self.inner.page_size).is_none() {
            return Err(Error::OutOfMemory {
                location: self.inner.location,
                requested: u64::MAX,
                available: 0,
            });
        }
        let mut state = self.inner.state.lock();
        state.last_activity = Instant::now();
        state.refill_after_demand = false;
        if state.free.len() >= n {
            let at = state.free.len() - n;
            let pages = state.free.split_off(at);
            state.in_use += n;
            if state.free.len() < self.inner.config.low_watermark {
                self.inner.wake_worker.notify_one();
            }
            return Ok(pages);
        }
        drop(state);
        self.take_slow(n)
    }

    /// Creates the pages the free list is short of, with the lock dropped. When the driver
    /// runs out of memory while memory moved (pages other threads created or released outside
    /// the lock landed in the free list or went back to the driver, or given back pages joined
    /// it) or is still moving, it waits (bounded) for that to settle and looks again, rather
    /// than report an out-of-memory that a moment later is not true.
    #[cold]
    #[inline(never)]
    fn take_slow(&self, n: usize) -> Result<Vec<Page>> {
        let mut attempts = 0;
        let mut state = self.inner.state.lock();
        loop {
            // The free list may have grown since `take` looked: hand out exactly `n`. Free
            // pages are already held, so only the missing ones count as more against the limit.
            let keep = state.free.len().saturating_sub(n);
            let missing = n - (state.free.len() - keep);
            if let Err(e) = self.inner.admit(&state, missing) {
                // Pages the worker is creating count against the limit until they land in
                // the free list, where this take can have them: wait for them (bounded)
                // rather than fail at the limit they hold for a moment.
                if state.pending == 0 || attempts == SETTLE_RETRIES {
                    return Err(e);
                }
                if !self.inner.wait_settled(&mut state, |st| st.pending > 0) {
                    return Err(e);
                }
                attempts += 1;
                continue;
            }
            let mut pages = state.free.split_off(keep);
            state.pending += missing;
            state.in_use += pages.len();
            let seen = state.settles;
            let created = MutexGuard::unlocked(&mut state, || self.inner.create_pages(missing));
            state.pending -= missing;
            let moved = state.settles != seen;
            self.inner.settle(&mut state);
            let e = match created {
                Ok(fresh) => {
                    state.created_total += fresh.len() as u64;
                    state.created_on_demand += fresh.len() as u64;
                    state.in_use += fresh.len();
                    pages.extend(fresh);
                    self.inner.wake_worker.notify_one();
                    return Ok(pages);
                }
                Err(e) => e,
            };
            state.in_use -= pages.len();
            state.free.append(&mut pages);
            let settling = state.pending > 0 || state.releasing > 0;
            if !e.is_out_of_memory() || attempts == SETTLE_RETRIES || !(moved || settling) {
                return Err(e);
            }
            if !self
                .inner
                .wait_settled(&mut state, |st| st.pending > 0 || st.releasing > 0)
            {
                return Err(e);
            }
            attempts += 1;
        }
    }

    /// Gives pages back to the free list (the worker trims above the high watermark). Pages
    /// of other pools go back to theirs (see [`Page`]).
    pub fn give(&self, pages: Vec<Page>) {
        if let Some(own) = self.route_home(pages, Inner::give) {
            self.inner.give(own);
        }
    }

    /// Releases pages straight to the driver (their memory returns to the device). Pages of
    /// other pools are uncounted there (see [`Page`]).
    pub fn release(&self, pages: Vec<Page>) {
        if let Some(own) = self.route_home(pages, Inner::release) {
            self.inner.release(own);
        }
    }

    /// Sends the pages of other pools to their homes (through `back`: `give` or `release`
    /// there) and returns this pool's own, or `None` when none are left. A page whose home
    /// pool is gone is dropped (its memory released).
    #[inline]
    fn route_home(&self, pages: Vec<Page>, back: fn(&Inner, Vec<Page>)) -> Option<Vec<Page>> {
        if pages.is_empty() {
            return None;
        }
        if pages.iter().all(|p| p.is_home(self)) {
            return Some(pages);
        }
        let own = route_foreign(&self.inner, pages, back);
        (!own.is_empty()).then_some(own)
    }

    /// Takes a page that was not created by this pool (reclaimed or borrowed) into its
    /// accounting, as in use by the caller (`borrowed` for [`PageSource::Borrowed`], else
    /// `in_use`); `give` later puts it on the free list.
    pub fn adopt(&self, phys: Arc<PhysicalMemory>, source: PageSource) -> Result<Page> {
        if phys.size() != self.inner.page_size {
            return Err(Error::InvalidArgument(format!(
                "adopted page of {} bytes in a pool of {}-byte pages",
                phys.size(),
                self.inner.page_size
            )));
        }
        let mut state = self.inner.state.lock();
        match source {
            PageSource::Borrowed { .. } => state.borrowed += 1,
            _ => state.in_use += 1,
        }
        state.adopted_total += 1;
        Ok(Page {
            phys,
            source,
            home: Arc::downgrade(&self.inner),
        })
    }

    /// Takes a page in use out of this pool's accounting without releasing its memory (the
    /// inverse of [`PagePool::adopt`]): the caller hands the physical memory on, e.g. to another
    /// pool's `adopt`, as MIRAGE does when parameter pages become KV pages and back.
    pub fn detach(&self, page: Page) -> (Arc<PhysicalMemory>, PageSource) {
        let borrowed = borrowed_count(std::slice::from_ref(&page));
        match page.home.upgrade() {
            Some(home) if !page.is_home(self) => home.state.lock().uncount(1, borrowed),
            Some(_) => self.inner.state.lock().uncount(1, borrowed),
            None => {}
        }
        (page.phys, page.source)
    }

    /// Takes a page whose unmap failed out of use for good: uncounted from its home pool like
    /// a release, counted in `PoolStats::quarantined`, and its memory leaked rather than
    /// released or reused (it may still be mapped somewhere). A page whose home pool is gone
    /// is counted nowhere.
    #[cold]
    pub fn quarantine(&self, page: Page) {
        let borrowed = borrowed_count(std::slice::from_ref(&page));
        if let Some(home) = page.home.upgrade() {
            let mut state = home.state.lock();
            state.uncount(1, borrowed);
            state.quarantined += 1;
        }
        std::mem::forget(page.phys);
    }

    /// Releases free pages until at most `keep` remain; returns how many were released. The
    /// background refill then waits for the next `take`.
    pub fn trim(&self, keep: usize) -> usize {
        let mut state = self.inner.state.lock();
        state.refill_after_demand = true;
        if state.free.len() <= keep {
            return 0;
        }
        state.refill_blocked = false;
        let released = state.free.split_off(keep);
        self.inner.release_unlocked(state, released)
    }

    /// Counts `n` pages in use as lent to a peer (`lent = true`) or back from it.
    pub(crate) fn mark_lent(&self, n: usize, lent: bool) {
        let mut state = self.inner.state.lock();
        state.lent = if lent {
            state.lent + n
        } else {
            state.lent.saturating_sub(n)
        };
    }

    pub fn stats(&self) -> PoolStats {
        let state = self.inner.state.lock();
        PoolStats {
            page_size: self.inner.page_size,
            free: state.free.len(),
            in_use: state.in_use,
            lent: state.lent,
            borrowed: state.borrowed,
            created_total: state.created_total,
            released_total: state.released_total,
            created_on_demand: state.created_on_demand,
            adopted_total: state.adopted_total,
            quarantined: state.quarantined,
            limit: state.limit,
        }
    }

    /// Sets (or lifts) the cap on the bytes of pages held (free, in use, being created), and
    /// releases free pages until what is held fits. Pages in use stay; creating more fails
    /// ([`Error::LimitExceeded`]) until enough come back.
    pub fn set_limit(&self, limit: Option<u64>) {
        let mut state = self.inner.state.lock();
        state.limit = limit;
        let Some(limit) = limit else {
            return;
        };
        let others = (state.in_use + state.pending) as u64 * self.inner.page_size;
        let fit = limit.saturating_sub(others) / self.inner.page_size;
        let keep = state
            .free
            .len()
            .min(usize::try_from(fit).unwrap_or(usize::MAX));
        let released = state.free.split_off(keep);
        self.inner.release_unlocked(state, released);
    }
}

impl State {
    /// Takes `n` pages in use by a caller, `borrowed` of them borrowed, out of the counts.
    fn uncount(&mut self, n: usize, borrowed: usize) {
        self.borrowed = self.borrowed.saturating_sub(borrowed);
        self.in_use = self.in_use.saturating_sub(n - borrowed);
    }
}

fn borrowed_count(pages: &[Page]) -> usize {
    pages
        .iter()
        .filter(|p| matches!(p.source, PageSource::Borrowed { .. }))
        .count()
}

impl Drop for PagePool {
    fn drop(&mut self) {
        self.inner.state.lock().shutdown = true;
        self.inner.wake_worker.notify_all();
        if let Some(handle) = self.worker.lock().take() {
            // A panicked worker has nothing left to clean up; the free pages drop with `inner`.
            let _ = handle.join();
        }
    }
}

/// Splits off the pages whose home is not `own` and hands each group to its home through
/// `back`; returns `own`'s pages.
#[cold]
#[inline(never)]
fn route_foreign(own: &Arc<Inner>, pages: Vec<Page>, back: fn(&Inner, Vec<Page>)) -> Vec<Page> {
    let (mine, mut foreign): (Vec<Page>, Vec<Page>) = pages
        .into_iter()
        .partition(|p| std::ptr::eq(p.home.as_ptr(), Arc::as_ptr(own)));
    while let Some(first) = foreign.first() {
        let home = first.home.clone();
        let (same, rest): (Vec<Page>, Vec<Page>) = foreign
            .into_iter()
            .partition(|p| Weak::ptr_eq(&p.home, &home));
        foreign = rest;
        match home.upgrade() {
            Some(inner) => back(&inner, same),
            None => drop(same),
        }
    }
    mine
}

impl Inner {
    fn give(&self, pages: Vec<Page>) {
        let mut state = self.state.lock();
        state.last_activity = Instant::now();
        state.uncount(pages.len(), borrowed_count(&pages));
        state.refill_blocked = false;
        state.settles += 1;
        state.free.extend(pages);
        if state.free.len() > self.config.high_watermark {
            self.wake_worker.notify_one();
        }
    }

    fn release(&self, pages: Vec<Page>) {
        let mut state = self.state.lock();
        state.uncount(pages.len(), borrowed_count(&pages));
        self.release_unlocked(state, pages);
        self.wake_worker.notify_one();
    }

    /// Releases `pages`, which no counter holds any more (split off the free list, just
    /// created, or given up by a caller), to the driver outside the lock: until their memory is
    /// back they count as `releasing`, so that a take running out of memory meanwhile waits
    /// for them (`take_slow`), and a refill that ran out may try again after. Consumes the
    /// lock's guard; returns how many pages went.
    fn release_unlocked(&self, mut state: MutexGuard<'_, State>, pages: Vec<Page>) -> usize {
        let n = pages.len();
        if n == 0 {
            return 0;
        }
        state.released_total += n as u64;
        state.releasing += n;
        drop(state);
        drop(pages); // driver calls outside the lock
        let mut state = self.state.lock();
        state.releasing -= n;
        state.refill_blocked = false;
        self.settle(&mut state);
        n
    }

    /// Pages created or released outside the lock settled: counts the move
    /// ([`State::settles`]) and wakes the takes waiting for it.
    fn settle(&self, state: &mut State) {
        state.settles += 1;
        self.settled.notify_all();
    }

    /// Checks that `extra` more pages fit under the limit.
    fn admit(&self, state: &State, extra: usize) -> Result<()> {
        let Some(limit) = state.limit else {
            return Ok(());
        };
        let held = (state.free.len() + state.in_use + state.pending) as u64 * self.page_size;
        let requested = (extra as u64).saturating_mul(self.page_size);
        if held.saturating_add(requested) > limit {
            return Err(Error::LimitExceeded {
                requested,
                used: held,
                limit,
            });
        }
        Ok(())
    }

    /// Waits while `moving` holds (pages being created or released outside the lock), each
    /// wait bounded by `SETTLE_WAIT`; false when one timed out.
    fn wait_settled(
        &self,
        state: &mut MutexGuard<'_, State>,
        moving: impl Fn(&State) -> bool,
    ) -> bool {
        while moving(state) {
            if self.settled.wait_for(state, SETTLE_WAIT).timed_out() {
                return false;
            }
        }
        true
    }

    fn create_pages(self: &Arc<Self>, n: usize) -> Result<Vec<Page>> {
        let location = self.location;
        // Grown page by page: `n` may be far more than the device holds (it refuses first).
        let mut pages = Vec::new();
        for _ in 0..n {
            // On failure the pages created so far drop here and are released.
            let phys = PhysicalMemory::create(
                &self.backend,
                location,
                self.page_size,
                CreateFlags::empty(),
            )?;
            pages.push(Page {
                phys: Arc::new(phys),
                source: PageSource::Fresh,
                home: Arc::downgrade(self),
            });
        }
        Ok(pages)
    }

    fn run_worker(self: Arc<Self>) {
        let tick = Duration::from_millis(50);
        let mut state = self.state.lock();
        loop {
            if state.shutdown {
                return;
            }
            let free = state.free.len();
            if free < self.config.low_watermark
                && !state.refill_blocked
                && !state.refill_after_demand
            {
                let want = self.config.high_watermark - free;
                let want = (0..=want)
                    .rev()
                    .find(|&k| self.admit(&state, k).is_ok())
                    .unwrap_or(0);
                if want > 0 {
                    state.pending += want;
                    drop(state);
                    let created = self.create_pages(want);
                    state = self.state.lock();
                    state.pending -= want;
                    self.settle(&mut state);
                    match created {
                        // A trim while these were created asked for an empty pool: release.
                        Ok(pages) if state.refill_after_demand => {
                            state.created_total += pages.len() as u64;
                            self.release_unlocked(state, pages);
                            state = self.state.lock();
                            continue;
                        }
                        Ok(pages) => {
                            state.created_total += pages.len() as u64;
                            state.free.extend(pages);
                            continue;
                        }
                        // Out of memory: no retries until pages come back (give/release).
                        Err(_) => state.refill_blocked = true,
                    }
                }
            } else if free > self.config.high_watermark
                || self.config.idle_trim_after.is_some_and(|idle| {
                    free > self.config.low_watermark && state.last_activity.elapsed() >= idle
                })
            {
                let keep = if free > self.config.high_watermark {
                    self.config.high_watermark
                } else {
                    self.config.low_watermark
                };
                let released = state.free.split_off(keep);
                self.release_unlocked(state, released);
                state = self.state.lock();
                continue;
            }
            self.wake_worker.wait_for(&mut state, tick);
        }
    }
}
