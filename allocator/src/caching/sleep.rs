//! Sleep and wake per tag (the vLLM `CuMemAllocator` / torch_memory_saver scheme, on the arena):
//! sleep optionally copies live allocations to host buffers, unmaps the tag's pages and releases
//! them to the driver while keeping the VA; wake maps fresh pages at the same VAs and restores
//! the copies (or zeros). [`CachingAllocator::sleep_to_disk`] keeps the copies in a file instead
//! (torch_memory_saver's disk backup): device → host chunks → file on the way down, file → host
//! chunks → device on the way up, each direction pipelined through a second thread.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use rustc_hash::FxHashMap;
use strata_vmm::{DevicePtr, Error, Result, StreamHandle};

use super::quiet::Quiet;
use super::stats::DriverCalls;
use super::{BlockState, CachingAllocator, MappedPage, Mode, State, TagId};
use crate::pool::Page;

/// Bytes moved per step of the disk pipelines (and the host memory each of its buffers holds).
const DISK_CHUNK: usize = 8 << 20;

/// What a sleeping tag keeps: host copies of its live allocations, by block id, or a file.
#[derive(Default)]
pub(super) struct SleepData {
    pub keep: bool,
    pub copies: FxHashMap<u32, Vec<u8>>,
    pub disk: Option<DiskCopy>,
}

/// Copies of a sleeping tag's live allocations in an unlinked file: block id → (offset, length).
pub(super) struct DiskCopy {
    file: File,
    blocks: FxHashMap<u32, (u64, u64)>,
}

impl SleepData {
    pub fn copy_bytes(&self) -> u64 {
        self.copies.values().map(|c| c.len() as u64).sum()
    }

    /// Bytes of the disk copies.
    pub fn disk_bytes(&self) -> u64 {
        self.disk
            .as_ref()
            .map_or(0, |d| d.blocks.values().map(|&(_, len)| len).sum())
    }

    /// A sleeping allocation was freed: its copy goes.
    pub fn forget(&mut self, id: u32) {
        self.copies.remove(&id);
        if let Some(d) = &mut self.disk {
            d.blocks.remove(&id);
        }
    }
}

/// Where [`CachingAllocator::sleep`] keeps a tag's contents.
#[derive(Clone, Copy, Debug)]
enum Keep<'a> {
    Nothing,
    Host,
    Disk(&'a Path),
}

fn io(call: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Os { call, source }
}

/// An unlinked file in `dir` (gone from the directory at once; its space returns on close).
fn anonymous_file(dir: &Path) -> Result<File> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("strata-sleep-{}-{n}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(io("open sleep file"))?;
    std::fs::remove_file(&path).map_err(io("unlink sleep file"))?;
    Ok(file)
}

/// Runs `produce` on the calling thread and `consume` on a second one, handing filled chunks
/// over a two-deep channel and the emptied buffers back (at most three chunks exist): the two
/// sides overlap. The first error of either side is returned.
fn pipeline(
    produce: impl FnOnce(&SyncSender<(u64, Vec<u8>)>, &Receiver<Vec<u8>>) -> Result<()>,
    consume: impl FnOnce(Receiver<(u64, Vec<u8>)>, SyncSender<Vec<u8>>) -> Result<()> + Send,
) -> Result<()> {
    let (full_tx, full_rx) = sync_channel(2);
    let (empty_tx, empty_rx) = sync_channel(3);
    std::thread::scope(|scope| {
        let consumer = scope.spawn(move || consume(full_rx, empty_tx));
        let produced = produce(&full_tx, &empty_rx);
        drop(full_tx);
        let consumed = consumer
            .join()
            .unwrap_or_else(|_| Err(Error::InvalidState("sleep pipeline thread panicked".into())));
        produced.and(consumed)
    })
}

/// A chunk buffer: a returned one, else a new one while fewer than three exist.
fn buffer(returned: &Receiver<Vec<u8>>, made: &mut usize) -> Vec<u8> {
    if let Ok(b) = returned.try_recv() {
        return b;
    }
    if *made < 3 {
        *made += 1;
        return vec![0u8; DISK_CHUNK];
    }
    returned.recv().unwrap_or_else(|_| vec![0u8; DISK_CHUNK])
}

/// Something of a sleeping tag that wake maps again.
#[derive(Clone, Copy)]
enum Target {
    Segment(u32),
    /// A large segment, by first page.
    Large(u64),
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
    /// driver calls running on another thread) or a move of its pages is waited for first,
    /// so its pages are published before they are put to sleep with the rest. The waits for
    /// its streams and the copies run with the allocator's lock dropped; the tag's own
    /// allocations and frees wait for the sleep meanwhile.
    pub fn sleep(&self, tag: TagId, keep_host_copy: bool) -> Result<()> {
        let keep = if keep_host_copy {
            Keep::Host
        } else {
            Keep::Nothing
        };
        self.sleep_keeping(tag, keep)
    }

    /// [`sleep`](Self::sleep) keeping the copies in an unlinked file in `dir` rather than in
    /// host memory (host memory holds at most three 8 MiB chunks while the copies move, device
    /// reads overlapping file writes); [`wake`](Self::wake) reads them back, file reads
    /// overlapping device writes. A failed copy (disk full included) leaves the tag awake.
    pub fn sleep_to_disk(&self, tag: TagId, dir: &Path) -> Result<()> {
        self.sleep_keeping(tag, Keep::Disk(dir))
    }

    fn sleep_keeping(&self, tag: TagId, keep: Keep<'_>) -> Result<()> {
        let mut quiet = Quiet::new(self);
        let ti = quiet.ensure_tag(tag, self.classes.len());
        quiet.claim(ti);
        if quiet.tags[ti].asleep() {
            return Err(Error::InvalidState(format!("tag {tag} is already asleep")));
        }
        self.quiesce(&mut quiet)?;
        let t32 = ti as u32;
        let live: Vec<(u32, DevicePtr, u64)> = quiet
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.tag == t32 && b.state == BlockState::Live)
            .map(|(id, b)| (id as u32, b.ptr, b.requested))
            .collect();
        // The tag is claimed: nothing else touches its blocks while they are copied.
        let kept = quiet.unlocked(|| self.copy_live(&live, keep))?;

        let st: &mut State = &mut quiet;
        let mut pages: Vec<Page> = Vec::new();
        let mut first_err = None;
        self.drop_cached_of_tag(st, ti, &mut pages, &mut first_err)?;
        let segs: Vec<u32> = st
            .iter_segments()
            .filter(|(_, s)| s.tag == t32)
            .map(|(i, _)| i)
            .collect();
        for id in segs {
            let live = st.segments[id as usize]
                .as_ref()
                .map(|_| st.segment_live(id));
            let mapped = match (live, st.segments[id as usize].as_mut()) {
                (Some(0), _) => {
                    self.release_segment_now(st, id, &mut pages, &mut first_err)?;
                    continue;
                }
                (_, Some(seg)) => {
                    let m = std::mem::take(&mut seg.mapped);
                    self.uncount_mapped(st, ti, &m);
                    m
                }
                (_, None) => Vec::new(),
            };
            self.unmap_into(st, mapped, &mut pages, &mut first_err);
        }
        let large: Vec<u64> = st
            .large
            .iter()
            .filter(|(_, s)| s.tag == t32)
            .map(|(&start, _)| start)
            .collect();
        for start in large {
            let Some(seg) = st.large.get_mut(&start) else {
                continue;
            };
            let mapped = std::mem::take(&mut seg.mapped);
            self.uncount_mapped(st, ti, &mapped);
            self.unmap_into(st, mapped, &mut pages, &mut first_err);
        }
        self.pool.release(pages);
        let t = &mut st.tags[ti];
        t.mode = Mode::Asleep;
        t.sleep = kept;
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
        let Some(ti) = st.tag_slot(tag).filter(|&i| st.tags[i].asleep()) else {
            return Err(Error::InvalidState(format!("tag {tag} is not asleep")));
        };
        let t32 = ti as u32;
        // Segments emptied while asleep are dropped rather than mapped again.
        let emptied: Vec<u32> = st
            .iter_segments()
            .filter(|&(id, s)| s.tag == t32 && st.segment_live(id) == 0)
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
        for (&start, seg) in &st.large {
            if seg.tag == t32 {
                targets.push((Target::Large(start), start, seg.pages));
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
            self.count_mapped(st, ti, &m);
            match target {
                Target::Segment(id) => {
                    if let Some(seg) = st.segments[id as usize].as_mut() {
                        seg.mapped = m;
                    }
                }
                Target::Large(start) => {
                    if let Some(seg) = st.large.get_mut(&start) {
                        seg.mapped = m;
                    }
                }
            }
        }
        let t = &mut st.tags[ti];
        t.mode = Mode::Awake;
        t.sleep = SleepData::default();
        st.totals.counts.wakes += 1;
        Ok(())
    }

    /// True while `tag` sleeps.
    pub fn is_asleep(&self, tag: TagId) -> bool {
        let st = self.state.lock();
        st.tag_slot(tag).is_some_and(|i| st.tags[i].asleep())
    }

    /// Writes the host copies back (or zeros over every target) on the default stream.
    fn restore(&self, st: &State, ti: usize, targets: &[(Target, u64, u64)]) -> Result<()> {
        let data = &st.tags[ti].sleep;
        if let Some(disk) = &data.disk {
            return self.copy_from_disk(st, disk);
        }
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

    /// What a tag keeps asleep: copies of its `live` allocations (id, pointer, bytes) where
    /// `keep` says, in host memory (which may run out: an error) or in a file.
    fn copy_live(&self, live: &[(u32, DevicePtr, u64)], keep: Keep<'_>) -> Result<SleepData> {
        let mut kept = SleepData {
            keep: !matches!(keep, Keep::Nothing),
            ..SleepData::default()
        };
        match keep {
            Keep::Nothing => {}
            Keep::Host => {
                for &(id, ptr, requested) in live {
                    let mut buf = strata_vmm::try_host_vec(requested)?;
                    self.backend.read(ptr, &mut buf)?;
                    kept.copies.insert(id, buf);
                }
            }
            Keep::Disk(dir) => kept.disk = Some(self.copy_to_disk(live, dir)?),
        }
        Ok(kept)
    }

    /// Copies the `live` allocations (id, pointer, bytes) into a new unlinked file in `dir`:
    /// device reads on this thread, file writes on a second one.
    fn copy_to_disk(&self, live: &[(u32, DevicePtr, u64)], dir: &Path) -> Result<DiskCopy> {
        let file = anonymous_file(dir)?;
        let mut blocks = FxHashMap::default();
        let mut offset = 0u64;
        for &(id, _, len) in live {
            blocks.insert(id, (offset, len));
            offset = offset
                .checked_add(len)
                .ok_or(Error::Overflow("sleep file size"))?;
        }
        let writer = &file;
        pipeline(
            |full, returned| {
                let mut made = 0;
                for &(id, ptr, len) in live {
                    let base = blocks[&id].0;
                    let mut done = 0u64;
                    while done < len {
                        let n = (len - done).min(DISK_CHUNK as u64) as usize;
                        let mut buf = buffer(returned, &mut made);
                        self.backend.read(ptr + done, &mut buf[..n])?;
                        buf.truncate(n);
                        if full.send((base + done, buf)).is_err() {
                            return Ok(()); // the writer failed: its error is returned
                        }
                        done += n as u64;
                    }
                }
                Ok(())
            },
            |full, returned| {
                for (at, mut buf) in full {
                    writer
                        .write_all_at(&buf, at)
                        .map_err(io("write sleep file"))?;
                    buf.resize(DISK_CHUNK, 0);
                    let _ = returned.send(buf);
                }
                Ok(())
            },
        )?;
        Ok(DiskCopy { file, blocks })
    }

    /// Writes the disk copies back to their allocations: file reads on this thread, device
    /// writes on a second one.
    fn copy_from_disk(&self, st: &State, disk: &DiskCopy) -> Result<()> {
        let targets: Vec<(DevicePtr, u64, u64)> = disk
            .blocks
            .iter()
            .map(|(&id, &(offset, len))| (st.blocks[id as usize].ptr, offset, len))
            .collect();
        let reader = &disk.file;
        pipeline(
            |full, returned| {
                let mut made = 0;
                for &(ptr, offset, len) in &targets {
                    let mut done = 0u64;
                    while done < len {
                        let n = (len - done).min(DISK_CHUNK as u64) as usize;
                        let mut buf = buffer(returned, &mut made);
                        buf.truncate(n);
                        reader
                            .read_exact_at(&mut buf, offset + done)
                            .map_err(io("read sleep file"))?;
                        if full.send((ptr + done, buf)).is_err() {
                            return Ok(()); // the device side failed: its error is returned
                        }
                        done += n as u64;
                    }
                }
                Ok(())
            },
            |full, returned| {
                for (dst, mut buf) in full {
                    self.backend.write(dst, &buf)?;
                    buf.resize(DISK_CHUNK, 0);
                    let _ = returned.send(buf);
                }
                Ok(())
            },
        )
    }
}
