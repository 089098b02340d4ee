//! Revocation of borrowed pages behind live allocations: a lender (a peer device whose pool a
//! tag overflowed onto) takes its pages back. Every segment on its pages moves to the device's
//! own pages if there is room, else to host memory, at the same addresses
//! ([`MappedRun::migrate`](crate::mapped::MappedRun::migrate)); the lender's pages go back to its pool as each segment moves. Each
//! move is one [`Revoked`] notice, handed out once by [`CachingAllocator::take_revoked`].

use std::sync::Arc;

use strata_vmm::{DevicePtr, Location, Result, StreamHandle};

use super::offload::{pages_of, Target};
use super::quiet::Quiet;
use super::{CachingAllocator, State, TagId};
use crate::pool::PagePool;

/// One segment moved off a lender's pages by [`CachingAllocator::revoke`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Revoked {
    pub tag: TagId,
    /// First byte of the segment (unchanged).
    pub va: DevicePtr,
    pub bytes: u64,
    /// The lender's memory it was on.
    pub from: Location,
    /// Where it is now: this device or host memory.
    pub to: Location,
}

impl CachingAllocator {
    /// Gives every page of `lender` back: tags stop overflowing onto it, their cached free
    /// memory goes, and each segment with a page of `lender` moves to this device's pages,
    /// or to `fallback`'s (host memory) when the device is out of memory or at the limit
    /// ([`CachingConfig::limit`](super::CachingConfig::limit)), at the same
    /// addresses, copies ordered on `stream` after the streams that used the tag's memory.
    /// Data and addresses never change. Returns how many segments moved; what moved where is
    /// queued for [`take_revoked`](Self::take_revoked).
    ///
    /// A failure other than out of memory on both tiers (or on the way to `fallback`) leaves
    /// the segment on the lender's pages, intact, and returns the error: those moved before
    /// it are queued, and calling again moves the rest.
    pub fn revoke(
        &self,
        lender: &PagePool,
        fallback: &Arc<PagePool>,
        stream: StreamHandle,
    ) -> Result<usize> {
        let mut quiet = Quiet::new(self);
        // Growth in flight may be taking the lender's pages; a move may hold some.
        quiet.wait_for_all();
        for t in &mut quiet.tags {
            if t.overflow
                .as_deref()
                .is_some_and(|p| std::ptr::eq(p, lender))
            {
                t.overflow = None;
            }
        }
        let affected: Vec<usize> = (0..quiet.tags.len())
            .filter(|&ti| pages_of(&quiet, Some(ti as u32)).any(|p| p.is_home(lender)))
            .collect();
        for ti in affected {
            quiet.claim_now(ti);
        }
        self.quiesce(&mut quiet)?;
        self.drop_cached_of_claimed(&mut quiet)?;
        let mut moved = 0;
        for (target, start, ti) in lent_targets(&quiet, lender) {
            let pools = [&self.pool, fallback];
            let Some(m) = self.migrate_target(&mut quiet, target, start, ti, &pools, stream)?
            else {
                continue;
            };
            let tag = quiet.tags[ti].tag;
            quiet.revoked.push(Revoked {
                tag,
                va: m.va,
                bytes: m.bytes,
                from: m.from,
                to: m.to,
            });
            moved += 1;
        }
        Ok(moved)
    }

    /// The revocation notices not yet taken, oldest first; each is handed out once.
    pub fn take_revoked(&self) -> Vec<Revoked> {
        std::mem::take(&mut self.state.lock().revoked)
    }
}

/// Segments with a page of `lender`: (target, first page, tag index).
fn lent_targets(st: &State, lender: &PagePool) -> Vec<(Target, u64, usize)> {
    let lent = |m: &[super::MappedPage]| m.iter().any(|p| p.page.is_home(lender));
    let mut targets: Vec<(Target, u64, usize)> = st
        .iter_segments()
        .filter(|(_, s)| lent(&s.mapped))
        .map(|(i, s)| (Target::Segment(i), s.start, s.tag as usize))
        .collect();
    targets.extend(
        st.large
            .iter()
            .filter(|(_, s)| lent(&s.mapped))
            .map(|(&start, s)| (Target::Large(start), start, s.tag as usize)),
    );
    targets
}
