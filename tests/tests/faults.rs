//! Fault injection: the Nth create / map / set_access / copy fails → a typed error, nothing
//! leaks (live handles and mappings back to baseline once the owners drop), and the allocator
//! stays usable.

use std::sync::Arc;

use strata_allocator::{
    CachingAllocator, CachingConfig, DirectResource, KvConfig, KvSpace, MemoryResource, PagePool,
    PoolConfig,
};
use strata_tests::{as_host, backend, fill, mismatch};
use strata_vmm::host::FaultOp;
use strata_vmm::{Backend, Error, LiveCounts, StreamHandle};

const S: StreamHandle = StreamHandle::DEFAULT;
const OPS: [FaultOp; 3] = [FaultOp::Create, FaultOp::Map, FaultOp::SetAccess];

/// Which calls to fail. Access is set once per contiguous run, so there are fewer of those.
fn nths(op: FaultOp, creates: u64, runs: u64) -> Vec<u64> {
    let last = if op == FaultOp::SetAccess {
        runs
    } else {
        creates
    };
    let mut n = vec![1, 2, last / 2 + 1, last];
    n.dedup();
    n
}

fn manual_pool(backend: &Arc<dyn Backend>) -> Arc<PagePool> {
    let config = PoolConfig {
        low_watermark: 0,
        high_watermark: 0,
        limit: None,
        idle_trim_after: None,
        background: false,
    };
    PagePool::new(Arc::clone(backend), 0, config).unwrap()
}

/// Fault injection is a host-backend facility; with `STRATA_BACKEND=cuda` these tests skip.
fn skip() {
    eprintln!("skipped: fault injection needs the host backend");
}

fn assert_injected(err: &Error, op: FaultOp) {
    assert!(
        matches!(err, Error::InjectedFault(name) if *name == op.name()),
        "expected an injected {} fault, got {err}",
        op.name()
    );
}

fn assert_no_leak(backend: &Arc<dyn Backend>, baseline: LiveCounts) {
    let now = backend.live_counts();
    assert_eq!(now, baseline, "driver objects leaked");
}

#[test]
fn caching_allocator_survives_every_nth_fault() {
    // 20 MiB (10 pages, one run), 4 KiB (a new one-page small segment), 6 MiB (3 pages, one run).
    for op in OPS {
        for nth in nths(op, 14, 3) {
            let backend = backend(&[512 << 20]);
            let Some(host) = as_host(&backend) else {
                return skip();
            };
            let baseline = backend.live_counts();
            {
                let alloc =
                    CachingAllocator::new(manual_pool(&backend), CachingConfig::default()).unwrap();
                let keep = alloc.allocate(3 << 20, S).unwrap();
                fill(backend.as_ref(), keep, 3 << 20, 5);
                host.inject_fault(op, nth);
                // 10 pages, then a small block: enough driver calls for the nth to hit.
                let mut failure = None;
                let mut got = Vec::new();
                for size in [20u64 << 20, 4096, 6 << 20] {
                    match alloc.allocate(size, S) {
                        Ok(p) => got.push(p),
                        Err(e) => failure = Some(e),
                    }
                }
                host.clear_faults();
                let err =
                    failure.unwrap_or_else(|| panic!("{} fault #{nth} never fired", op.name()));
                assert_injected(&err, op);
                alloc.check_invariants().unwrap();
                assert_eq!(
                    mismatch(backend.as_ref(), keep, 3 << 20, 5),
                    None,
                    "live block damaged by a failed allocation"
                );
                // Still usable: the same requests succeed now.
                for size in [20u64 << 20, 4096, 6 << 20] {
                    let p = alloc.allocate(size, S).unwrap();
                    fill(backend.as_ref(), p, size.min(1 << 20), 9);
                    assert_eq!(mismatch(backend.as_ref(), p, size.min(1 << 20), 9), None);
                    got.push(p);
                }
                for p in got {
                    alloc.deallocate(p, S).unwrap();
                }
                alloc.deallocate(keep, S).unwrap();
                alloc.check_invariants().unwrap();
            }
            assert_no_leak(&backend, baseline);
        }
    }
}

#[test]
fn kv_grow_fault_leaves_the_slot_unchanged() {
    // 2 layers → 4 tensors, each growing by 3 pages in one run: 12 creates and maps, 4 runs.
    for op in OPS {
        for nth in nths(op, 12, 4) {
            let backend = backend(&[512 << 20]);
            let Some(host) = as_host(&backend) else {
                return skip();
            };
            let baseline = backend.live_counts();
            {
                let config = KvConfig {
                    layers: 2,
                    max_slots: 4,
                    max_tokens: 4096,
                    bytes_per_token: 2048,
                    zero_page: false,
                };
                let mut kv = KvSpace::new(manual_pool(&backend), config).unwrap();
                let slot = kv.admit().unwrap();
                kv.grow(slot, 100).unwrap();
                let before = kv.stats();
                host.inject_fault(op, nth);
                let err = kv.grow(slot, 4096).expect_err("fault did not fire");
                host.clear_faults();
                assert_injected(&err, op);
                assert_eq!(kv.tokens(slot).unwrap(), 100);
                assert_eq!(kv.stats().pages_mapped, before.pages_mapped);
                kv.check_invariants().unwrap();
                kv.grow(slot, 4096).unwrap();
                kv.check_invariants().unwrap();
                kv.free(slot).unwrap();
            }
            assert_no_leak(&backend, baseline);
        }
    }
}

#[test]
fn direct_resource_faults_leak_nothing() {
    for op in OPS {
        let backend = backend(&[256 << 20]);
        let Some(host) = as_host(&backend) else {
            return skip();
        };
        let baseline = backend.live_counts();
        {
            let direct = DirectResource::new(Arc::clone(&backend), 0).unwrap();
            host.inject_fault(op, 1);
            assert_injected(&direct.allocate(4 << 20, S).unwrap_err(), op);
            host.clear_faults();
            let p = direct.allocate(4 << 20, S).unwrap();
            direct.deallocate(p, S).unwrap();
        }
        assert_no_leak(&backend, baseline);
    }
}

#[test]
fn copy_fault_is_reported_and_the_next_copy_works() {
    let backend = backend(&[64 << 20]);
    let Some(host) = as_host(&backend) else {
        return skip();
    };
    let alloc = CachingAllocator::new(manual_pool(&backend), CachingConfig::default()).unwrap();
    let p = alloc.allocate(1 << 20, S).unwrap();
    host.inject_fault(FaultOp::Copy, 1);
    let err = backend.write(p, &[1, 2, 3]).unwrap_err();
    assert_injected(&err, FaultOp::Copy);
    fill(backend.as_ref(), p, 1 << 20, 4);
    assert_eq!(mismatch(backend.as_ref(), p, 1 << 20, 4), None);
    alloc.deallocate(p, S).unwrap();
}
