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
    /// Backend, devices, granularity and capacities.
    Info,
    /// The main job: a KV-serving workload through KvSpace and the caching allocator.
    Demo(cli::demo::DemoArgs),
}

fn main() -> ExitCode {
    let args = Args::parse();
    let outcome = match args.command {
        Command::Info => cli::info::run(),
        Command::Demo(demo) => cli::demo::run(demo),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("strata: {e}");
            ExitCode::FAILURE
        }
    }
}
