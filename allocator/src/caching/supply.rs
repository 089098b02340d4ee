//! Where the pages of a new mapping come from: cached pages recycled (unmapped and mapped
//! again elsewhere) and fresh ones from the pool or, past the limit or the device's memory, from
//! the tag's overflow pool; checked against the limit and reserved under the lock, gathered
//! with it dropped (`grow.rs`).
//!
//! The limit ([`CachingConfig::limit`](super::CachingConfig::limit)) is on the device's own
//! memory, like PyTorch's memory fraction and like the device pool's own limit: pages of host
//! memory or of a peer behind the allocator's addresses (overflow, offload, revocation to host)
//! do not count against it. A tag with an overflow pool goes on past it there.

use parking_lot::Mutex;
use strata_vmm::{DevicePtr, Error, Location, Result, StreamHandle};

use super::stats::DriverCalls;
use super::{CachingAllocator, State};
use crate::mapped::{unmap_pages, MappedPage};
use crate::pool::{Page, PagePool, PageSource};

/// Whether `page` is `device`'s own memory, what the limit counts: not host memory, not a
/// peer's pages (overflowed onto, or borrowed).
pub(super) fn on_device(page: &Page, device: u32) -> bool {
    !matches!(page.source(), PageSource::Borrowed { .. })
        && page.phys().location() == Location::Device(device)
}

/// Of `pages`, how many are not the device's own memory ([`on_device`]).
pub(super) fn elsewhere(pages: &[MappedPage], device: u32) -> u64 {
    pages.iter().filter(|m| !on_device(&m.page, device)).count() as u64
}

/// Pages on their way to a new mapping: `want` of them, all or none.
#[derive(Default)]
pub(super) struct Supply {
    pub(super) want: u64,
    /// Cached pages out of the tables, still mapped at their old VA.
    pub(super) mapped: Vec<MappedPage>,
    /// The old arena ranges of `mapped`, held until they are unmapped.
    pub(super) ranges: Vec<(u64, u64)>,
    /// Pages already unmapped.
    pub(super) ready: Vec<Page>,
    /// Pages to take from the pool.
    pub(super) fresh: usize,
    /// At most this many fresh pages (with the replacements of recycled pages of other pools)
    /// come from the device's pool (the room under the limit, and for a tag that overflows
    /// what the device has left), the rest from the overflow pool; `None`: all from the
    /// device's pool, or all from the overflow pool when the device is out of memory.
    pub(super) device_room: Option<u64>,
    /// Bytes held on the device and the limit, when one was set (for [`Error::LimitExceeded`]).
    pub(super) limit: Option<(u64, u64)>,
}

impl Supply {
    /// Pages of the device's own memory held outside the tables (counted against the limit
    /// while in flight): recycled ones, and the fresh ones the device's pool will give (every
    /// recycled page of elsewhere counted as replaced by one).
    pub(super) fn device_pages(&self, device: u32) -> u64 {
        let foreign = elsewhere(&self.mapped, device);
        let fresh = self.fresh as u64 + foreign;
        let fresh = self.device_room.map_or(fresh, |r| fresh.min(r));
        self.mapped.len() as u64 - foreign + self.ready.len() as u64 + fresh
    }

    /// Unmaps the cached pages and takes the fresh ones: `want` pages (extras go back to the
    /// pool), or none (all back to the pool) and the first error. Makes driver calls; the
    /// old ranges are the caller's to free.
    /// `overflow`: a pool (host memory, a peer's) whose pages stand in when `pool` is out of
    /// memory or the limit is reached (a tag that allows overflow); they return to it wherever
    /// they are freed.
    pub(super) fn gather(
        self,
        pool: &PagePool,
        overflow: Option<&PagePool>,
        calls: &mut DriverCalls,
        requested: u64,
        stuck: &Mutex<Vec<DevicePtr>>,
    ) -> Result<Vec<Page>> {
        let mut pages = self.ready;
        calls.unmap += self.mapped.len() as u64;
        let unmapped =
            unmap_pages(pool, self.mapped, &mut pages).map_err(|s| s.into_error(&mut stuck.lock()));
        // Cached pages of other pools (host memory of an offloaded tag) go home; a new mapping
        // gets the device's own pages in their place.
        let (mut pages, foreign): (Vec<Page>, Vec<Page>) =
            pages.into_iter().partition(|p| p.is_home(pool));
        let missing = self.fresh + foreign.len();
        pool.give(foreign);
        let fresh = unmapped.and_then(|()| {
            let room = self.device_room.map_or(missing, |r| {
                usize::try_from(r).map_or(missing, |r| r.min(missing))
            });
            take_fresh(pool, overflow, (room, missing), self.limit, requested)
        });
        match fresh {
            Ok(fresh) => {
                pages.extend(fresh);
                if pages.len() as u64 > self.want {
                    pool.give(pages.split_off(self.want as usize));
                }
                Ok(pages)
            }
            Err(e) => {
                pool.give(pages);
                Err(for_request(e, requested))
            }
        }
    }
}

/// `n` fresh pages, `on_device` of them from `pool` (all `n` from `overflow` when `pool` is out
/// of memory), the rest from `overflow`; without one, the rest is refused by the `limit` (bytes
/// held, limit).
fn take_fresh(
    pool: &PagePool,
    overflow: Option<&PagePool>,
    (on_device, n): (usize, usize),
    limit: Option<(u64, u64)>,
    requested: u64,
) -> Result<Vec<Page>> {
    let mut got = match on_device {
        0 => Vec::new(),
        k => match pool.take(k) {
            Ok(pages) => pages,
            Err(e) if e.is_out_of_memory() && overflow.is_some() => Vec::new(),
            Err(e) => return Err(e),
        },
    };
    let rest = n - got.len();
    if rest == 0 {
        return Ok(got);
    }
    let more = match (overflow, limit) {
        (Some(spill), _) => spill.take(rest),
        (None, Some((used, limit))) => Err(Error::LimitExceeded {
            requested,
            used,
            limit,
        }),
        (None, None) => Err(super::internal(format!("{rest} pages from nowhere"))),
    };
    match more {
        Ok(more) => {
            got.extend(more);
            Ok(got)
        }
        Err(e) => {
            pool.give(got);
            Err(e)
        }
    }
}

/// The pool's out-of-memory error (about the page it failed to create) restated for the
/// caller's whole request.
#[cold]
fn for_request(e: Error, requested: u64) -> Error {
    match e {
        Error::OutOfMemory {
            location,
            available,
            ..
        } => Error::OutOfMemory {
            location,
            requested,
            available,
        },
        e => e,
    }
}

impl CachingAllocator {
    /// Under the lock: checks that `n` more pages fit (under the limit, counting the pages of
    /// in-flight work, and on the device; past either when the tag `overflows`) and takes the
    /// cached pages to recycle out of the tables (unmapped cached pages come first, so
    /// reserved memory does not grow while cached pages sit idle); the rest will come from the
    /// pool, or from the overflow pool.
    pub(super) fn reserve_supply(
        &self,
        st: &mut State,
        n: u64,
        requested: u64,
        overflows: bool,
    ) -> Result<Supply> {
        let reclaimable =
            st.cache.pages() + st.empty_segment_pages() + self.cuttable_pages(st, None);
        let fresh = n.saturating_sub(reclaimable);
        let mut device_room = None;
        let mut held_limit = None;
        if let Some(limit) = st.limit {
            let held = st.device_pages() + st.inflight.pages();
            let room = (limit / self.page).saturating_sub(held);
            let used = held * self.page;
            if fresh > room && !overflows {
                st.totals.counts.ooms += 1;
                return Err(Error::LimitExceeded {
                    requested,
                    used,
                    limit,
                });
            }
            device_room = Some(room);
            held_limit = Some((used, limit));
        }
        if overflows {
            // What the device has left goes first, the rest onto the overflow pool (a request
            // larger than the device included).
            let left = self.pool_room();
            device_room = Some(device_room.map_or(left, |r| r.min(left)));
        } else if fresh
            .checked_mul(self.page)
            .is_none_or(|b| b > self.device_total)
            && fresh > self.device_total / self.page + self.pool.stats().free as u64
        {
            // Hopeless: fail before the pool creates (and drops) a device's worth of pages.
            return Err(self.oom(st, requested));
        }
        let mut supply = Supply {
            want: n,
            fresh: usize::try_from(fresh).map_err(|_| Error::Overflow("page count"))?,
            device_room,
            limit: held_limit,
            ..Supply::default()
        };
        if n > fresh {
            self.take_cached(st, n - fresh, &mut supply)?;
        }
        Ok(supply)
    }

    /// Takes at least `need` cached pages (smallest cached runs first, then empty small
    /// segments; whole free pages are cut out of large segments first if those are short)
    /// out of the tables into `supply`, after synchronizing the streams that may
    /// touch them (under the lock: a failure leaves everything in place). They stay mapped,
    /// their ranges held, until the supply is gathered.
    fn take_cached(&self, st: &mut State, need: u64, supply: &mut Supply) -> Result<()> {
        let short = need.saturating_sub(st.cache.pages() + st.empty_segment_pages());
        if short > 0 {
            self.cut_free_pages(st, Some(short), None);
        }
        let mut remaining = need;
        let mut runs = Vec::new();
        for start in st.cache.starts_smallest_first() {
            if remaining == 0 {
                break;
            }
            let Some(have) = st.cache.get(start).map(|r| r.pages) else {
                continue;
            };
            let k = have.min(remaining);
            if let Some(taken) = st.cache.take_tail(start, k) {
                remaining -= k;
                runs.push(taken);
            }
        }
        let mut segs = Vec::new();
        if remaining > 0 {
            for id in st.empty_segments(true) {
                if remaining == 0 {
                    break;
                }
                if let Some(seg) = &st.segments[id as usize] {
                    remaining = remaining.saturating_sub(seg.pages);
                    segs.push(id);
                }
            }
        }
        let mut streams: Vec<StreamHandle> = runs.iter().map(|(_, r)| r.stream).collect();
        for &id in &segs {
            if let Some(seg) = &st.segments[id as usize] {
                streams.extend(seg.blocks.iter().map(|&b| st.blocks[b as usize].stream));
            }
        }
        if let Err(e) = self.sync_streams(st, streams) {
            for (start, run) in runs {
                st.cache.insert(start, run);
            }
            return Err(e);
        }
        for (start, run) in runs {
            self.uncount_mapped(st, run.tag as usize, &run.payload);
            st.totals.counts.pages_recycled += run.pages;
            supply.mapped.extend(run.payload);
            supply.ranges.push((start, run.pages));
        }
        for id in segs {
            let (range, mapped) = self.release_segment(st, id)?;
            st.totals.counts.pages_recycled += mapped.len() as u64;
            supply.mapped.extend(mapped);
            supply.ranges.push(range);
        }
        Ok(())
    }

    /// `n` pages to map, gathered with the lock held throughout (wake; growth when the arena's
    /// VA is short): cached pages unmapped, their old ranges freed, the rest from the pool.
    pub(super) fn gather_locked(
        &self,
        st: &mut State,
        n: u64,
        requested: u64,
    ) -> Result<Vec<Page>> {
        let mut supply = self.reserve_supply(st, n, requested, false)?;
        let ranges = std::mem::take(&mut supply.ranges);
        let mut calls = DriverCalls::default();
        let got = supply.gather(&self.pool, None, &mut calls, requested, &self.stuck_va);
        calls.add_to(&mut st.totals.counts);
        for (start, len) in ranges {
            self.free_va(st, start, len)?;
        }
        if got.as_ref().is_err_and(Error::is_out_of_memory) {
            st.totals.counts.ooms += 1;
        }
        got
    }

    /// Out of memory on the device for `requested` bytes; `available` is what growth could
    /// still get there: the pages the pool can hand out ([`Self::pool_room`]) and the cached
    /// pages it would recycle.
    #[cold]
    pub(super) fn oom(&self, st: &mut State, requested: u64) -> Error {
        st.totals.counts.ooms += 1;
        let cached = st.cache.pages() + st.empty_segment_pages() + self.cuttable_pages(st, None);
        Error::OutOfMemory {
            location: Location::Device(self.device),
            requested,
            available: (self.pool_room() + cached).saturating_mul(self.page),
        }
    }

    /// Pages the device's pool could still hand out: its free pages and those it could create
    /// (the device's free memory, under the pool's own limit).
    pub(super) fn pool_room(&self) -> u64 {
        let pool = self.pool.stats();
        let held = (pool.free + pool.in_use) as u64;
        let free = self.backend.mem_info(self.device).map_or(0, |m| m.free);
        let creatable = pool.limit.map_or(free / self.page, |limit| {
            (free / self.page).min((limit / self.page).saturating_sub(held))
        });
        pool.free as u64 + creatable
    }

    /// `pages` join the tables under tag index `ti`: counted in the totals and the tag's, and
    /// those not the device's own memory apart, out of the limit's reach.
    pub(super) fn count_mapped(&self, st: &mut State, ti: usize, pages: &[MappedPage]) {
        let n = pages.len() as u64;
        st.totals.add_pages(n);
        st.totals.elsewhere_pages += elsewhere(pages, self.device);
        st.tags[ti].totals.mapped_pages += n;
    }

    /// `pages` leave the tables of tag index `ti` (the reverse of [`Self::count_mapped`]).
    pub(super) fn uncount_mapped(&self, st: &mut State, ti: usize, pages: &[MappedPage]) {
        let n = pages.len() as u64;
        st.totals.sub_pages(n);
        st.totals.elsewhere_pages -= elsewhere(pages, self.device);
        st.tags[ti].totals.mapped_pages -= n;
    }
}
