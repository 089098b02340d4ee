//! Stream ordering: frees held pending on events, cross-stream reuse through
//! `stream_wait_event`, and stream synchronization before unmapping.

use strata_vmm::{DevicePtr, Error, Event, Result, StreamHandle};

use super::Guard;
use super::{BlockState, CachingAllocator, Mode, PendingFree, State, IDLE_EVENTS, LARGE};

impl CachingAllocator {
    /// Frees that are not a plain bin push: large blocks, blocks used on other streams, and
    /// blocks of a sleeping tag or of a tag being moved (which wait for the move to end).
    #[cold]
    #[inline(never)]
    pub(super) fn free_slow(
        &self,
        guard: &mut Guard<'_>,
        ptr: DevicePtr,
        id: u32,
        stream: StreamHandle,
    ) -> Result<()> {
        let ti = guard.blocks[id as usize].tag as usize;
        if guard.tags[ti].mode == Mode::Moving {
            self.wait_while_moving(guard, ti);
            // Another free of `ptr` may have come first meanwhile.
            match guard.by_ptr.get(&ptr) {
                None => return Err(guard.unknown_pointer(ptr)),
                Some(&again)
                    if again != id || guard.blocks[id as usize].state != BlockState::Live =>
                {
                    return Err(Error::DoubleFree(ptr))
                }
                Some(_) => {}
            }
        }
        let st = &mut **guard;
        let b = &st.blocks[id as usize];
        let asleep = st.tags[b.tag as usize].asleep();
        // Where the block is reusable once free: a small block on the freeing stream's list, a
        // large one in its segment, whose stream is the one it was allocated on.
        let home = if b.class == LARGE { b.stream } else { stream };
        if asleep || (b.used_on.is_empty() && b.stream == home && stream == home) {
            // Nothing to wait for (the common large free): no event, no list.
            st.account_free(id);
            return self.free_now(st, id, home);
        }
        let mut wait: Vec<StreamHandle> = b.used_on.clone();
        wait.push(b.stream);
        wait.push(stream);
        // A sleeping block has no pages (sleep synchronized its streams): nothing to wait for.
        wait.retain(|&s| s != home && !asleep);
        wait.sort_unstable();
        wait.dedup();
        let mut events = Vec::with_capacity(wait.len());
        let mut streams = Vec::with_capacity(wait.len());
        for &s in &wait {
            match self.event_on(st, s) {
                Ok(Some(ev)) => {
                    events.push(ev);
                    streams.push(s);
                }
                Ok(None) => {}
                Err(e) => {
                    st.idle_events.append(&mut events);
                    return Err(e);
                }
            }
        }
        st.account_free(id);
        if events.is_empty() {
            return self.free_now(st, id, home);
        }
        let b = &mut st.blocks[id as usize];
        b.stream = home;
        b.used_on.clear();
        b.state = BlockState::Pending;
        st.pending.push(PendingFree {
            block: id,
            events,
            streams,
        });
        st.totals.counts.pending_frees += 1;
        Ok(())
    }

    /// A freed (accounted) block with nothing to wait for becomes reusable on `home`.
    fn free_now(&self, st: &mut State, id: u32, home: StreamHandle) -> Result<()> {
        let ti = st.blocks[id as usize].tag as usize;
        if st.tags[ti].asleep() {
            st.tags[ti].sleep.forget(id);
        }
        let b = &mut st.blocks[id as usize];
        b.stream = home;
        b.used_on.clear();
        self.recycle(st, id)
    }

    /// A freed (accounted) block becomes reusable: small ones go to their bin, large ones to
    /// their segment's free extents (see `large_path.rs`).
    pub(super) fn recycle(&self, st: &mut State, id: u32) -> Result<()> {
        let b = &mut st.blocks[id as usize];
        let (ptr, stream, ti) = (b.ptr, b.stream, b.tag);
        if b.class != LARGE {
            b.state = BlockState::Free;
            let class = b.class as usize;
            if let Some(n) = st.run_live.get_mut(b.counter as usize) {
                *n -= 1;
            }
            st.tags[ti as usize].bins[class].push(stream, id);
            return Ok(());
        }
        let len = b.size;
        b.state = BlockState::Dead;
        b.used_on = Vec::new();
        st.by_ptr.remove(&ptr);
        st.free_ids.push(id);
        st.freed.record(ptr, 1, 1);
        self.free_large(st, ptr, len)
    }

    /// Moves pending frees whose events all completed to their bins or the cache.
    pub(super) fn poll_pending(&self, st: &mut State) -> Result<()> {
        let mut i = 0;
        while i < st.pending.len() {
            let mut done = true;
            for ev in &st.pending[i].events {
                if !ev.query()? {
                    done = false;
                    break;
                }
            }
            if done {
                let p = st.pending.swap_remove(i);
                self.retire_events(st, p.events);
                self.recycle(st, p.block)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Blocks until the pending frees of tag index `ti` (all tags: `None`) complete, and
    /// recycles them.
    pub(super) fn drain_pending(&self, st: &mut State, ti: Option<u32>) -> Result<()> {
        let mut i = 0;
        while i < st.pending.len() {
            let tag = st.blocks[st.pending[i].block as usize].tag;
            if ti.is_some_and(|t| t != tag) {
                i += 1;
                continue;
            }
            for ev in &st.pending[i].events {
                ev.synchronize()?;
            }
            let p = st.pending.swap_remove(i);
            self.retire_events(st, p.events);
            self.recycle(st, p.block)?;
        }
        Ok(())
    }

    pub(super) fn retire_events(&self, st: &mut State, events: Vec<Event>) {
        for ev in events {
            if st.idle_events.len() < IDLE_EVENTS {
                st.idle_events.push(ev);
            }
        }
    }

    /// An event recorded on `stream` now; `None` when the stream no longer exists (destroying
    /// a stream waits for its work, so nothing is left to order after).
    pub(super) fn event_on(&self, st: &mut State, stream: StreamHandle) -> Result<Option<Event>> {
        let ev = match st.idle_events.pop() {
            Some(ev) => ev,
            None => Event::new(&self.backend)?,
        };
        match ev.record(stream) {
            Ok(()) => Ok(Some(ev)),
            Err(Error::InvalidHandle { kind: "stream", .. }) => {
                st.idle_events.push(ev);
                Ok(None)
            }
            Err(e) => {
                st.idle_events.push(ev);
                Err(e)
            }
        }
    }

    /// Orders future work on `to` after the work queued on `from` so far, without blocking.
    pub(super) fn order_after(
        &self,
        st: &mut State,
        from: StreamHandle,
        to: StreamHandle,
    ) -> Result<()> {
        if from == to {
            return Ok(());
        }
        let Some(ev) = self.event_on(st, from)? else {
            return Ok(());
        };
        let r = self.backend.stream_wait_event(to, ev.handle());
        st.idle_events.push(ev);
        r?;
        st.totals.counts.stream_waits += 1;
        Ok(())
    }

    /// Blocks until every stream in `streams` is idle (before unmapping what they may touch).
    pub(super) fn sync_streams(
        &self,
        st: &mut State,
        mut streams: Vec<StreamHandle>,
    ) -> Result<()> {
        streams.sort_unstable();
        streams.dedup();
        st.totals.counts.stream_syncs += streams.len() as u64;
        self.sync_unlocked(&streams)
    }

    /// Blocks until every stream in `streams` is idle; needs no lock. A stream that no longer
    /// exists has nothing left to wait for.
    pub(super) fn sync_unlocked(&self, streams: &[StreamHandle]) -> Result<()> {
        for &s in streams {
            match self.backend.stream_synchronize(s) {
                Ok(()) | Err(Error::InvalidHandle { kind: "stream", .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The streams that may touch tag index `t32`'s memory: those its blocks were allocated,
/// freed or used on, and those of its cached runs and large segments.
pub(super) fn streams_of_tag(st: &State, t32: u32) -> Vec<StreamHandle> {
    let mut streams = Vec::new();
    for b in st
        .blocks
        .iter()
        .filter(|b| b.tag == t32 && b.state != BlockState::Dead)
    {
        streams.push(b.stream);
        streams.extend(b.used_on.iter().copied());
    }
    for start in st.cache.starts_of_tag(t32) {
        streams.extend(st.cache.get(start).map(|r| r.stream));
    }
    streams.extend(st.large.values().filter(|s| s.tag == t32).map(|s| s.stream));
    streams
}
