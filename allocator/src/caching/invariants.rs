//! The invariant checker: run after every step of the property tests (talc's `scan_for_errors`).

use rustc_hash::FxHashMap;

use super::supply::elsewhere;
use super::{
    run_slot, BlockState, CachingAllocator, Mode, State, CHUNKS_PER_PAGE, LARGE, LARGE_ALIGN,
    NO_SEGMENT,
};
use super::{stats, tcache};

impl CachingAllocator {
    /// Checks every structural invariant and returns the first violation:
    ///
    /// - the arena's free VA ranges, small segments, large blocks, cached runs and the ranges
    ///   of in-flight growth and shrinking tile the arena exactly (no overlap; live + cached +
    ///   in flight + free = arena), and the in-flight records' pages add up to their total;
    /// - every large segment is tiled exactly by its blocks (live or pending, of its tag and
    ///   stream, 512-byte aligned) and its free extents (filed under its tag and stream, merged
    ///   with free neighbours), and is never wholly free; every extent lies in a segment;
    /// - every mapping lies in the arena at its page's address, one page each, and a sleeping
    ///   tag has nothing mapped while an awake one has everything mapped (but the segments a
    ///   migration of a claimed tag holds the pages of, with the lock dropped);
    /// - the pointer table, the bins and the pending list agree with the block table;
    /// - each small block's run count slot is its run's, every run's count is the number of its
    ///   blocks out of bins (live or pending), and slots where no run starts hold 0;
    /// - every block a thread cache holds is cached (`BlockState::Cached`) under that cache's
    ///   slot, of an awake tag, with its size, tag and class; a free one sits in exactly one
    ///   magazine of its tag, class and stream, within the bounds; every cached block is in its
    ///   cache;
    /// - allocated, live and mapped-page figures (total and per tag, and the pages not of the
    ///   device's own memory) agree with the tables (the caches' live blocks and not yet
    ///   folded counts included), and pages held = reserved bytes / page size.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = self.state.lock();
        self.check_state(&st)
    }

    fn check_state(&self, st: &State) -> Result<(), String> {
        let caches = st.lock_caches();
        st.va.check()?;
        st.cache.check()?;
        st.extents.check()?;
        self.check_large(st)?;
        let page = self.page;

        // 1. Tiling of the arena, in pages.
        let mut regions: Vec<(u64, u64, String)> = st
            .va
            .ranges()
            .map(|(s, l)| (s, l, "free VA".to_string()))
            .collect();
        for (id, seg) in st.iter_segments() {
            regions.push((seg.start, seg.pages, format!("segment {id}")));
        }
        for (&s, seg) in &st.large {
            regions.push((s, seg.pages, format!("large segment at page {s}")));
        }
        for (s, r) in st.cache.iter() {
            regions.push((s, r.pages, format!("cached run at page {s}")));
        }
        for &s in &st.stuck_pages {
            regions.push((s, 1, format!("stuck page {s} (failed unmap)")));
        }
        let mut inflight_pages = 0u64;
        for record in st.inflight.iter() {
            for &(s, l) in record.target.iter().chain(&record.retiring) {
                regions.push((s, l, format!("in-flight range at page {s}")));
            }
            inflight_pages += record.pages;
        }
        if inflight_pages != st.inflight.pages() {
            return Err(format!(
                "in-flight records hold {inflight_pages} pages, their total says {}",
                st.inflight.pages()
            ));
        }
        regions.sort_by_key(|r| r.0);
        let mut at = 0u64;
        for (s, l, what) in &regions {
            if *s != at {
                return Err(if *s < at {
                    format!("{what} ({s}+{l}) overlaps the previous region ending at page {at}")
                } else {
                    format!("pages {at}..{s} belong to nothing (next: {what})")
                });
            }
            at = s + l;
        }
        if at != self.arena_pages {
            return Err(format!(
                "regions end at page {at}, arena has {}",
                self.arena_pages
            ));
        }

        // 2. Mappings.
        let mut mapped_total = 0u64;
        let mut elsewhere_total = 0u64;
        let mut migrating = 0usize;
        let mut mapped_by_tag: FxHashMap<u32, u64> = FxHashMap::default();
        let mut check_run = |start: u64,
                             pages: u64,
                             run: &[super::MappedPage],
                             tag: u32,
                             what: &str|
         -> Result<(), String> {
            let asleep = st.tags[tag as usize].asleep();
            if run.is_empty() && !asleep && pages > 0 {
                // Its pages may be out for a migration, with the lock dropped.
                let out = st.migrating.iter().find(|m| m.start == start).filter(|m| {
                    m.tag == tag && m.pages == pages && st.tags[tag as usize].mode == Mode::Moving
                });
                let Some(out) = out else {
                    return Err(format!("{what}: awake tag but nothing mapped"));
                };
                migrating += 1;
                mapped_total += out.pages;
                elsewhere_total += out.elsewhere;
                *mapped_by_tag.entry(tag).or_default() += out.pages;
                return Ok(());
            }
            if !run.is_empty() && asleep {
                return Err(format!("{what}: sleeping tag but pages mapped"));
            }
            if !run.is_empty() && run.len() as u64 != pages {
                return Err(format!("{what}: {} pages mapped of {pages}", run.len()));
            }
            for (i, mp) in run.iter().enumerate() {
                let va = self.va_of(start + i as u64);
                if mp.mapping.va() != va || mp.mapping.size() != page || mp.page.size() != page {
                    return Err(format!(
                        "{what}: page {i} mapped at {:#x}+{:#x}, expected {va:#x}+{page:#x}",
                        mp.mapping.va(),
                        mp.mapping.size()
                    ));
                }
                if !self.arena.contains(mp.mapping.va(), mp.mapping.size()) {
                    return Err(format!("{what}: mapping outside the arena"));
                }
                if !std::sync::Arc::ptr_eq(mp.mapping.phys(), mp.page.phys()) {
                    return Err(format!("{what}: page {i} maps another page's memory"));
                }
            }
            mapped_total += run.len() as u64;
            elsewhere_total += elsewhere(run, self.device);
            *mapped_by_tag.entry(tag).or_default() += run.len() as u64;
            Ok(())
        };
        for (id, seg) in st.iter_segments() {
            check_run(
                seg.start,
                seg.pages,
                &seg.mapped,
                seg.tag,
                &format!("segment {id}"),
            )?;
        }
        for (&s, seg) in &st.large {
            check_run(
                s,
                seg.pages,
                &seg.mapped,
                seg.tag,
                &format!("large segment at page {s}"),
            )?;
        }
        for (s, r) in st.cache.iter() {
            if st.tags[r.tag as usize].asleep() {
                return Err(format!("cached run at page {s} belongs to a sleeping tag"));
            }
            check_run(
                s,
                r.pages,
                &r.payload,
                r.tag,
                &format!("cached run at page {s}"),
            )?;
        }
        if migrating != st.migrating.len() {
            return Err(format!(
                "{} runs out for migration, {migrating} segments wait for them",
                st.migrating.len()
            ));
        }
        if mapped_total != st.totals.mapped_pages {
            return Err(format!(
                "{mapped_total} pages mapped, stats say {}",
                st.totals.mapped_pages
            ));
        }
        if elsewhere_total != st.totals.elsewhere_pages {
            return Err(format!(
                "{elsewhere_total} pages mapped of elsewhere than the device, stats say {}",
                st.totals.elsewhere_pages
            ));
        }
        for (i, t) in st.tags.iter().enumerate() {
            let m = mapped_by_tag.get(&(i as u32)).copied().unwrap_or(0);
            if m != t.totals.mapped_pages {
                return Err(format!(
                    "tag {}: {m} pages mapped, stats say {}",
                    t.tag, t.totals.mapped_pages
                ));
            }
        }
        if st.totals.peak_mapped_pages < st.totals.mapped_pages {
            return Err("peak reserved below reserved".into());
        }

        // 3. Block tables.
        for (&ptr, &id) in &st.by_ptr {
            let b = st
                .blocks
                .get(id as usize)
                .ok_or_else(|| format!("pointer {ptr:#x} maps to missing block {id}"))?;
            if b.ptr != ptr || b.state == BlockState::Dead {
                return Err(format!(
                    "pointer {ptr:#x} maps to block {id} at {:#x} ({:?})",
                    b.ptr, b.state
                ));
            }
        }
        let mut in_bins: FxHashMap<u32, u32> = FxHashMap::default();
        for (ti, t) in st.tags.iter().enumerate() {
            if t.bins.len() != self.classes.len() {
                return Err(format!("tag {} has {} bins", t.tag, t.bins.len()));
            }
            for (class, bin) in t.bins.iter().enumerate() {
                for (stream, id) in bin.iter() {
                    let b = st
                        .blocks
                        .get(id as usize)
                        .ok_or_else(|| format!("bin holds missing block {id}"))?;
                    if b.state != BlockState::Free
                        || b.tag as usize != ti
                        || b.class as usize != class
                        || b.stream != stream
                    {
                        return Err(format!("bin (tag {}, class {class}, stream {stream:?}) holds block {id} in state {:?}", t.tag, b.state));
                    }
                    *in_bins.entry(id).or_default() += 1;
                }
            }
        }
        let pending: rustc_hash::FxHashSet<u32> = st.pending.iter().map(|p| p.block).collect();
        if pending.len() != st.pending.len() {
            return Err("a block is pending twice".into());
        }
        let mut run_live: FxHashMap<u32, u32> = FxHashMap::default();
        let mut allocated = 0u64;
        let mut blocks_bytes = 0u64;
        let mut live = 0u64;
        let mut by_tag: FxHashMap<u32, (u64, u64, u64)> = FxHashMap::default();
        let mut alive = 0usize;
        let mut cached: FxHashMap<u32, (u32, tcache::Held)> = FxHashMap::default();
        for (slot, h) in tcache::cached_blocks(&caches)? {
            if cached.insert(h.id, (slot, h)).is_some() {
                return Err(format!("block {} is in two thread caches", h.id));
            }
        }
        for (id, b) in st.blocks.iter().enumerate() {
            let id = id as u32;
            if b.state == BlockState::Dead {
                continue;
            }
            // Requested bytes of a live block (one a thread cache handed out included).
            let mut held_live = (b.state == BlockState::Live).then_some(b.requested);
            if let BlockState::Cached(slot) = b.state {
                let Some((s, h)) = cached.remove(&id) else {
                    return Err(format!("block {id} is cached by {slot}, which lacks it"));
                };
                if s != slot
                    || (h.size, h.ti, h.class) != (b.size, b.tag, b.class)
                    || st.tags[b.tag as usize].mode != Mode::Awake
                    || h.tag != st.tags[b.tag as usize].tag
                {
                    return Err(format!("block {id} disagrees with its thread cache {s}"));
                }
                if h.live {
                    held_live = Some(h.requested);
                }
            }
            alive += 1;
            if st.by_ptr.get(&b.ptr) != Some(&id) {
                return Err(format!(
                    "block {id} at {:#x} missing from the pointer table",
                    b.ptr
                ));
            }
            if b.ptr % super::MIN_ALIGN != 0 {
                return Err(format!("block {id} at {:#x} misaligned", b.ptr));
            }
            let bins = in_bins.get(&id).copied().unwrap_or(0);
            match b.state {
                BlockState::Free if bins != 1 => {
                    return Err(format!("free block {id} is in {bins} bins"))
                }
                BlockState::Free if b.class == LARGE => {
                    return Err(format!("large block {id} is free in the table"))
                }
                BlockState::Live | BlockState::Pending if bins != 0 => {
                    return Err(format!("block {id} ({:?}) is in a bin", b.state))
                }
                _ => {}
            }
            if (b.state == BlockState::Pending) != pending.contains(&id) {
                return Err(format!(
                    "block {id} ({:?}) and the pending list disagree",
                    b.state
                ));
            }
            if b.class != LARGE {
                let seg = st
                    .segments
                    .get(b.segment as usize)
                    .and_then(Option::as_ref)
                    .ok_or_else(|| format!("small block {id} has no segment"))?;
                let (lo, hi) = (self.va_of(seg.start), self.va_of(seg.start + seg.pages));
                if b.segment == NO_SEGMENT
                    || b.ptr < lo
                    || b.ptr + b.size > hi
                    || b.size != self.classes.size(b.class as usize)
                {
                    return Err(format!("small block {id} does not fit its segment"));
                }
                let off = b.ptr - lo;
                let run = seg
                    .runs
                    .iter()
                    .find(|r| r.offset <= off && off + b.size <= r.offset + r.len);
                if b.tag != seg.tag
                    || run.is_none_or(|r| {
                        r.class != b.class
                            || (off - r.offset) % b.size != 0
                            || run_slot(b.segment, self.run_of(seg, r.offset)) != b.counter
                    })
                {
                    return Err(format!(
                        "small block {id} disagrees with its segment's tag or runs"
                    ));
                }
                if b.state != BlockState::Free {
                    *run_live.entry(b.counter).or_default() += 1;
                }
            }
            if let Some(requested) = held_live {
                allocated += requested;
                blocks_bytes += b.size;
                live += 1;
                let e = by_tag.entry(b.tag).or_default();
                e.0 += requested;
                e.1 += b.size;
                e.2 += 1;
                if requested == 0 || requested > b.size {
                    return Err(format!(
                        "block {id}: {requested} bytes requested in {}",
                        b.size
                    ));
                }
            }
        }
        if let Some(id) = cached.keys().next() {
            return Err(format!(
                "a thread cache holds block {id}, not cached in the table"
            ));
        }
        if alive != st.by_ptr.len() {
            return Err(format!("{alive} blocks, {} pointers", st.by_ptr.len()));
        }
        if st.run_live.len() != st.segments.len() * CHUNKS_PER_PAGE as usize {
            return Err(format!(
                "{} run counts for {} segments",
                st.run_live.len(),
                st.segments.len()
            ));
        }
        // Run counts checked against a run's blocks; every other slot must hold 0.
        let mut at_runs = vec![false; st.run_live.len()];
        for (id, seg) in st.iter_segments() {
            let mut at = 0u64;
            for r in &seg.runs {
                let class_bytes = self.classes.size(r.class as usize);
                if r.offset < at
                    || r.offset + r.len > seg.pages * page
                    || r.offset % super::MIN_ALIGN != 0
                    || r.len < class_bytes
                {
                    return Err(format!("segment {id}: run {r:?} overlaps or overflows"));
                }
                at = r.offset + r.len;
            }
            if seg.shared && seg.pages != 1 {
                return Err(format!("shared segment {id} spans {} pages", seg.pages));
            }
            if !seg.shared && seg.runs.len() != 1 && !seg.blocks.is_empty() {
                return Err(format!(
                    "segment {id} of one class has {} runs",
                    seg.runs.len()
                ));
            }
            let carved: u64 = seg
                .runs
                .iter()
                .map(|r| r.len / self.classes.size(r.class as usize))
                .sum();
            if carved != seg.blocks.len() as u64 {
                return Err(format!(
                    "segment {id}: runs hold {carved} blocks, {} listed",
                    seg.blocks.len()
                ));
            }
            for r in &seg.runs {
                let chunk = self.run_of(seg, r.offset);
                let slot = run_slot(id, chunk);
                let n = run_live.remove(&slot).unwrap_or(0);
                if n != st.run_live[slot as usize] {
                    return Err(format!(
                        "segment {id}: run at chunk {chunk} counts {} blocks out of bins, has {n}",
                        st.run_live[slot as usize]
                    ));
                }
                at_runs[slot as usize] = true;
            }
            for &b in &seg.blocks {
                if st.blocks[b as usize].segment != id {
                    return Err(format!("segment {id} lists block {b} of another segment"));
                }
            }
        }
        if let Some(slot) = (0..st.run_live.len()).find(|&i| !at_runs[i] && st.run_live[i] != 0) {
            return Err(format!(
                "run count slot {slot} (segment {}) holds {} where no run starts",
                slot / CHUNKS_PER_PAGE as usize,
                st.run_live[slot]
            ));
        }
        if !run_live.is_empty() {
            return Err(format!("blocks counted where no run starts: {run_live:?}"));
        }
        let (delta, tag_deltas) = tcache::cache_deltas(&caches, st.tags.len());
        let shares = tcache::cache_shares(&caches, st.tags.len());
        let t = &st.totals;
        let said = (
            t.bytes.requested.get() + shares.requested.live,
            t.bytes.blocks.get() + shares.blocks.live,
            t.live.wrapping_add_signed(delta.live),
        );
        if (allocated, blocks_bytes, live) != said {
            return Err(format!(
                "tables hold {allocated}/{blocks_bytes} bytes in {live} allocations, stats say {said:?}"
            ));
        }
        for (i, tag) in st.tags.iter().enumerate() {
            let (a, bb, n) = by_tag.get(&(i as u32)).copied().unwrap_or_default();
            let tt = &tag.totals;
            let d = tag_deltas[i];
            let said = (
                tt.allocated.get() + shares.tags[i].live,
                tt.allocated_blocks.wrapping_add_signed(d.blocks),
                tt.live.wrapping_add_signed(d.live),
            );
            if (a, bb, n) != said {
                return Err(format!(
                    "tag {}: tables hold {a}/{bb} in {n}, stats say {said:?}",
                    tag.tag
                ));
            }
            check_peak(&tt.allocated, &shares.tags[i])
                .map_err(|e| format!("tag {}: {e}", tag.tag))?;
            if !tag.asleep() && (!tag.sleep.copies.is_empty() || tag.sleep.disk.is_some()) {
                return Err(format!("awake tag {} keeps host copies", tag.tag));
            }
        }
        check_peak(&t.bytes.requested, &shares.requested)?;
        check_peak(&t.bytes.blocks, &shares.blocks)
    }

    /// Large segments: blocks and extents tile each one; see [`Self::check_invariants`].
    fn check_large(&self, st: &State) -> Result<(), String> {
        let mut pieces: FxHashMap<u64, Vec<(u64, u64, &'static str)>> = FxHashMap::default();
        for (id, b) in st.blocks.iter().enumerate() {
            if b.class != LARGE || b.state == BlockState::Dead {
                continue;
            }
            let (start, seg) = self
                .segment_at(st, b.ptr)
                .ok_or_else(|| format!("large block {id} at {:#x} has no segment", b.ptr))?;
            if b.ptr % LARGE_ALIGN != 0 || b.size % LARGE_ALIGN != 0 || b.size == 0 {
                return Err(format!(
                    "large block {id} at {:#x}+{:#x} misaligned",
                    b.ptr, b.size
                ));
            }
            if b.tag != seg.tag || b.stream != seg.stream {
                return Err(format!(
                    "large block {id} (tag {}, {:?}) in a segment of tag {}, {:?}",
                    b.tag, b.stream, seg.tag, seg.stream
                ));
            }
            pieces
                .entry(start)
                .or_default()
                .push((b.ptr, b.size, "block"));
        }
        let mut extents = 0usize;
        for (&start, seg) in &st.large {
            let (lo, hi) = (self.va_of(start), self.va_of(start + seg.pages));
            let mut v = pieces.remove(&start).unwrap_or_default();
            for (s, l) in st.extents.within(lo, hi) {
                if st.extents.owner(s) != Some((seg.tag, seg.stream)) {
                    return Err(format!("extent {s:#x} filed under another tag or stream"));
                }
                v.push((s, l, "extent"));
                extents += 1;
            }
            v.sort_unstable();
            let mut at = lo;
            let mut prev = "start";
            for &(s, l, what) in &v {
                if s != at {
                    return Err(format!(
                        "large segment at page {start}: {what} at {s:#x}, expected {at:#x}"
                    ));
                }
                if what == "extent" && prev == "extent" {
                    return Err(format!("large segment at page {start}: extents not merged"));
                }
                at = s + l;
                prev = what;
            }
            if at != hi {
                return Err(format!(
                    "large segment at page {start}: pieces end at {at:#x}, segment at {hi:#x}"
                ));
            }
            if v.len() == 1 && v[0].2 == "extent" {
                return Err(format!("large segment at page {start} is wholly free"));
            }
        }
        if extents != st.extents.len() {
            return Err(format!(
                "{} extents, {extents} inside segments",
                st.extents.len()
            ));
        }
        Ok(())
    }
}

/// A figure's peak bounds everything the caches may hand out without settling (`stats::Peaked`):
/// `shares` sums every cache's live bytes and caps for it.
fn check_peak(p: &stats::Peaked, shares: &stats::Headroom) -> Result<(), String> {
    if p.room() != shares.cap {
        return Err(format!(
            "room {} where the caches' caps sum to {}",
            p.room(),
            shares.cap
        ));
    }
    if p.get() + p.room() > p.peak() {
        return Err(format!(
            "peak {} below the {} allocated plus the caches' room {}",
            p.peak(),
            p.get(),
            p.room()
        ));
    }
    Ok(())
}
