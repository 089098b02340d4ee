//! The block manager and its store at the edges issue 31 found: truncation of spilled blocks,
//! revocations that fail part way or take nothing from the space, stale ids in the queue, and
//! tier sizes (block counts that would wrap, a disk tier larger than its filesystem; a full
//! disk tier: `store.rs`).

mod common;

use std::sync::Arc;

use common::kv::*;
use common::*;
use strata_allocator::{PagePool, PoolConfig};
use strata_tiers::{RequestId, StoreConfig, Tier, TierStore};
use strata_vmm::Error;

/// Objects the store holds for `m`'s requests, by tier.
fn used(m: &strata_tiers::KvBlockManager) -> (u64, u64) {
    let s = m.store().stats();
    (s.host_used, s.disk_used)
}

#[test]
fn truncating_a_spilled_request_releases_its_copies_past_the_new_end() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 64, dir.path());
    let a = m.admit().unwrap();
    // Three blocks, the last one partly filled (4 chunks of 512 KiB per tensor page).
    grow(&m, a, 1, 3 * TPB - 10).unwrap();
    for tier in [Tier::Host, Tier::Disk] {
        m.pause(a, tier).unwrap();
        // Block 1 keeps 10 tokens: one chunk per tensor; block 2 goes.
        m.truncate(a, TPB + 10).unwrap();
        m.check_invariants().unwrap();
        let (host, disk) = used(&m);
        let tensors = 2 * u64::from(LAYERS);
        assert_eq!(
            host + disk,
            tensors * (4 + 1),
            "{tier:?}: host {host} disk {disk}"
        );
        assert_eq!(verify(&m, a, 1).unwrap(), (tier, 2));
        m.make_resident(&[a]).unwrap().synchronize().unwrap();
        assert_eq!(verify(&m, a, 1).unwrap(), (Tier::Hbm, 2));
        // Rewritten whole (dropping block 0's clean copy), as before the next round.
        m.append(a, 2 * TPB - 20).unwrap();
        fill(&m, a, 1, 0, 3 * TPB - 10).unwrap();
        m.check_invariants().unwrap();
    }
    m.pause(a, Tier::Host).unwrap();
    m.truncate(a, 0).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(used(&m), (0, 0));
    m.release(a).unwrap();
}

#[test]
fn a_revocation_that_fails_part_way_still_names_its_losses() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(12, 64, 256, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 2, 2 * TPB).unwrap();
    m.advance(1);
    let (rev, result) = m.revoke_reporting(1 << 20);
    assert!(result.unwrap_err().is_out_of_memory());
    assert!(rev.pages.is_empty());
    assert_eq!(rev.lost, vec![(a, vec![0, 1])]);
    // Still reported once by take_lost, as before.
    assert_eq!(m.take_lost(a).unwrap(), vec![0, 1]);
    assert_eq!(m.stats().pages_revoked, 4 * u64::from(LAYERS));
    m.check_invariants().unwrap();
}

#[test]
fn a_revocation_the_pool_covers_takes_nothing_from_the_space_and_counts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 256, dir.path());
    let a = m.admit().unwrap();
    grow(&m, a, 3, 2 * TPB).unwrap(); // 8 of the pool's 16 pages
    m.advance(1);
    let rev = m.revoke(4).unwrap();
    assert_eq!(rev.pages.len(), 4);
    assert!(rev.lost.is_empty());
    assert_eq!(m.stats().pages_revoked, 0);
    assert_eq!(verify(&m, a, 3).unwrap(), (Tier::Hbm, 2));
    // The device has 4 more for the pool: 4 more come from the space (one block lost).
    let more = m.revoke(8).unwrap();
    assert_eq!(more.lost, vec![(a, vec![1])]);
    assert_eq!(m.stats().pages_revoked, 2 * u64::from(LAYERS));
    m.store().pool().give(rev.pages);
    m.store().pool().give(more.pages);
    m.check_invariants().unwrap();
}

#[test]
fn the_queue_refuses_released_requests_and_keeps_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 256, dir.path());
    let a = m.admit().unwrap();
    let b = m.admit().unwrap();
    m.queue(&[a, b]).unwrap();
    m.release(b).unwrap();
    assert!(matches!(m.queue(&[a, b]), Err(Error::StaleId { .. })));
    assert!(matches!(
        m.queue(&[RequestId(999)]),
        Err(Error::StaleId { .. })
    ));
    m.queue(&[a]).unwrap();
}

fn store_with_disk(dir: &std::path::Path, disk_bytes: u64) -> Result<TierStore, Error> {
    let b = backend(None);
    let pool = PagePool::new(
        Arc::clone(&b),
        0,
        PoolConfig {
            background: false,
            ..PoolConfig::default()
        },
    )?;
    let mut c = StoreConfig::new(BLOCK, 0, 4 * BLOCK);
    let mut d = disk(dir, 0);
    d.spec.capacity = disk_bytes;
    c.disk = Some(d);
    TierStore::new(pool, c)
}

#[test]
fn tier_sizes_never_wrap_and_a_disk_tier_fits_its_filesystem() {
    let dir = tempfile::tempdir().unwrap();
    // 2^32 blocks of 64 KiB: a 32-bit count would wrap to 0.
    let err = store_with_disk(dir.path(), BLOCK << 32).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("blocks")),
        "{err}"
    );
    let err = store_with_disk(dir.path(), u64::MAX).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // Far more than any filesystem here has free: out of tier space, before anything is held.
    let err = store_with_disk(dir.path(), BLOCK * u64::from(u32::MAX)).unwrap_err();
    assert!(
        matches!(err, Error::OutOfTierSpace { tier: "disk", .. }),
        "{err}"
    );
    assert!(err.is_out_of_memory());
    // What the filesystem has room for works, and costs no bookkeeping up front.
    let s = store_with_disk(dir.path(), 64 * BLOCK).unwrap();
    assert_eq!(s.stats().disk_slots, 64);
    assert_eq!(s.stats().disk_used, 0);
}

#[test]
fn the_step_clock_at_its_limit_still_orders_requests() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(16, 64, 256, dir.path());
    m.advance(u64::MAX);
    let a = m.admit().unwrap();
    let b = m.admit().unwrap();
    grow(&m, a, 4, TPB).unwrap();
    grow(&m, b, 5, TPB).unwrap();
    m.pause(a, Tier::Host).unwrap();
    m.make_resident(&[a, b]).unwrap().synchronize().unwrap();
    assert_eq!(verify(&m, a, 4).unwrap(), (Tier::Hbm, 1));
    m.check_invariants().unwrap();
}
