//! The demo workloads end to end on a strict host backend (the real driver with
//! `STRATA_BACKEND=cuda`): every content check passes, every request is served, and the runs
//! exercise slot reuse, a sleep/wake cycle, and spills to host memory and disk.

use std::sync::Arc;

use strata::vmm::{Backend, Choice, HostConfig};

use super::classic::{self as demo, DemoConfig};
use super::tiered::{self, TieredConfig};
use super::workload::Workload;

/// A strict host backend with these device capacities and a 2 MiB granularity.
fn backend(devices: &[u64]) -> Arc<dyn Backend> {
    if Choice::from_env().ok() == Some(Choice::Cuda) {
        return strata::vmm::open(Choice::Cuda).expect("STRATA_BACKEND=cuda but no CUDA device");
    }
    strata::vmm::host::open(HostConfig {
        devices: devices.to_vec(),
        granularity: 2 << 20,
        strict: true,
        link: None,
    })
    .expect("host backend")
}

#[test]
fn small_demo_verifies_every_block() {
    let config = DemoConfig {
        workload: Workload {
            requests: 40,
            prompt: (16, 300),
            output: (8, 64),
            layers: 4,
            bytes_per_token: 1024,
            ..DemoConfig::default().workload
        },
        arrival_rate: 2.0,
        max_slots: 8,
        max_tokens: 1024,
        weight_bytes: 24 << 20,
    };
    let mut steps = 0;
    let report = demo::run(backend(&[1 << 30]), &config, |_| steps += 1).unwrap();
    assert_eq!(report.requests, 40);
    assert_eq!(report.mismatches, 0);
    assert!(
        report.verified_blocks > 40,
        "too few checks: {}",
        report.verified_blocks
    );
    assert!(
        report.slots_reused > 0,
        "deferred reclamation never reused a slot"
    );
    assert_eq!(report.sleep_wake_cycles, 1);
    assert_eq!(report.steps, steps);
    assert_eq!(report.allocator.live_allocations, 0);
}

#[test]
fn demo_under_memory_pressure_stalls_instead_of_failing() {
    // A device too small for every slot at full length: admission waits, nothing fails.
    let config = DemoConfig {
        workload: Workload {
            requests: 30,
            prompt: (200, 900),
            output: (8, 100),
            layers: 4,
            bytes_per_token: 4096,
            ..DemoConfig::default().workload
        },
        arrival_rate: 4.0,
        max_slots: 16,
        max_tokens: 1024,
        weight_bytes: 8 << 20,
    };
    let report = demo::run(backend(&[160 << 20]), &config, |_| {}).unwrap();
    assert_eq!(report.requests, 30);
    assert_eq!(report.mismatches, 0);
    assert!(report.admission_stalls > 0);
}

#[test]
fn bad_demo_configuration_is_an_error() {
    let config = DemoConfig {
        workload: Workload {
            prompt: (0, 10),
            ..DemoConfig::default().workload
        },
        ..DemoConfig::default()
    };
    assert!(demo::run(backend(&[1 << 30]), &config, |_| {}).is_err());
}

#[test]
fn tiered_demo_spills_to_host_and_disk_and_verifies_every_returning_block() {
    let dir = std::env::temp_dir();
    let config = TieredConfig {
        workload: Workload {
            requests: 32,
            prompt: (64, 400),
            output: (4, 12),
            layers: 1,
            bytes_per_token: 4096,
            ..TieredConfig::default().workload
        },
        batch: 2,
        hbm_bytes: Some(16 << 20),
        host_bytes: 4 << 20,
        disk_bytes: 256 << 20,
        disk_dir: dir,
        ..TieredConfig::default()
    };
    let report = tiered::run(backend(&[64 << 20]), &config, |_, _| {}).unwrap();
    assert_eq!(report.requests, 32);
    assert_eq!(report.mismatches, 0);
    assert!(
        report.peak_kv_bytes >= 3 * report.hbm_bytes,
        "not oversubscribed: {report:?}"
    );
    assert!(
        report.verified_blocks > 100,
        "too few checks: {}",
        report.verified_blocks
    );
    assert!(report.store.disk_write_bytes > 0 && report.store.disk_read_bytes > 0);
    assert!(report.store.transfers.bytes_d2h > 0 && report.store.transfers.bytes_h2d > 0);
    assert!(report.kv.restores > 0 && report.kv.hinted_prefetches > 0);
    assert_eq!(report.store.objects, 0);
    let svg = std::env::temp_dir().join(format!("strata-occupancy-{}.svg", std::process::id()));
    tiered::write_svg(&svg, &report.samples).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.matches("<polyline").count() == 3);
    std::fs::remove_file(svg).unwrap();
}

#[test]
fn a_tiered_batch_larger_than_hbm_runs_shorter_instead_of_failing() {
    // 512-token blocks of 2 pages (K and V of one layer): a request of up to 900 tokens needs
    // 8 MiB, so 16 MiB of HBM holds two of them, not a batch of four.
    let config = TieredConfig {
        workload: Workload {
            requests: 12,
            prompt: (300, 880),
            output: (4, 20),
            layers: 1,
            bytes_per_token: 4096,
            ..TieredConfig::default().workload
        },
        batch: 4,
        hbm_bytes: Some(16 << 20),
        host_bytes: 8 << 20,
        disk_bytes: 256 << 20,
        disk_dir: std::env::temp_dir(),
        ..TieredConfig::default()
    };
    let report = tiered::run(backend(&[64 << 20]), &config, |_, _| {}).unwrap();
    assert_eq!(report.requests, 12);
    assert_eq!(report.mismatches, 0);
    assert!(report.verified_blocks > 0);
    // Some of those requests fill a block, so restores keep clean copies.
    assert!(report.kv.clean_spills > 0, "{:?}", report.kv);
    assert_eq!(report.store.objects, 0);
}
