//! `strata demo`: by default the oversubscribed tiered workload (KV demand several times the
//! device's HBM, spilling to host memory and disk and prefetching back); `--classic` runs the
//! single-tier KvSpace + caching-allocator workload. Progress bar, summary, exit non-zero if any
//! content check failed. The two workloads share their request stream, seeding and content
//! checks (`workload.rs`).

mod classic;
mod tiered;
mod workload;

#[cfg(test)]
mod tests;

use std::process::ExitCode;

use comfy_table::Table;
use indicatif::{ProgressBar, ProgressStyle};
use strata::vmm::{Choice, HostConfig};

use super::size;
use classic::DemoConfig;
use tiered::TieredConfig;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Requests to serve.
    #[arg(long, default_value_t = DemoConfig::default().workload.requests)]
    requests: u32,
    /// Random seed (arrivals and lengths).
    #[arg(long, default_value_t = DemoConfig::default().workload.seed)]
    seed: u64,
    /// Mean request arrivals per decode step.
    #[arg(long, default_value_t = DemoConfig::default().arrival_rate)]
    arrival_rate: f64,
    /// Most concurrent requests (KV slots).
    #[arg(long, default_value_t = DemoConfig::default().max_slots)]
    max_slots: u32,
    /// Model layers (each with a K and a V tensor).
    #[arg(long, default_value_t = DemoConfig::default().workload.layers)]
    layers: u32,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Run the classic single-tier workload (KvSpace, caching allocator, sleep/wake).
    #[arg(long)]
    classic: bool,
    /// Tiered run: write an SVG plot of tier occupancy over time to this file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Tiered run: directory of the disk tier's file.
    #[arg(long)]
    disk_dir: Option<std::path::PathBuf>,
    /// Tiered run: requests (default 80).
    #[arg(long)]
    tiered_requests: Option<u32>,
}

/// HBM of the emulated device for the tiered run when `STRATA_HOST_DEVICES` is not set.
const TIERED_DEVICE: u64 = 128 << 20;

fn run_tiered(args: &DemoArgs) -> Result<ExitCode, strata::Error> {
    let backend = strata::vmm::open_with(Choice::from_env()?, || {
        HostConfig::from_env_or(&[TIERED_DEVICE])
    })?;
    let mut config = TieredConfig::default();
    config.workload.device = args.device;
    config.workload.seed = args.seed;
    if let Some(r) = args.tiered_requests {
        config.workload.requests = r;
    }
    if let Some(d) = &args.disk_dir {
        config.disk_dir = d.clone();
    }
    if backend.kind() == strata::vmm::BackendKind::Cuda {
        config.hbm_bytes = Some(TIERED_DEVICE);
    }
    println!(
        "strata demo (tiered): {} requests on the {} backend, device {}; HBM {}, host {}, disk up to {} in {}",
        config.workload.requests,
        backend.kind(),
        config.workload.device,
        size(config.hbm_bytes.unwrap_or(backend.mem_info(config.workload.device)?.total)),
        size(config.host_bytes),
        size(config.disk_bytes),
        config.disk_dir.display()
    );
    let bar = progress_bar(args.quiet, config.workload.requests);
    let report = tiered::run(backend, &config, |step, finished| {
        bar.set_position(finished as u64);
        if step % 16 == 0 {
            bar.set_message(format!("step {step}"));
        }
    })?;
    bar.finish_and_clear();
    let st = &report.store;
    let kv = &report.kv;
    let peak = |f: fn(&tiered::Sample) -> u64| report.samples.iter().map(f).max().unwrap_or(0);
    let t = &st.transfers;
    let mut table = Table::new();
    table.set_header(["", "value"]);
    let rows: Vec<(&str, String)> = vec![
        ("backend", report.backend.clone()),
        (
            "requests served / decode steps",
            format!("{} / {}", report.requests, report.steps),
        ),
        (
            "KV demand (peak pages, all tiers) vs HBM",
            format!(
                "{} vs {} ({:.1}×)",
                size(report.peak_kv_bytes),
                size(report.hbm_bytes),
                report.peak_kv_bytes as f64 / report.hbm_bytes.max(1) as f64
            ),
        ),
        ("store object (copy unit)", size(st.block_size)),
        (
            "peak occupancy HBM / host / disk",
            format!(
                "{} / {} / {}",
                size(peak(|s| s.hbm)),
                size(peak(|s| s.host)),
                size(peak(|s| s.disk))
            ),
        ),
        (
            "traffic host→HBM / HBM→host",
            format!("{} / {}", size(t.bytes_h2d), size(t.bytes_d2h)),
        ),
        (
            "disk read / written",
            format!(
                "{} / {} ({})",
                size(st.disk_read_bytes),
                size(st.disk_write_bytes),
                if report.disk_direct {
                    "O_DIRECT"
                } else {
                    "buffered"
                }
            ),
        ),
        (
            "blocks moved / descriptors / kernel launches",
            format!("{} / {} / {}", t.blocks, t.descriptors, t.kernel_launches),
        ),
        (
            "KV blocks spilled / restored (lookahead prefetches)",
            format!("{} / {} ({})", kv.spills, kv.restores, kv.hinted_prefetches),
        ),
        (
            "clean copies: spills without a copy / dropped for room",
            format!("{} / {}", kv.clean_spills, st.redundant_dropped),
        ),
        (
            "requests evicted for room / host evictions to disk",
            format!("{} / {}", kv.evictions, st.evictions_host),
        ),
        ("elapsed", format!("{:.1} s", report.elapsed.as_secs_f64())),
    ];
    for (k, v) in rows {
        table.add_row([k.to_string(), v]);
    }
    println!("{table}");
    if let Some(path) = &args.plot {
        tiered::write_svg(path, &report.samples)?;
        println!("plot: {}", path.display());
    }
    Ok(verdict(report.verified_blocks, report.mismatches))
}

pub fn run(args: DemoArgs) -> Result<ExitCode, strata::Error> {
    if !args.classic {
        return run_tiered(&args);
    }
    let defaults = DemoConfig::default();
    let config = DemoConfig {
        workload: workload::Workload {
            device: args.device,
            requests: args.requests,
            seed: args.seed,
            layers: args.layers,
            ..defaults.workload
        },
        arrival_rate: args.arrival_rate,
        max_slots: args.max_slots,
        ..defaults
    };
    let backend = strata::vmm::from_env()?;
    println!(
        "strata demo: {} requests on the {} backend, device {} ({} layers, up to {} concurrent, {} tokens max)",
        config.workload.requests,
        backend.kind(),
        config.workload.device,
        config.workload.layers,
        config.max_slots,
        config.max_tokens
    );
    let bar = progress_bar(args.quiet, config.workload.requests);
    let report = classic::run(backend, &config, |p| {
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
    Ok(verdict(report.verified_blocks, report.mismatches))
}

/// The progress bar of a run of `requests` (hidden with `--quiet`).
fn progress_bar(quiet: bool, requests: u32) -> ProgressBar {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(u64::from(requests))
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} requests  {msg}  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Prints the content checks' outcome; the exit code fails the run on any mismatch.
fn verdict(verified: u64, mismatches: u64) -> ExitCode {
    println!("verified: {verified} blocks, {mismatches} mismatches");
    if mismatches == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
