//! The demo workload end to end on a strict host backend: every content check passes, every
//! request is served, and the run exercises slot reuse and a sleep/wake cycle.

use strata::demo::{self, DemoConfig};
use strata_tests::backend;

#[test]
fn small_demo_verifies_every_block() {
    let config = DemoConfig {
        requests: 40,
        arrival_rate: 2.0,
        prompt: (16, 300),
        output: (8, 64),
        layers: 4,
        max_slots: 8,
        max_tokens: 1024,
        bytes_per_token: 1024,
        weight_bytes: 24 << 20,
        ..DemoConfig::default()
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
        requests: 30,
        arrival_rate: 4.0,
        prompt: (200, 900),
        output: (8, 100),
        layers: 4,
        max_slots: 16,
        max_tokens: 1024,
        bytes_per_token: 4096,
        weight_bytes: 8 << 20,
        ..DemoConfig::default()
    };
    let report = demo::run(backend(&[160 << 20]), &config, |_| {}).unwrap();
    assert_eq!(report.requests, 30);
    assert_eq!(report.mismatches, 0);
    assert!(report.admission_stalls > 0);
}

#[test]
fn bad_demo_configuration_is_an_error() {
    let config = DemoConfig {
        prompt: (0, 10),
        ..DemoConfig::default()
    };
    assert!(demo::run(backend(&[1 << 30]), &config, |_| {}).is_err());
}
