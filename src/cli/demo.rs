//! `strata demo`: the KV-serving workload on the default backend, with a progress bar and a
//! summary; exits non-zero if any content check failed.

use std::process::ExitCode;

use comfy_table::Table;
use indicatif::{ProgressBar, ProgressStyle};
use strata::demo::{self, DemoConfig};

use super::size;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Requests to serve.
    #[arg(long, default_value_t = DemoConfig::default().requests)]
    requests: u32,
    /// Random seed (arrivals and lengths).
    #[arg(long, default_value_t = DemoConfig::default().seed)]
    seed: u64,
    /// Mean request arrivals per decode step.
    #[arg(long, default_value_t = DemoConfig::default().arrival_rate)]
    arrival_rate: f64,
    /// Most concurrent requests (KV slots).
    #[arg(long, default_value_t = DemoConfig::default().max_slots)]
    max_slots: u32,
    /// Model layers (each with a K and a V tensor).
    #[arg(long, default_value_t = DemoConfig::default().layers)]
    layers: u32,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

pub fn run(args: DemoArgs) -> Result<ExitCode, strata::Error> {
    let config = DemoConfig {
        device: args.device,
        requests: args.requests,
        seed: args.seed,
        arrival_rate: args.arrival_rate,
        max_slots: args.max_slots,
        layers: args.layers,
        ..DemoConfig::default()
    };
    let backend = strata::vmm::from_env()?;
    println!(
        "strata demo: {} requests on the {} backend, device {} ({} layers, up to {} concurrent, {} tokens max)",
        config.requests,
        backend.kind(),
        config.device,
        config.layers,
        config.max_slots,
        config.max_tokens
    );
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(config.requests as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} requests  {msg}  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let report = demo::run(backend, &config, |p| {
        bar.set_position(p.finished as u64);
        if p.step % 16 == 0 {
            bar.set_message(format!(
                "step {} · {} active · {} waiting",
                p.step, p.active, p.waiting
            ));
        }
    })?;
    bar.finish_and_clear();

    let a = &report.allocator;
    let kv = &report.kv;
    let overhead = if a.peak_allocated_bytes > 0 {
        a.peak_reserved_bytes as f64 / a.peak_allocated_bytes as f64
    } else {
        1.0
    };
    let mut table = Table::new();
    table.set_header(["", "value"]);
    let rows: Vec<(&str, String)> = vec![
        ("backend", report.backend.clone()),
        ("requests served", report.requests.to_string()),
        ("decode steps", report.steps.to_string()),
        (
            "tokens (prompt + decoded)",
            format!("{} + {}", report.prompt_tokens, report.decoded_tokens),
        ),
        (
            "admission stalls (no slot or memory)",
            report.admission_stalls.to_string(),
        ),
        (
            "KV pages mapped / unmapped (total)",
            format!("{} / {}", kv.pages_mapped_total, kv.pages_unmapped_total),
        ),
        (
            "KV map / set_access calls",
            format!("{} / {}", kv.map_calls, kv.set_access_calls),
        ),
        (
            "slots reused without remapping",
            report.slots_reused.to_string(),
        ),
        ("preemptions (recomputed)", report.preemptions.to_string()),
        (
            "peak KV memory",
            size(report.peak_kv_pages * report.page_size),
        ),
        (
            "allocator peak allocated / reserved",
            format!(
                "{} / {}",
                size(a.peak_allocated_bytes),
                size(a.peak_reserved_bytes)
            ),
        ),
        (
            "allocator overhead (peak reserved ÷ peak allocated)",
            format!("{overhead:.3}"),
        ),
        (
            "allocations (cache hits / misses)",
            format!(
                "{} ({} / {})",
                a.counts.allocs, a.counts.cache_hits, a.counts.cache_misses
            ),
        ),
        (
            "weights sleep/wake cycles",
            report.sleep_wake_cycles.to_string(),
        ),
        (
            "peak device memory in use",
            format!(
                "{} of {}",
                size(report.peak_device_used),
                size(report.device_total)
            ),
        ),
        ("elapsed", format!("{:.1} s", report.elapsed.as_secs_f64())),
    ];
    for (k, v) in rows {
        table.add_row([k.to_string(), v]);
    }
    println!("{table}");
    println!(
        "verified: {} blocks, {} mismatches",
        report.verified_blocks, report.mismatches
    );
    Ok(if report.mismatches == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
