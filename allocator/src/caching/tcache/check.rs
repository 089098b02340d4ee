//! The invariant checker's view of the thread caches.

use parking_lot::MutexGuard;

use super::super::stats::Headroom;
use super::{CacheData, Held, Shares, CACHE_FREE_BYTES, MAGAZINE_BLOCKS};

/// Every cache's blocks, for the invariant checker: (slot, block) pairs, each free one checked
/// to sit in exactly one magazine of its tag, class and stream, within the bounds.
pub(in crate::caching) fn cached_blocks(
    caches: &[(u32, MutexGuard<'_, CacheData>)],
) -> std::result::Result<Vec<(u32, Held)>, String> {
    let mut out = Vec::new();
    for (slot, data) in caches {
        let mut free_bytes = 0;
        let mut free = 0;
        for (ptr, h) in data.held.iter() {
            let n: usize = data
                .mags
                .iter()
                .filter(|m| m.stream == h.stream && m.class == h.class && m.tag == h.tag)
                .map(|m| m.free.iter().filter(|&&(p, _)| p == ptr).count())
                .sum();
            if n != usize::from(!h.live) {
                return Err(format!(
                    "cache {slot}: block {ptr:#x} (live: {}) in {n} magazines",
                    h.live
                ));
            }
            if !h.live {
                free_bytes += h.size;
                free += 1;
            }
            out.push((*slot, *h));
        }
        let mut live = Shares {
            tags: vec![Headroom::default(); data.shares.tags.len()],
            ..Shares::default()
        };
        for (_, h) in data.held.iter().filter(|(_, h)| h.live) {
            live.requested.live += h.requested;
            live.blocks.live += h.size;
            match live.tags.get_mut(h.ti as usize) {
                Some(t) => t.live += h.requested,
                None => return Err(format!("cache {slot}: no share for tag index {}", h.ti)),
            }
        }
        let said = &data.shares;
        let pairs = [
            (&live.requested, &said.requested),
            (&live.blocks, &said.blocks),
        ];
        let tag_pairs = live.tags.iter().zip(&said.tags);
        if pairs
            .into_iter()
            .chain(tag_pairs)
            .any(|(l, s)| l.live != s.live || s.live > s.cap)
        {
            return Err(format!(
                "cache {slot}: its live blocks hold {live:?}, its shares say {said:?}"
            ));
        }
        let in_mags: usize = data.mags.iter().map(|m| m.free.len()).sum();
        if in_mags != free {
            return Err(format!("cache {slot}: magazines hold unknown blocks"));
        }
        if free_bytes != data.free_bytes
            || free_bytes > CACHE_FREE_BYTES
            || data.mags.iter().any(|m| m.free.len() > MAGAZINE_BLOCKS)
        {
            return Err(format!("cache {slot}: over its bounds or miscounted"));
        }
    }
    Ok(out)
}
