//! Sleep and wake per tag (the vLLM `CuMemAllocator` / torch_memory_saver scheme, on the arena):
//! sleep optionally copies live allocations to host buffers, unmaps the tag's pages and releases
//! them to the driver while keeping the VA; wake maps fresh pages at the same VAs and restores
//! the copies (or zeros).

use rustc_hash::FxHashMap;
use strata_vmm::{Error, Result, StreamHandle};

use super::grow::DriverCalls;
use super::{internal, BlockState, CachingAllocator, MappedPage, State, TagId, LARGE};
use crate::pool::Page;

/// What a sleeping tag keeps: host copies of its live allocations, by block id.
#[derive(Default)]
pub(super) struct SleepData {
    pub keep: bool,
    pub copies: FxHashMap<u32, Vec<u8>>,
}

impl SleepData {
    pub fn copy_bytes(&self) -> u64 {
        self.copies.values().map(|c| c.len() as u64).sum()
    }

    /// A sleeping allocation was freed: its copy goes.
    pub fn forget(&mut self, id: u32) {
        self.copies.remove(&id);
    }
}

/// Something of a sleeping tag that wake maps again.
#[derive(Clone, Copy)]
enum Target {
    Segment(u32),
    Block(u32),
}

impl CachingAllocator {
    /// Puts `tag` to sleep: waits for the streams that use its memory, copies every live
    /// allocation of the tag to host memory when `keep_host_copy` (backend copies, never CPU
    /// access to device memory), then unmaps all of the tag's pages and releases them to the
    /// driver. Cached free memory of the tag is released too. Pointers stay reserved: after
    /// [`wake`](Self::wake) they are valid again at the same addresses. While asleep,
    /// allocating under the tag is [`Error::InvalidState`]; freeing its pointers works.
    ///
    /// A failed copy leaves the tag awake and unchanged. A growth of the tag in flight (its
    /// driver calls running on another thread) is waited for first, so its pages are
    /// published before they are put to sleep with the rest.
    pub fn sleep(&self, tag: TagId, keep_host_copy: bool) -> Result<()> {
        let mut guard = self.state.lock();
        let ti = guard.ensure_tag(tag, self.classes.len());
        while guard.inflight.growing(ti as u32) {
            self.settled.wait(&mut guard);
        }
        let st = &mut *guard;
        if st.tags[ti].asleep {
            return Err(Error::InvalidState(format!("tag {tag} is already asleep")));
        }
        let t32 = ti as u32;
        self.drain_pending(st, Some(t32))?;
        let mut streams: Vec<StreamHandle> = Vec::new();
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
        self.sync_streams(st, streams)?;

        let mut copies = FxHashMap::default();
        if keep_host_copy {
            for (id, b) in st.blocks.iter().enumerate() {
                if b.tag != t32 || b.state != BlockState::Live {
                    continue;
                }
                // Host memory may run out: an error, with the tag still awake and intact.
                let mut buf = strata_vmm::try_host_vec(b.requested)?;
                self.backend.read(b.ptr, &mut buf)?;
                copies.insert(id as u32, buf);
            }
        }

        let mut pages: Vec<Page> = Vec::new();
        let mut first_err = None;
        for start in st.cache.starts_of_tag(t32) {
            if let Some(run) = st.cache.remove(start) {
                st.totals.sub_pages(run.pages);
                st.tags[ti].totals.mapped_pages -= run.pages;
                self.unmap_into(st, run.payload, &mut pages, &mut first_err);
                st.va.free(start, run.pages).map_err(internal)?;
            }
        }
        let segs: Vec<u32> = st
            .iter_segments()
            .filter(|(_, s)| s.tag == t32)
            .map(|(i, _)| i)
            .collect();
        for id in segs {
            let live = st.segments[id as usize].as_ref().map(|s| s.live);
            let mapped = match (live, st.segments[id as usize].as_mut()) {
                (Some(0), _) => {
                    self.release_segment_now(st, id, &mut pages, &mut first_err)?;
                    continue;
                }
                (_, Some(seg)) => {
                    let m = std::mem::take(&mut seg.mapped);
                    let n = seg.pages;
                    st.totals.sub_pages(n);
                    st.tags[ti].totals.mapped_pages -= n;
                    m
                }
                (_, None) => Vec::new(),
            };
            self.unmap_into(st, mapped, &mut pages, &mut first_err);
        }
        let large: Vec<usize> = (0..st.blocks.len())
            .filter(|&i| {
                let b = &st.blocks[i];
                b.tag == t32 && b.class == LARGE && b.state == BlockState::Live
            })
            .collect();
        for id in large {
            let mapped = std::mem::take(&mut st.blocks[id].pages);
            let n = mapped.len() as u64;
            st.totals.sub_pages(n);
            st.tags[ti].totals.mapped_pages -= n;
            self.unmap_into(st, mapped, &mut pages, &mut first_err);
        }
        self.pool.release(pages);
        let t = &mut st.tags[ti];
        t.asleep = true;
        t.sleep = SleepData {
            keep: keep_host_copy,
            copies,
        };
        st.totals.counts.sleeps += 1;
        first_err.map_or(Ok(()), Err)
    }

    /// Wakes `tag`: takes fresh pages (cached pages of other tags first, then the pool), maps
    /// them at the same VAs, grants access, and restores the host copies (or fills with zeros
    /// when the tag slept without them). Host copies are freed. On failure (out of memory
    /// included) the tag stays asleep with its copies, and wake can be retried.
    pub fn wake(&self, tag: TagId) -> Result<()> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let Some(ti) = st.tag_slot(tag).filter(|&i| st.tags[i].asleep) else {
            return Err(Error::InvalidState(format!("tag {tag} is not asleep")));
        };
        let t32 = ti as u32;
        // Segments emptied while asleep are dropped rather than mapped again.
        let emptied: Vec<u32> = st
            .iter_segments()
            .filter(|(_, s)| s.tag == t32 && s.live == 0)
            .map(|(i, _)| i)
            .collect();
        let mut unmapped = Vec::new();
        let mut ignored = None;
        for id in emptied {
            // Asleep: nothing mapped, only the range returns.
            self.release_segment_now(st, id, &mut unmapped, &mut ignored)?;
        }
        self.pool.release(unmapped);
        let mut targets: Vec<(Target, u64, u64)> = st
            .iter_segments()
            .filter(|(_, s)| s.tag == t32)
            .map(|(i, s)| (Target::Segment(i), s.start, s.pages))
            .collect();
        for (i, b) in st.blocks.iter().enumerate() {
            if b.tag == t32 && b.class == LARGE && b.state == BlockState::Live {
                targets.push((
                    Target::Block(i as u32),
                    self.page_of(b.ptr),
                    b.size / self.page,
                ));
            }
        }
        let total: u64 = targets.iter().map(|t| t.2).sum();
        let mut got = if total > 0 {
            self.gather_locked(st, total, total.saturating_mul(self.page))?
        } else {
            Vec::new()
        };
        let mut staged: Vec<(Target, Vec<MappedPage>)> = Vec::with_capacity(targets.len());
        let mut failure = None;
        let mut calls = DriverCalls::default();
        for &(target, start, pages) in &targets {
            let part: Vec<Page> = got.drain(..pages as usize).collect();
            match self.map_run(start, part, &mut calls) {
                Ok(m) => staged.push((target, m)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        calls.add_to(&mut st.totals.counts);
        if failure.is_none() {
            if let Err(e) = self.restore(st, ti, &targets) {
                failure = Some(e);
            }
        }
        if let Some(e) = failure {
            let mut back = got;
            let mut ignored = None;
            for (_, m) in staged {
                self.unmap_into(st, m, &mut back, &mut ignored);
            }
            self.pool.give(back);
            return Err(e);
        }
        for (target, m) in staged {
            match target {
                Target::Segment(id) => {
                    if let Some(seg) = st.segments[id as usize].as_mut() {
                        seg.mapped = m;
                    }
                }
                Target::Block(id) => st.blocks[id as usize].pages = m,
            }
        }
        st.totals.add_pages(total);
        let t = &mut st.tags[ti];
        t.totals.mapped_pages += total;
        t.asleep = false;
        t.sleep = SleepData::default();
        st.totals.counts.wakes += 1;
        Ok(())
    }

    /// True while `tag` sleeps.
    pub fn is_asleep(&self, tag: TagId) -> bool {
        let st = self.state.lock();
        st.tag_slot(tag).is_some_and(|i| st.tags[i].asleep)
    }

    /// Writes the host copies back (or zeros over every target) on the default stream.
    fn restore(&self, st: &State, ti: usize, targets: &[(Target, u64, u64)]) -> Result<()> {
        let data = &st.tags[ti].sleep;
        if data.keep {
            for (&id, buf) in &data.copies {
                if !buf.is_empty() {
                    self.backend.write(st.blocks[id as usize].ptr, buf)?;
                }
            }
            return Ok(());
        }
        for &(_, start, pages) in targets {
            self.backend.memset_async(
                StreamHandle::DEFAULT,
                self.va_of(start),
                0,
                pages * self.page,
            )?;
        }
        self.backend.stream_synchronize(StreamHandle::DEFAULT)
    }
}
