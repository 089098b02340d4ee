//! `strata sim`: the discrete-event simulator (TierKV, KVPR, Pie, MIRAGE, Harvest).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::chart::{write_chart, Series};
use indicatif::{ProgressBar, ProgressStyle};
use strata::sim::hw::{HardwareProfile, ModelProfile};
use strata::sim::tierkv::{self, Policy, TierKvConfig, TierKvResult};
use strata::sim::Workload;

#[derive(clap::Subcommand)]
pub enum SimCommand {
    /// TierKV Tables 5–7: TPOT and throughput of LRU, Frequency, Static-Tiering, lookahead
    /// prefetch and the oracle across oversubscription levels.
    Tierkv(TierKvArgs),
    /// KVPR: decode latency with full KV transfer vs the planned transfer/recompute split.
    Kvpr(KvprArgs),
    /// Pie: throughput and compute latency against expansion; the adaptive controller.
    Pie(PieArgs),
    /// MIRAGE Figure 15: throughput with m = α+1, α+2 and the dynamic choice as α grows.
    Mirage(MirageArgs),
    /// Harvest Figures 3 and 7: fetch latency of expert- and KV-sized chunks, peer vs host.
    Harvest(HarvestArgs),
}

#[derive(clap::Args)]
pub struct MirageArgs {
    /// Hardware profile: h100, gh200, h100x2, a100.
    #[arg(long, default_value = "gh200")]
    hw: String,
    /// Decode batch (sets T_c with the 1024-token context).
    #[arg(long, default_value_t = 64)]
    batch: u64,
    /// Largest α to sweep.
    #[arg(long, default_value_t = 16)]
    max_alpha: u32,
    /// Let the memory freed by remapping admit more requests (the batch grows with α).
    #[arg(long)]
    kv_growth: bool,
    #[arg(long)]
    json: bool,
    /// Write throughput against α as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct HarvestArgs {
    /// Seed for the peers' harvestable bytes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct TierKvArgs {
    /// Oversubscription levels (ρ = total KV footprint / HBM KV capacity).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,1.5,2,2.5,3,3.5,4,4.5,5"
    )]
    levels: Vec<f64>,
    /// Seeds per level (results are averaged, as in TierKV's tables).
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Hardware profile: h100, gh200, h100x2, a100.
    #[arg(long, default_value = "h100")]
    hw: String,
    /// Model: 7b, 13b, 30b.
    #[arg(long, default_value = "7b")]
    model: String,
    /// Workload: uniform, chatbot, code, summarization, mixed, sharegpt, alpaca.
    #[arg(long, default_value = "mixed")]
    workload: String,
    /// K, the lookahead window of the prefetch policy.
    #[arg(long, default_value_t = 1)]
    lookahead: usize,
    /// Run TierKV-Prefetch as Algorithm 1 plus lookahead eviction only, without warming the
    /// head of the waiting queue with spare link time.
    #[arg(long)]
    no_queue_warming: bool,
    /// Print a JSON array of records instead of tables.
    #[arg(long)]
    json: bool,
    /// Write mean TPOT against oversubscription as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Worker threads (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(clap::Args)]
pub struct KvprArgs {
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct PieArgs {
    /// Workload: sharegpt or alpaca.
    #[arg(long, default_value = "sharegpt")]
    workload: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long)]
    json: bool,
    /// Write throughput against expansion and the controller's trajectory as SVG charts
    /// (`FILE` and `FILE` with `-adaptive` before the extension).
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn bad(what: &str, v: &str) -> strata::Error {
    strata::Error::InvalidArgument(format!("unknown {what} `{v}`"))
}

pub fn run(cmd: SimCommand) -> Result<ExitCode, strata::Error> {
    match cmd {
        SimCommand::Tierkv(a) => run_tierkv(a),
        SimCommand::Kvpr(a) => super::sim_kvpr::run(a.json),
        SimCommand::Pie(a) => {
            let w = Workload::by_key(&a.workload).ok_or_else(|| bad("workload", &a.workload))?;
            super::sim_pie::run(w, a.seed, a.json, a.plot)
        }
        SimCommand::Mirage(a) => {
            let hw =
                HardwareProfile::by_key(&a.hw).ok_or_else(|| bad("hardware profile", &a.hw))?;
            super::sim_mirage::run_mirage(hw, a.batch, a.kv_growth, a.max_alpha, a.json, a.plot)
        }
        SimCommand::Harvest(a) => super::sim_mirage::run_harvest(a.seed, a.json),
    }
}

fn run_tierkv(a: TierKvArgs) -> Result<ExitCode, strata::Error> {
    let hw = HardwareProfile::by_key(&a.hw).ok_or_else(|| bad("hardware profile", &a.hw))?;
    let model = ModelProfile::by_key(&a.model).ok_or_else(|| bad("model", &a.model))?;
    let workload = Workload::by_key(&a.workload).ok_or_else(|| bad("workload", &a.workload))?;
    let jobs: Vec<(f64, u64)> = a
        .levels
        .iter()
        .flat_map(|&l| (0..a.seeds).map(move |s| (l, a.seed + s)))
        .collect();
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(jobs.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} configurations  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<(usize, Vec<TierKvResult>)>> = Mutex::new(Vec::new());
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| loop {
                let j = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(level, seed)) = jobs.get(j) else {
                    break;
                };
                let mut cfg = TierKvConfig::paper(level, seed);
                cfg.hw = hw;
                cfg.model = model;
                cfg.workload = workload;
                cfg.lookahead = a.lookahead;
                cfg.queue_warming = !a.no_queue_warming;
                let r = tierkv::run(&cfg, &Policy::ALL);
                if let Ok(mut o) = out.lock() {
                    o.push((j, r));
                }
                bar.inc(1);
            });
        }
    });
    bar.finish_and_clear();
    let mut raw = out.into_inner().unwrap_or_default();
    raw.sort_by_key(|r| r.0);
    // Average seeds per (level, policy).
    let mut rows: Vec<TierKvResult> = Vec::new();
    for &level in &a.levels {
        for p in Policy::ALL {
            let same: Vec<TierKvResult> = raw
                .iter()
                .flat_map(|(_, v)| v.iter())
                .filter(|r| r.policy == p && r.oversubscription == level)
                .cloned()
                .collect();
            if !same.is_empty() {
                rows.push(tierkv::average(&same));
            }
        }
    }
    if a.json {
        let recs: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"policy\":\"{}\",\"oversubscription\":{},\"mean_tpot_ms\":{:.4},\"p95_tpot_ms\":{:.4},\"throughput_tok_s\":{:.1}}}",
                    r.policy.name(),
                    r.oversubscription,
                    r.mean_tpot_ms,
                    r.p95_tpot_ms,
                    r.throughput_tok_s
                )
            })
            .collect();
        println!("[{}]", recs.join(",\n "));
    } else {
        println!(
            "strata sim tierkv: {}, {}, {} workload, batch 32, 16-token blocks, K = {}, queue warming {}, {} seed(s) per level, {:.1} s",
            hw.name,
            model.name,
            a.workload,
            a.lookahead,
            if a.no_queue_warming { "off" } else { "on" },
            a.seeds,
            start.elapsed().as_secs_f64()
        );
        let table = |title: &str, f: &dyn Fn(&TierKvResult) -> String| {
            println!("\n{title}\n");
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
            println!("| ρ | {} |", names.join(" | "));
            println!("|---|{}", "---:|".repeat(names.len()));
            for &level in &a.levels {
                let cells: Vec<String> = Policy::ALL
                    .iter()
                    .map(|&p| {
                        rows.iter()
                            .find(|r| r.policy == p && r.oversubscription == level)
                            .map_or_else(|| "-".into(), f)
                    })
                    .collect();
                println!("| {level}× | {} |", cells.join(" | "));
            }
        };
        table("Mean TPOT (ms)", &|r| format!("{:.2}", r.mean_tpot_ms));
        table("P95 TPOT (ms)", &|r| format!("{:.2}", r.p95_tpot_ms));
        table("Throughput (tokens/s)", &|r| {
            format!("{:.0}", r.throughput_tok_s)
        });
        table("Demand-fetched / prefetched blocks", &|r| {
            format!("{} / {}", r.demand_blocks, r.prefetched_blocks)
        });
        if a.hw == "h100" && a.workload == "mixed" {
            print_tierkv_vs_paper(&a, &rows);
        }
    }
    if let Some(path) = &a.plot {
        let colors = ["#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#1f77b4"];
        let series: Vec<Series<'_>> = Policy::ALL
            .iter()
            .zip(colors)
            .map(|(&p, c)| Series {
                name: p.name(),
                color: c,
                points: rows
                    .iter()
                    .filter(|r| r.policy == p)
                    .map(|r| (r.oversubscription, r.mean_tpot_ms))
                    .collect(),
            })
            .collect();
        write_chart(
            path,
            "strata sim tierkv: mean TPOT vs oversubscription",
            "ρ",
            "ms",
            &series,
        )?;
        if !a.json {
            println!("\nplot: {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Ours next to TierKV's published tables, for the paper's setup (H100, mixed workload).
fn print_tierkv_vs_paper(a: &TierKvArgs, rows: &[TierKvResult]) {
    let ours = |p: Policy, level: f64| {
        rows.iter()
            .find(|r| r.policy == p && r.oversubscription == level)
    };
    let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
    let compare = |title: &str,
                   levels: &[f64],
                   paper: &dyn Fn(Policy, f64) -> Option<f64>,
                   mine: &dyn Fn(&TierKvResult) -> f64,
                   digits: usize| {
        let shown: Vec<f64> = levels
            .iter()
            .copied()
            .filter(|&l| Policy::ALL.iter().any(|&p| paper(p, l).is_some()))
            .collect();
        if shown.is_empty() {
            return;
        }
        println!("\n{title} (ours / paper)\n");
        println!("| ρ | {} |", names.join(" | "));
        println!("|---|{}", "---:|".repeat(names.len()));
        for l in shown {
            let cells: Vec<String> = Policy::ALL
                .iter()
                .map(|&p| match (ours(p, l), paper(p, l)) {
                    (Some(r), Some(q)) => format!("{:.*} / {:.*}", digits, mine(r), digits, q),
                    _ => "-".into(),
                })
                .collect();
            println!("| {l}× | {} |", cells.join(" | "));
        }
    };
    println!("\nAgainst TierKV (seed 002), as published:");
    if a.model == "7b" {
        compare(
            "Mean TPOT, ms, Table 5",
            &a.levels,
            &tierkv::paper::mean_tpot_ms,
            &|r| r.mean_tpot_ms,
            2,
        );
        compare(
            "Throughput, tokens/s, Table 7",
            &a.levels,
            &tierkv::paper::throughput,
            &|r| r.throughput_tok_s,
            0,
        );
    }
    compare(
        &format!("Mean TPOT at 3x, ms, Table 4 ({})", a.model),
        &a.levels,
        &|p, l| {
            if l == 3.0 {
                tierkv::paper::model_scaling_ms(p, &a.model)
            } else {
                None
            }
        },
        &|r| r.mean_tpot_ms,
        2,
    );
    let target = |p: Policy| ours(p, 5.0).map(|r| r.mean_tpot_ms);
    if let (Some(lru), Some(pre), Some(orc)) = (
        target(Policy::Lru),
        target(Policy::Prefetch),
        target(Policy::Oracle),
    ) {
        println!(
            "\nAt 5x: prefetch / oracle = {:.3} (paper {:.3}); LRU / prefetch = {:.2}x (paper {:.1}x).",
            pre / orc,
            4.07 / 4.03,
            lru / pre,
            192.47 / 4.07
        );
    }
    println!("Why they differ (SIMULATION.md has the details):");
    for w in tierkv::paper::WHY {
        println!("- {w}");
    }
}
