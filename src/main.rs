//! The `strata` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

/// GPU memory virtualization on the CUDA virtual-memory API.
#[derive(Parser)]
#[command(name = "strata", version, about, long_about = None)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Backend, devices, granularity and capacities, and the tier links measured now.
    Info(cli::info::InfoArgs),
    /// The main job: an oversubscribed KV-serving workload across HBM, host memory and disk
    /// (`--classic`: the single-tier KvSpace and caching-allocator workload).
    Demo(cli::demo::DemoArgs),
    /// Benchmarks (`strata bench copy`, `strata bench migrate`, `strata bench replay`).
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
    /// The discrete-event simulator: `strata sim tierkv|kvpr|pie`.
    #[command(subcommand)]
    Sim(cli::sim::SimCommand),
    /// Every strata process of this user: one line per process and device (`--json`).
    Ps(cli::ops::ps::PsArgs),
    /// A live view of the strata processes, devices, tiers and tags (`--once`: one frame).
    Top(cli::ops::top::TopArgs),
    /// Caps the device memory a running process holds: `strata limit PID[:DEVICE] SIZE|none`.
    Limit(cli::ops::limit::LimitArgs),
    /// The processes' figures in the Prometheus text format (`--listen ADDR`: served).
    Metrics(cli::ops::metrics::MetricsArgs),
}

fn main() -> ExitCode {
    let args = Args::parse();
    let outcome = match args.command {
        Command::Info(info) => cli::info::run(info),
        Command::Demo(demo) => cli::demo::run(demo),
        Command::Bench(b) => cli::bench::run(b),
        Command::Sim(s) => cli::sim::run(s),
        Command::Ps(a) => cli::ops::ps::run(a),
        Command::Top(a) => cli::ops::top::run(a),
        Command::Limit(a) => cli::ops::limit::run(a),
        Command::Metrics(a) => cli::ops::metrics::run(a),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("strata: {e}");
            ExitCode::FAILURE
        }
    }
}
