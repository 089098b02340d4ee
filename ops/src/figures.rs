//! A device's figures from its [`DeviceRuntime`]: the allocator's and its tags', the pool's,
//! and the KV spaces' a library passes in.

use strata_allocator::{TagId, TagStats, UNTAGGED};
use strata_runtime::DeviceRuntime;

use crate::layout::{DeviceFigures, KvFigures, TagFigures, TagState, TierBytes};

/// The figures of device `d`, with the KV spaces `kv` on it and tag names from `tag_name`;
/// `None` while nothing was created on it.
pub fn device_figures(
    d: &DeviceRuntime,
    tag_name: &dyn Fn(TagId) -> Option<String>,
    kv: Vec<KvFigures>,
) -> Option<DeviceFigures> {
    let stats = d.stats();
    if stats.allocator.is_none() && stats.pool.is_none() && kv.is_empty() {
        return None;
    }
    let mut out = DeviceFigures {
        device: d.device(),
        total_bytes: d
            .backend()
            .device_info(d.device())
            .map_or(0, |i| i.total_memory),
        ..DeviceFigures::default()
    };
    if let Some(pool) = &stats.pool {
        let bytes = |pages: usize| pages as u64 * pool.page_size;
        out.pool_in_use_bytes = bytes(pool.in_use);
        out.lent_bytes = bytes(pool.lent);
        out.borrowed_bytes = bytes(pool.borrowed);
    }
    if let (Some(s), Some(a)) = (&stats.allocator, d.existing_allocator()) {
        out.reserved_bytes = s.reserved_bytes;
        out.allocated_bytes = s.allocated_bytes;
        out.peak_allocated_bytes = s.peak_allocated_bytes;
        out.peak_reserved_bytes = s.peak_reserved_bytes;
        out.limit_bytes = s.limit;
        out.allocs = s.counts.allocs;
        out.frees = s.counts.frees;
        out.ooms = s.counts.ooms;
        let spill = a.spill_stats(None);
        out.tiers = TierBytes {
            device: spill.tiers.local,
            peer: spill.tiers.peer,
            host: spill.tiers.host,
            disk: 0,
        };
        out.moved_bytes = spill.counts.bytes_to_host + spill.counts.bytes_to_device;
        // Where nothing is off the device (the common case), a tag's pages are its reserved
        // bytes: no walk over its pages under the allocator's lock, once per tag.
        let all_local = spill.tiers.host == 0 && spill.tiers.peer == 0;
        for t in s.tags.iter().filter(|t| shown(t)) {
            let tiers = if all_local {
                strata_allocator::TierBytes {
                    local: t.reserved_bytes,
                    ..Default::default()
                }
            } else {
                a.spill_stats(Some(t.tag)).tiers
            };
            let tag = tag_figures(t, tiers, tag_name(t.tag));
            out.tiers.host += t.host_copy_bytes;
            out.tiers.disk += t.disk_copy_bytes;
            out.tags.push(tag);
        }
    }
    for k in &kv {
        out.tiers.add(k.bytes);
        out.moved_bytes += k.moved_bytes;
    }
    out.kv_spaces = kv;
    Some(out)
}

/// Whether a tag holds anything (a released name's figures are all zero).
fn shown(t: &TagStats) -> bool {
    t.tag != UNTAGGED
        && (t.live_allocations > 0 || t.reserved_bytes > 0 || t.asleep || t.host_copy_bytes > 0)
}

/// A tag's figures: asleep as the allocator says; offloaded while awake with host pages.
fn tag_figures(
    t: &TagStats,
    tiers: strata_allocator::TierBytes,
    name: Option<String>,
) -> TagFigures {
    let state = if t.asleep {
        TagState::Asleep
    } else if tiers.host > 0 {
        TagState::Offloaded
    } else {
        TagState::Awake
    };
    TagFigures {
        name: name.unwrap_or_else(|| format!("#{}", t.tag)),
        state,
        allocated_bytes: t.allocated_bytes,
        bytes: TierBytes {
            device: tiers.local,
            peer: tiers.peer,
            host: tiers.host + t.host_copy_bytes,
            disk: t.disk_copy_bytes,
        },
    }
}
