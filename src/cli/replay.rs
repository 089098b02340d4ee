//! `strata bench replay FILE`: a recorded allocation trace through a fresh caching allocator.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use comfy_table::Table;
use strata::allocator::{CachingAllocator, CachingConfig, PagePool, PoolConfig};
use strata::replay::{self, Format, Trace};
use strata::vmm::StreamHandle;

use super::chart::{write_chart, Series};

use super::size;

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// Trace files: CSV `op,id,bytes`, a PyTorch profiler Chrome trace (JSON) or a memory
    /// snapshot pickle; optionally gzip-compressed.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Chrome trace: device type to keep (0 CPU, 1 CUDA); snapshot: device index. Default:
    /// the busiest.
    #[arg(long)]
    device_filter: Option<i64>,
    /// Device the allocator runs on.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Writes allocated and reserved bytes over the replay as an SVG chart (one file per trace:
    /// `PLOT` for one trace, `PLOT` with the trace's name inserted for several).
    #[arg(long)]
    plot: Option<PathBuf>,
}

pub fn run(args: ReplayArgs) -> Result<ExitCode, strata::Error> {
    let backend = strata::vmm::from_env()?;
    println!(
        "strata bench replay: {} backend, device {}, one fresh caching allocator per trace",
        backend.kind(),
        args.device
    );
    let mut table = Table::new();
    table.set_header([
        "trace",
        "format",
        "allocs",
        "peak allocated",
        "peak reserved",
        "reserved ÷ allocated",
        "ns per op",
        "pages mapped",
    ]);
    let mut failed = false;
    for file in &args.files {
        let trace = match Trace::load(file, args.device_filter) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("strata: {}: {e}", file.display());
                failed = true;
                continue;
            }
        };
        let fresh = || -> Result<CachingAllocator, strata::Error> {
            let pool = PagePool::new(Arc::clone(&backend), args.device, PoolConfig::default())?;
            CachingAllocator::new(pool, CachingConfig::default())
        };
        let report = replay::replay(&fresh()?, &trace, StreamHandle::DEFAULT, None)?;
        let (allocs, frees) = trace.counts();
        if trace.unmatched_frees > 0 || report.failed > 0 {
            println!(
                "{}: {allocs} allocations, {frees} frees, {} frees of earlier allocations skipped, {} allocations refused",
                file.display(),
                trace.unmatched_frees,
                report.failed
            );
        }
        table.add_row([
            file.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into()),
            match trace.format {
                Format::Csv => "CSV",
                Format::ChromeTrace => "Chrome trace",
                Format::Snapshot => "snapshot",
            }
            .to_string(),
            allocs.to_string(),
            size(report.peak_allocated),
            size(report.peak_reserved),
            format!("{:.3}", report.ratio()),
            format!("{:.0}", report.ns_per_op()),
            report.map_calls.to_string(),
        ]);
        if let Some(plot) = &args.plot {
            let path = plot_path(plot, file, args.files.len() > 1);
            let every = (report.ops / 2000).max(1);
            let sampled = replay::replay(&fresh()?, &trace, StreamHandle::DEFAULT, Some(every))?;
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            let line = |f: fn(&replay::Sample) -> u64| {
                sampled
                    .samples
                    .iter()
                    .map(|s| (s.op as f64, mib(f(s))))
                    .collect()
            };
            let title = format!(
                "strata bench replay: {} (peak reserved ÷ peak allocated {:.3})",
                file.display(),
                report.ratio()
            );
            write_chart(
                &path,
                &title,
                "operation",
                "MiB",
                &[
                    Series {
                        name: "reserved",
                        color: "#d62728",
                        points: line(|s| s.reserved),
                    },
                    Series {
                        name: "allocated",
                        color: "#1f77b4",
                        points: line(|s| s.allocated),
                    },
                ],
            )?;
            println!("plot: {}", path.display());
        }
    }
    println!("{table}");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn plot_path(plot: &std::path::Path, trace: &std::path::Path, several: bool) -> PathBuf {
    if !several {
        return plot.to_path_buf();
    }
    let name = trace
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let name = name.replace('.', "-");
    let stem = plot
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    plot.with_file_name(format!("{stem}-{name}.svg"))
}
