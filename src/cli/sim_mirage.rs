//! `strata sim mirage`: MIRAGE Figure 15 setup, throughput with m = α+1, α+2 and the dynamic
//! choice as α grows; `strata sim harvest`: Harvest Figures 3 and 7, peer vs host fetch latency.

use std::path::PathBuf;
use std::process::ExitCode;

use super::chart::{write_chart, Series};
use strata::sim::harvest::{self, HarvestConfig};
use strata::sim::hw::HardwareProfile;
use strata::sim::mirage::{self, Choice, MirageConfig};

pub fn run_mirage(
    hw: HardwareProfile,
    batch: u64,
    kv_growth: bool,
    max_alpha: u32,
    json: bool,
    plot: Option<PathBuf>,
) -> Result<ExitCode, strata::Error> {
    let mut cfg = MirageConfig::opt13b(hw);
    cfg.batch = batch;
    cfg.kv_growth = kv_growth;
    let alphas: Vec<u32> = (1..=max_alpha.min(cfg.layers - 1)).collect();
    let rows = mirage::sweep(&cfg, &alphas);
    let buf = |r: &mirage::MirageRow| match r.buffering {
        Some(b) => b.beta(),
        None => 0,
    };
    if json {
        let recs: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"alpha\":{},\"choice\":\"{}\",\"batch\":{},\"beta\":{},\"m\":{},\"throughput_tok_s\":{:.1},\"step_ms\":{:.4},\"stall_share\":{:.4},\"link_gb_per_step\":{:.3}}}",
                    r.alpha, r.choice.name(), r.batch, buf(r), r.m, r.throughput, r.step_ms, r.stall_share, r.link_gb_per_step
                )
            })
            .collect();
        println!("[{}]", recs.join(",\n "));
    } else {
        println!(
            "strata sim mirage: {}, {} (n = {}), batch {}{}, context {}; T_T = {:.3} ms, T_c = {:.3} ms; all layers resident: {:.0} tok/s\n",
            hw.name,
            cfg.model,
            cfg.layers,
            cfg.batch,
            if cfg.kv_growth {
                " growing with the freed memory"
            } else {
                ""
            },
            cfg.context,
            cfg.t_t() * 1e3,
            cfg.t_c() * 1e3,
            mirage::resident_throughput(&cfg)
        );
        println!(
            "| α | batch | m = α+1 (tok/s) | stall | m = α+2 (tok/s) | stall | dynamic | dynamic (tok/s) |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---|---:|");
        for &a in &alphas {
            let get = |c: Choice| rows.iter().find(|r| r.alpha == a && r.choice == c);
            let cell = |c: Choice| {
                get(c).map_or_else(
                    || ("-".to_string(), "-".to_string()),
                    |r| {
                        (
                            format!("{:.0}", r.throughput),
                            format!("{:.1}%", 100.0 * r.stall_share),
                        )
                    },
                )
            };
            let (s, ss) = cell(Choice::Single);
            let (d, ds) = cell(Choice::Double);
            let (dyn_m, dyn_t) = get(Choice::Dynamic).map_or_else(
                || ("none (Eq. 4, 5 fail)".to_string(), "-".to_string()),
                |r| (format!("m = α+{}", buf(r)), format!("{:.0}", r.throughput)),
            );
            println!(
                "| {a} | {} | {s} | {ss} | {d} | {ds} | {dyn_m} | {dyn_t} |",
                cfg.batch_at(a)
            );
        }
        print_mirage_vs_paper(&rows, cfg.kv_growth);
    }
    if let Some(path) = &plot {
        let colors = ["#d62728", "#1f77b4", "#2ca02c"];
        let series: Vec<Series<'_>> = Choice::ALL
            .iter()
            .zip(colors)
            .map(|(&c, color)| Series {
                name: c.name(),
                color,
                points: rows
                    .iter()
                    .filter(|r| r.choice == c)
                    .map(|r| (f64::from(r.alpha), r.throughput))
                    .collect(),
            })
            .collect();
        write_chart(
            path,
            "strata sim mirage: throughput vs α (remapped layers)",
            "α",
            "tok/s",
            &series,
        )?;
        if !json {
            println!("\nplot: {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Ours next to MIRAGE's Figure 15 and §5.4.
fn print_mirage_vs_paper(rows: &[mirage::MirageRow], kv_growth: bool) {
    let switch = rows
        .iter()
        .find(|r| r.choice == Choice::Dynamic && r.buffering.is_some_and(|b| b.beta() == 2))
        .map(|r| r.alpha);
    let worst = rows
        .iter()
        .filter(|r| r.choice == Choice::Single)
        // Only where the planner accepts α (beyond it both fixed choices stall).
        .filter(|s| {
            rows.iter()
                .any(|d| d.alpha == s.alpha && d.choice == Choice::Dynamic)
        })
        .filter_map(|s| {
            rows.iter()
                .find(|d| d.alpha == s.alpha && d.choice == Choice::Double)
                .map(|d| (s.alpha, 1.0 - s.throughput / d.throughput))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1));
    println!("\nAgainst MIRAGE (seed 001), as published:");
    match switch {
        Some(a) => println!(
            "- the dynamic choice switches to m = α+2 at α = {a}; paper: m = α+2 is better \"when α ≥ 9\" for n = 40 (§5.4)."
        ),
        None => println!(
            "- the dynamic choice never switches to m = α+2 in this range; paper: from α ≥ 9 for n = 40 (§5.4)."
        ),
    }
    if let Some((a, loss)) = worst {
        println!(
            "- always m = α+1 loses up to {:.1}% against m = α+2 where the planner accepts α (at α = {a}); paper: 12.7% (Fig. 15).",
            100.0 * loss
        );
    }
    if kv_growth {
        println!("- why: the batch grows only by whole 1024-token requests in the freed memory, and the link carries only reloads; the paper's batch, context, T_T and T_c are not given (SIMULATION.md).");
    } else {
        println!("- why: the batch is fixed here (--kv-growth lets the freed memory admit requests) and the link carries only reloads; the paper's T_T and T_c are not given (SIMULATION.md).");
    }
}

pub fn run_harvest(seed: u64, json: bool) -> Result<ExitCode, strata::Error> {
    let cfg = HarvestConfig::paper(seed);
    let rows = harvest::run(&cfg);
    if json {
        let recs: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"chunk\":\"{}\",\"bytes\":{},\"host_us\":{:.3},\"peer_us\":{:.3},\"speedup\":{:.3},\"on_peer\":{},\"count\":{},\"placed_mean_us\":{:.3}}}",
                    r.chunk.name, r.chunk.bytes, r.host_us, r.peer_us, r.speedup(), r.on_peer, r.count, r.placed_mean_us
                )
            })
            .collect();
        println!("[{}]", recs.join(",\n "));
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "strata sim harvest: peer HBM over {} ({:.0} GB/s), host DRAM over {} ({:.0} GB/s); {} peers with {}–{} MiB harvestable (seed {}), {} chunks of each kind placed by fit::rank\n",
        cfg.peer_hw.name,
        cfg.peer_hw.host_link_bw / 1e9,
        cfg.host_hw.name,
        cfg.host_hw.host_link_bw / 1e9,
        cfg.peers,
        cfg.harvestable.0 >> 20,
        cfg.harvestable.1 >> 20,
        seed,
        cfg.count
    );
    println!("| chunk | size (MiB) | host PCIe (µs) | peer NVLink (µs) | speedup | placed on peer | placed mean (µs) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.3} | {:.1} | {:.1} | {:.2}× | {}/{} | {:.1} |",
            r.chunk.name,
            r.chunk.bytes as f64 / 1048576.0,
            r.host_us,
            r.peer_us,
            r.speedup(),
            r.on_peer,
            r.count,
            r.placed_mean_us
        );
    }
    let range = |pick: &dyn Fn(&harvest::HarvestRow) -> bool| {
        rows.iter()
            .filter(|r| pick(r))
            .map(harvest::HarvestRow::speedup)
            .fold(None, |acc: Option<(f64, f64)>, x| {
                Some(acc.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))))
            })
    };
    println!("\nAgainst Harvest (seed 000), as published:");
    if let Some((lo, hi)) = range(&|r| r.chunk.name.starts_with("expert")) {
        println!("- expert chunks, peer over host: ours {lo:.2}x-{hi:.2}x; paper 7.5x (Tiny Phi) to 9.5x (Mixtral 8x7B) (Fig. 3).");
    }
    if let Some((lo, hi)) = range(&|r| r.chunk.name.contains("entries")) {
        println!("- MLA KV entries: ours {lo:.2}x-{hi:.2}x; paper 5.42x (100 entries) to 5.68x (8000) for Kimi-K2 (Fig. 7).");
    }
    println!(
        "- why: ours is bounded by the bandwidth ratio ({:.2}x); the paper's expert speedups exceed the nominal ratio (a slower measured PCIe path), and its KV speedups suggest per-copy overheads our 1 µs latencies understate (SIMULATION.md).",
        cfg.peer_hw.host_link_bw / cfg.host_hw.host_link_bw
    );
    Ok(ExitCode::SUCCESS)
}
