//! Tags: every allocation carries one; sleep, wake, offload and overflow act on a tag's pages.
//! Per-tag state, the table from tag ids to it, and retiring an id for its next name.

use std::sync::Arc;

use super::{offload, sleep, stats, CachingAllocator, ClassBin, State, TagId, UNTAGGED};
use crate::pool::PagePool;

/// What a tag is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Its allocations and frees take the fast path.
    Awake,
    /// Its pages are released, its VA kept (`sleep.rs`).
    Asleep,
    /// Claimed by a move of its pages or a sleep that runs with the lock dropped
    /// ([`Quiet`](super::quiet::Quiet)): its allocations and frees wait until it ends.
    Moving,
}

/// One tag's bins, mode and counters.
pub(super) struct TagState {
    pub(super) tag: TagId,
    pub(super) bins: Vec<ClassBin>,
    pub(super) mode: Mode,
    pub(super) sleep: sleep::SleepData,
    pub(super) totals: stats::TagTotals,
    pub(super) spill: offload::SpillCounts,
    /// Where growth takes pages when the device is out of memory (`offload.rs`).
    pub(super) overflow: Option<Arc<PagePool>>,
}

impl TagState {
    pub(super) fn asleep(&self) -> bool {
        self.mode == Mode::Asleep
    }

    pub(super) fn new(tag: TagId, classes: usize) -> Self {
        TagState {
            tag,
            bins: vec![ClassBin::default(); classes],
            mode: Mode::Awake,
            sleep: sleep::SleepData::default(),
            totals: stats::TagTotals::default(),
            spill: offload::SpillCounts::default(),
            overflow: None,
        }
    }
}

impl State {
    /// Index of a tag already seen (tag 0 always is).
    #[inline]
    pub(super) fn tag_slot(&self, tag: TagId) -> Option<usize> {
        if tag == UNTAGGED {
            Some(0)
        } else {
            self.tag_ix.get(&tag).map(|&i| i as usize)
        }
    }

    pub(super) fn ensure_tag(&mut self, tag: TagId, classes: usize) -> usize {
        if let Some(i) = self.tag_slot(tag) {
            return i;
        }
        let i = self.tags.len();
        self.tags.push(TagState::new(tag, classes));
        self.tag_ix.insert(tag, i as u32);
        i
    }

    pub(super) fn tag_is_idle(&self, ti: usize) -> bool {
        let t = &self.tags[ti];
        t.mode == Mode::Awake && t.totals.live == 0 && !self.inflight.growing(ti as u32)
    }
}

impl CachingAllocator {
    /// Lets the caller reuse `tag`'s id for another name: succeeds only while nothing of it is
    /// live, asleep or growing, and then restarts the tag as its next name finds it: its
    /// counters and migration counts from zero, no overflow. Its cached pages stay (blocks of
    /// one id never share a page with another id, whoever names it); the allocator's totals
    /// keep everything.
    pub fn retire_tag(&self, tag: TagId) -> bool {
        let mut st = self.state.lock();
        st.absorb_caches();
        let Some(ti) = st.tag_slot(tag) else {
            return true;
        };
        if !st.tag_is_idle(ti) {
            return false;
        }
        let t = &mut st.tags[ti];
        t.totals.allocs = 0;
        t.totals.frees = 0;
        t.totals.allocated.reset_peak();
        t.spill = offload::SpillCounts::default();
        t.overflow = None;
        true
    }

    /// True when nothing of `tag` is live, asleep, moving or growing (see
    /// [`Self::retire_tag`]).
    pub fn tag_is_idle(&self, tag: TagId) -> bool {
        let mut st = self.state.lock();
        st.absorb_caches();
        st.tag_slot(tag).is_none_or(|ti| st.tag_is_idle(ti))
    }
}
