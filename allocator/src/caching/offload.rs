//! Offload and onload per tag: a tag's live pages move onto other physical memory (host memory
//! for [`CachingAllocator::offload`], the device's own pages for
//! [`CachingAllocator::onload`]) at the same addresses, one segment at a time through
//! [`MappedRun::migrate`]. Pointers stay valid throughout; only the speed of access changes.
//! The tag is claimed for the move (`quiet.rs`): its streams are waited for and each segment
//! is copied and remapped with the lock dropped, while other tags allocate and free.
//!
//! Pages remember their home pool ([`Page`]), so a host page freed while its tag
//! is offloaded goes back to the host pool from any of the allocator's release paths, and
//! growth never maps another pool's cached page behind a new allocation (`grow.rs`).

use std::sync::Arc;
use std::time::Instant;

use strata_vmm::{Access, Error, Location, Result, StreamHandle};

use super::quiet::Quiet;
use super::supply::{elsewhere, on_device};
use super::{internal, CachingAllocator, MappedPage, State, TagId};
use crate::mapped::{MappedRun, Migrated};
use crate::pool::{Page, PagePool};

/// Bytes of mapped pages by where their memory is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// The device's own memory.
    pub local: u64,
    /// Pages borrowed from a peer device.
    pub peer: u64,
    /// Host memory mapped for the device.
    pub host: u64,
}

/// Migrations of the allocator (or of one tag) since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpillCounts {
    /// Runs moved off the device (to host memory) and their bytes.
    pub to_host: u64,
    pub bytes_to_host: u64,
    /// Runs moved onto the device's own pages and their bytes.
    pub to_device: u64,
    pub bytes_to_device: u64,
    /// Nanoseconds callers waited on migrations (copies and remaps).
    pub stalled_ns: u64,
}

impl SpillCounts {
    pub(super) fn add(&mut self, bytes: u64, onto_device: bool, stalled_ns: u64) {
        if onto_device {
            self.to_device += 1;
            self.bytes_to_device += bytes;
        } else {
            self.to_host += 1;
            self.bytes_to_host += bytes;
        }
        self.stalled_ns = self.stalled_ns.saturating_add(stalled_ns);
    }
}

/// A run whose pages a migration holds with the lock dropped: its segment's `mapped` is empty
/// until they are put back.
pub(super) struct InMigration {
    /// First arena page of its segment (small or large).
    pub start: u64,
    /// Tag index.
    pub tag: u32,
    pub pages: u64,
    /// Of `pages`, those not of the device's own memory (as counted in the totals).
    pub elsewhere: u64,
    /// Where they were when the migration took them.
    pub tiers: TierBytes,
}

/// Where a tag's (or the allocator's) pages are and what moved them there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpillStats {
    pub tiers: TierBytes,
    pub counts: SpillCounts,
}

/// What one [`CachingAllocator::offload`] or [`CachingAllocator::onload`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// Segments migrated.
    pub runs: u64,
    pub bytes: u64,
}

impl CachingAllocator {
    /// Moves every live allocation of `tag` onto pages of `to` (a host pool of this device,
    /// [`PagePool::new_host`]) at the same addresses: the pointers stay valid and usable by
    /// the device, at the link's speed. The tag's cached free memory is given back first, so
    /// the device memory it held is free for others. Work on the streams that used the tag's
    /// memory is waited for; the copies are queued on `stream` and it is synchronized before
    /// each remap. New allocations of the tag still come from the device. The waits and the
    /// copies run with the allocator's lock dropped: other tags allocate and free meanwhile,
    /// while the tag's own allocations and frees wait until the offload is done. The tag's
    /// memory must not be used (by work queued after this call began) until it returns.
    ///
    /// A failure (out of host memory included) leaves the segment being moved on its old
    /// pages with its contents; segments moved before it stay moved, and calling again moves
    /// the rest. A sleeping tag is [`Error::InvalidState`]; a tag never used moves nothing.
    pub fn offload(&self, tag: TagId, to: &Arc<PagePool>, stream: StreamHandle) -> Result<Moved> {
        self.check_tier_pool(to)?;
        self.move_tag(tag, to, stream)
    }

    /// Moves every page of `tag` that is not the device's own (offloaded to host memory)
    /// back onto the device's pages at the same addresses; the reverse of
    /// [`offload`](Self::offload), with the same ordering and failure behaviour. Out of device
    /// memory, or a segment that would take the device past the limit
    /// ([`Error::LimitExceeded`]), leaves the rest where it is (still usable).
    pub fn onload(&self, tag: TagId, stream: StreamHandle) -> Result<Moved> {
        self.move_tag(tag, &self.pool, stream)
    }

    /// Lets allocations of `tag` overflow onto pages of `to` (a host pool of this device,
    /// [`PagePool::new_host`], or a peer device's pool: borrowed memory that
    /// [`revoke`](Self::revoke) gives back) when the device is out of memory: instead of
    /// [`Error::OutOfMemory`], growth takes the pages the device has left (its free memory and
    /// the pool's free pages) and the rest from `to` (slower memory at an ordinary address;
    /// [`onload`](Self::onload) moves them to the device once it has room), so a request
    /// larger than the device succeeds when the two together hold it. Past the limit
    /// ([`CachingConfig::limit`](super::CachingConfig::limit)) growth fills the room left
    /// under it and takes the rest from `to`, whose pages do not count against it. A device
    /// that gives less than it seemed to have left (another user took it meanwhile) leaves
    /// the whole growth to `to`. `None` turns it off (the default); pages already taken stay
    /// until freed or onloaded.
    pub fn set_overflow(&self, tag: TagId, to: Option<Arc<PagePool>>) -> Result<()> {
        if let Some(to) = &to {
            self.check_tier_pool(to)?;
        }
        let mut st = self.state.lock();
        let ti = st.ensure_tag(tag, self.classes.len());
        st.tags[ti].overflow = to;
        Ok(())
    }

    /// A pool this allocator may map pages of: host memory for this device, or a peer
    /// device's own pool, with this allocator's page size.
    fn check_tier_pool(&self, to: &PagePool) -> Result<()> {
        let fits = match to.location() {
            Location::Host => to.device() == self.device,
            Location::Device(d) => d == to.device(),
        };
        if !fits || to.page_size() != self.page {
            return Err(Error::InvalidArgument(format!(
                "device {}'s pages of {} bytes onto a pool in {} for device {} with pages of {}",
                self.device,
                self.page,
                to.location(),
                to.device(),
                to.page_size()
            )));
        }
        Ok(())
    }

    /// Bytes by tier and migration counts of `tag`, or of the whole allocator for `None`. A
    /// segment being moved counts where its pages were until it has moved.
    pub fn spill_stats(&self, tag: Option<TagId>) -> SpillStats {
        let st = self.state.lock();
        let ti = match tag {
            None => None,
            Some(t) => match st.tag_slot(t) {
                Some(i) => Some(i as u32),
                None => return SpillStats::default(),
            },
        };
        let mut tiers = self.tier_bytes(pages_of(&st, ti));
        for m in st
            .migrating
            .iter()
            .filter(|m| ti.is_none_or(|t| t == m.tag))
        {
            tiers.local += m.tiers.local;
            tiers.peer += m.tiers.peer;
            tiers.host += m.tiers.host;
        }
        let counts = match ti {
            None => st.spill,
            Some(i) => st.tags[i as usize].spill,
        };
        SpillStats { tiers, counts }
    }

    /// Bytes of `pages` by where their memory is.
    fn tier_bytes<'p>(&self, pages: impl Iterator<Item = &'p Page>) -> TierBytes {
        let mut tiers = TierBytes::default();
        for page in pages {
            let bytes = page.size();
            if on_device(page, self.device) {
                tiers.local += bytes;
            } else if page.phys().location() == Location::Host {
                tiers.host += bytes;
            } else {
                tiers.peer += bytes;
            }
        }
        tiers
    }

    fn move_tag(&self, tag: TagId, to: &Arc<PagePool>, stream: StreamHandle) -> Result<Moved> {
        let mut quiet = Quiet::new(self);
        let Some(ti) = quiet.tag_slot(tag) else {
            return Ok(Moved::default());
        };
        quiet.claim(ti);
        if quiet.tags[ti].asleep() {
            return Err(Error::InvalidState(format!(
                "tag {tag} is asleep: wake it before moving its pages"
            )));
        }
        self.quiesce(&mut quiet)?;
        self.drop_cached_of_claimed(&mut quiet)?;
        let mut moved = Moved::default();
        for (target, start) in targets_of(&quiet, ti as u32, to) {
            if let Some(m) = self.migrate_target(&mut quiet, target, start, ti, &[to], stream)? {
                moved.runs += 1;
                moved.bytes += m.bytes;
            }
        }
        Ok(moved)
    }

    /// Moves the pages of `target` (at arena page `start`, of tag index `ti`, claimed and
    /// quiesced in `quiet`) at the same address onto the first of `pools` that has room (the
    /// device's own pool only as far as the limit lets it), and counts the move and the time
    /// it stalled in the spill stats. The pages leave the tables for the copy and the remap,
    /// which run with the lock dropped (an [`InMigration`] record tells the invariant checker
    /// and the spill stats where they are; the device pages they may take count against the
    /// limit in flight). `None`: the target has no mapped pages.
    pub(super) fn migrate_target(
        &self,
        quiet: &mut Quiet<'_>,
        target: Target,
        start: u64,
        ti: usize,
        pools: &[&Arc<PagePool>],
        stream: StreamHandle,
    ) -> Result<Option<Migrated>> {
        let Some(mapped) = mapped_of(quiet, target) else {
            return Ok(None);
        };
        let pages = std::mem::take(mapped);
        let record = InMigration {
            start,
            tag: ti as u32,
            pages: pages.len() as u64,
            elsewhere: elsewhere(&pages, self.device),
            tiers: self.tier_bytes(pages.iter().map(|m| &m.page)),
        };
        let mut run = MappedRun::from_mapped_pages(&self.pool, self.va_of(start), pages).map_err(
            |(back, e)| {
                put_back(quiet, target, back);
                internal(e.to_string())
            },
        )?;
        let mut refused = None;
        let allowed: Vec<&Arc<PagePool>> = pools
            .iter()
            .copied()
            .filter(
                |pool| match self.limit_refuses(quiet, pool, record.elsewhere, run.size()) {
                    Some(e) => {
                        refused.get_or_insert(e);
                        false
                    }
                    None => true,
                },
            )
            .collect();
        let onto_device = allowed.iter().any(|p| Arc::ptr_eq(p, &self.pool));
        let held = quiet.inflight.begin(
            None,
            None,
            Vec::new(),
            if onto_device { record.elsewhere } else { 0 },
        );
        let was_elsewhere = record.elsewhere;
        quiet.migrating.push(record);
        let grants = [(Location::Device(self.device), Access::ReadWrite)];
        let began = Instant::now();
        let migrated = quiet.unlocked(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut migrated =
                    Err(refused.unwrap_or_else(|| internal("no pool to migrate onto".into())));
                for pool in allowed {
                    migrated = run.migrate(pool, stream, &[], &grants);
                    if !migrated.as_ref().is_err_and(|e| e.is_out_of_memory()) {
                        break;
                    }
                }
                migrated
            }))
        });
        let stalled = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // Settled even on a panic, so that nothing waits for this migration for ever.
        quiet.inflight.end(held);
        quiet.migrating.retain(|m| m.start != start);
        let pages = run.into_mapped_pages();
        quiet.totals.elsewhere_pages =
            quiet.totals.elsewhere_pages - was_elsewhere + elsewhere(&pages, self.device);
        put_back(quiet, target, pages);
        let m = migrated.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let onto_device = m.to == Location::Device(self.device);
        quiet.spill.add(m.bytes, onto_device, stalled);
        quiet.tags[ti].spill.add(m.bytes, onto_device, stalled);
        Ok(Some(m))
    }

    /// The limit's refusal of `incoming` pages of elsewhere (`bytes` of a run) moving onto
    /// `pool`, when it is the device's own pool and they do not fit under the limit.
    fn limit_refuses(
        &self,
        st: &State,
        pool: &PagePool,
        incoming: u64,
        bytes: u64,
    ) -> Option<Error> {
        let limit = st.limit?;
        let held = st.device_pages() + st.inflight.pages();
        let fits = held.saturating_add(incoming) <= limit / self.page;
        (!fits && std::ptr::eq(pool, &*self.pool)).then(|| Error::LimitExceeded {
            requested: bytes,
            used: held * self.page,
            limit,
        })
    }

    /// Gives up the cached free memory of tag index `ti`: whole free pages of its large
    /// segments, its cached runs and its small segments without a live block. Their pages are
    /// unmapped into `pages` (the first unmap error in `first_err`), their ranges freed.
    pub(super) fn drop_cached_of_tag(
        &self,
        st: &mut State,
        ti: usize,
        pages: &mut Vec<Page>,
        first_err: &mut Option<Error>,
    ) -> Result<()> {
        let t32 = ti as u32;
        self.cut_free_pages(st, None, Some(t32));
        for start in st.cache.starts_of_tag(t32) {
            if let Some(run) = st.cache.remove(start) {
                self.uncount_mapped(st, ti, &run.payload);
                self.unmap_into(st, run.payload, pages, first_err);
                self.free_va(st, start, run.pages)?;
            }
        }
        let empty: Vec<u32> = st
            .iter_segments()
            .filter(|&(id, s)| s.tag == t32 && st.segment_live(id) == 0)
            .map(|(i, _)| i)
            .collect();
        for id in empty {
            self.release_segment_now(st, id, pages, first_err)?;
        }
        Ok(())
    }
}

/// A run of a tag's pages that moves as one.
#[derive(Clone, Copy)]
pub(super) enum Target {
    Segment(u32),
    /// A large segment, by first page.
    Large(u64),
}

/// The segments of tag index `t32` with a page not already in `to`, with their first pages.
fn targets_of(st: &State, t32: u32, to: &PagePool) -> Vec<(Target, u64)> {
    let elsewhere = |m: &[MappedPage]| m.iter().any(|p| !p.page.is_home(to));
    let mut targets: Vec<(Target, u64)> = st
        .iter_segments()
        .filter(|(_, s)| s.tag == t32 && elsewhere(&s.mapped))
        .map(|(i, s)| (Target::Segment(i), s.start))
        .collect();
    targets.extend(
        st.large
            .iter()
            .filter(|(_, s)| s.tag == t32 && elsewhere(&s.mapped))
            .map(|(&start, _)| (Target::Large(start), start)),
    );
    targets
}

pub(super) fn mapped_of(st: &mut State, target: Target) -> Option<&mut Vec<MappedPage>> {
    match target {
        Target::Segment(id) => st
            .segments
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .map(|s| &mut s.mapped),
        Target::Large(start) => st.large.get_mut(&start).map(|s| &mut s.mapped),
    }
}

pub(super) fn put_back(st: &mut State, target: Target, pages: Vec<MappedPage>) {
    if let Some(slot) = mapped_of(st, target) {
        *slot = pages;
    }
}

/// Every mapped page of tag index `ti` (or of every tag): segments, large segments, cache.
pub(super) fn pages_of(st: &State, ti: Option<u32>) -> impl Iterator<Item = &Page> {
    let ours = move |tag: u32| ti.is_none_or(|t| t == tag);
    let segments = st
        .iter_segments()
        .filter(move |(_, s)| ours(s.tag))
        .flat_map(|(_, s)| s.mapped.iter());
    let large = st
        .large
        .values()
        .filter(move |s| ours(s.tag))
        .flat_map(|s| s.mapped.iter());
    let cached = (0..st.tags.len() as u32)
        .filter(move |&t| ours(t))
        .flat_map(|t| st.cache.starts_of_tag(t))
        .filter_map(|start| st.cache.get(start))
        .flat_map(|r| r.payload.iter());
    segments.chain(large).chain(cached).map(|m| &m.page)
}
