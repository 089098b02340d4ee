//! `strata bench copy`: naive vs coalesced vs block-copy kernel for scattered blocks.
//! `strata bench migrate`: a mapped run moved to host pages and back at the same VA, next to a
//! bulk copy of the same bytes.

mod copy;
mod migrate;

use std::process::ExitCode;

use comfy_table::Table;
use strata::tiers::Submission;

use crate::cli::size;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Scattered blocks of 8 KiB, 32 KiB, 256 KiB and 2 MiB between host memory and HBM.
    Copy(CopyArgs),
    /// A mapped run moved to host-memory pages and back at the same VA, against one bulk copy
    /// of the same bytes between a host buffer and HBM, alternated round by round.
    Migrate(MigrateArgs),
    /// Replays recorded allocation traces: peak reserved ÷ peak allocated, time per operation.
    Replay(super::replay::ReplayArgs),
}

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// Bytes of the run (rounded up to whole pages).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    bytes: u64,
    /// Rounds (the median is reported).
    #[arg(long, default_value_t = 9)]
    reps: usize,
    #[arg(long, default_value_t = 0)]
    device: u32,
}

#[derive(clap::Args)]
pub struct CopyArgs {
    /// Bytes moved per round.
    #[arg(long, default_value = "32MiB", value_parser = parse_size)]
    bytes: u64,
    /// Adjacent blocks per run (runs are placed at shuffled positions).
    #[arg(long, default_value_t = 16)]
    run: u64,
    /// Rounds per configuration (the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
    #[arg(long, default_value_t = 0)]
    device: u32,
}

fn parse_size(s: &str) -> Result<u64, String> {
    strata::vmm::host::parse_size(s)
}

pub fn run(cmd: BenchCommand) -> Result<ExitCode, strata::Error> {
    match cmd {
        BenchCommand::Copy(args) => run_copy(args),
        BenchCommand::Migrate(args) => run_migrate(args),
        BenchCommand::Replay(args) => super::replay::run(args),
    }
}

fn run_migrate(args: MigrateArgs) -> Result<ExitCode, strata::Error> {
    if args.reps == 0 {
        return Err(strata::Error::InvalidArgument(
            "--reps must be at least 1".into(),
        ));
    }
    let backend = strata::vmm::from_env()?;
    println!(
        "strata bench migrate: {} run, median of {} alternated rounds, {} backend",
        size(args.bytes),
        args.reps,
        backend.kind()
    );
    let r = migrate::migrate(&backend, args.device, args.bytes, args.reps)?;
    let mut table = Table::new();
    table.set_header(["operation", "time", "GB/s"]);
    for (what, time) in [
        ("migrate HBM -> host pages", r.offload),
        ("migrate host pages -> HBM", r.onload),
        ("copy HBM -> host buffer", r.copy_d2h),
        ("copy host buffer -> HBM", r.copy_h2d),
    ] {
        table.add_row([
            what.to_string(),
            format!("{:.3} ms", time.as_secs_f64() * 1e3),
            format!("{:.2}", migrate::gbps(r.bytes, time)),
        ]);
    }
    println!("{table}");
    Ok(ExitCode::SUCCESS)
}

fn run_copy(args: CopyArgs) -> Result<ExitCode, strata::Error> {
    let backend = strata::vmm::from_env()?;
    let sizes = [8 << 10, 32 << 10, 256 << 10, 2 << 20];
    println!(
        "strata bench copy: {} per round, runs of {} adjacent blocks at shuffled places, median of {} rounds, {} backend",
        size(args.bytes),
        args.run,
        args.reps,
        backend.kind()
    );
    let results = copy::copy(
        &backend,
        args.device,
        &sizes,
        args.bytes,
        args.run,
        args.reps,
    )?;
    let mut table = Table::new();
    table.set_header([
        "block",
        "blocks",
        "direction",
        "method",
        "descriptors",
        "time",
        "GB/s",
        "vs naive",
    ]);
    let mut naive = std::collections::HashMap::new();
    for r in &results {
        if r.method == Submission::Naive {
            naive.insert((r.block, format!("{:?}", r.direction)), r.time);
        }
    }
    for r in &results {
        let base = naive[&(r.block, format!("{:?}", r.direction))];
        table.add_row([
            size(r.block),
            r.blocks.to_string(),
            format!("{:?}", r.direction),
            format!("{:?}", r.method),
            r.descriptors.to_string(),
            format!("{:.3} ms", r.time.as_secs_f64() * 1e3),
            format!("{:.2}", r.gbps()),
            format!("{:.2}×", base.as_secs_f64() / r.time.as_secs_f64()),
        ]);
    }
    println!("{table}");
    Ok(ExitCode::SUCCESS)
}
