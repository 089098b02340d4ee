//! `strata ps`: one line per process and device, or JSON objects (`--json`).

use std::process::ExitCode;

use clap::Args;
use comfy_table::Table;
use serde::Serialize;
use strata_ops::{KvFigures, TagState, TierBytes};

use super::{failed, listing, rows, Row};
use crate::cli::size;

#[derive(Args)]
pub struct PsArgs {
    /// A JSON list of objects (one per process and device) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One row of `--json`.
#[derive(Serialize)]
struct PsJson<'a> {
    pid: u32,
    library: &'a str,
    command: &'a str,
    backend: &'a str,
    /// `null` while the process has used no device yet.
    device: Option<u32>,
    total_bytes: u64,
    reserved_bytes: u64,
    allocated_bytes: u64,
    /// The peak of allocated bytes (`peak_reserved_bytes`: of reserved ones).
    peak_bytes: u64,
    peak_reserved_bytes: u64,
    limit_bytes: Option<u64>,
    allocs: u64,
    frees: u64,
    ooms: u64,
    tiers: TierBytes,
    moved_bytes: u64,
    pool_in_use_bytes: u64,
    lent_bytes: u64,
    borrowed_bytes: u64,
    tags: Vec<TagJson<'a>>,
    kv_spaces: &'a [KvFigures],
    limit_error: Option<&'a str>,
    updated_unix_ms: u64,
}

#[derive(Serialize)]
struct TagJson<'a> {
    name: &'a str,
    state: TagState,
    /// Everything the tag holds: its pages on every tier and its sleeping copies.
    bytes: u64,
    allocated_bytes: u64,
    tiers: TierBytes,
}

fn total(t: &TierBytes) -> u64 {
    t.device + t.peer + t.host + t.disk
}

fn json_row<'a>(r: &Row<'a>) -> PsJson<'a> {
    let p = r.process;
    let d = r.device;
    PsJson {
        pid: p.pid,
        library: &p.library,
        command: &p.command,
        backend: &p.backend,
        device: d.map(|d| d.device),
        total_bytes: r.get(|d| d.total_bytes),
        reserved_bytes: r.get(|d| d.reserved_bytes),
        allocated_bytes: r.get(|d| d.allocated_bytes),
        peak_bytes: r.get(|d| d.peak_allocated_bytes),
        peak_reserved_bytes: r.get(|d| d.peak_reserved_bytes),
        limit_bytes: d.and_then(|d| d.limit_bytes),
        allocs: r.get(|d| d.allocs),
        frees: r.get(|d| d.frees),
        ooms: r.get(|d| d.ooms),
        tiers: d.map(|d| d.tiers).unwrap_or_default(),
        moved_bytes: r.get(|d| d.moved_bytes),
        pool_in_use_bytes: r.get(|d| d.pool_in_use_bytes),
        lent_bytes: r.get(|d| d.lent_bytes),
        borrowed_bytes: r.get(|d| d.borrowed_bytes),
        tags: d.map_or(Vec::new(), |d| {
            d.tags
                .iter()
                .map(|t| TagJson {
                    name: &t.name,
                    state: t.state,
                    bytes: total(&t.bytes),
                    allocated_bytes: t.allocated_bytes,
                    tiers: t.bytes,
                })
                .collect()
        }),
        kv_spaces: d.map_or(&[], |d| &d.kv_spaces),
        limit_error: p.limit_error.as_deref(),
        updated_unix_ms: p.updated_unix_ms,
    }
}

pub fn run(args: PsArgs) -> Result<ExitCode, strata::Error> {
    let (_, listing) = match listing() {
        Ok(l) => l,
        Err(e) => return failed(e),
    };
    let rows = rows(&listing);
    if args.json {
        let json: Vec<PsJson<'_>> = rows.iter().map(json_row).collect();
        return match serde_json::to_string_pretty(&json) {
            Ok(text) => {
                println!("{text}");
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => failed(e),
        };
    }
    let mut table = Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header([
        "PID",
        "LIB",
        "COMMAND",
        "DEV",
        "RESERVED",
        "ALLOCATED",
        "PEAK",
        "LIMIT",
        "HOST",
        "DISK",
        "LENT",
        "BORROWED",
        "OOMS",
        "TAGS",
        "KV",
    ]);
    for r in &rows {
        let d = r.device;
        let bytes = |f: fn(&strata_ops::DeviceFigures) -> u64| size(r.get(f));
        table.add_row([
            r.process.pid.to_string(),
            r.process.library.clone(),
            r.process.command.clone(),
            d.map_or("-".into(), |d| d.device.to_string()),
            bytes(|d| d.reserved_bytes),
            bytes(|d| d.allocated_bytes),
            bytes(|d| d.peak_allocated_bytes),
            d.and_then(|d| d.limit_bytes).map_or("none".into(), size),
            bytes(|d| d.tiers.host),
            bytes(|d| d.tiers.disk),
            bytes(|d| d.lent_bytes),
            bytes(|d| d.borrowed_bytes),
            r.get(|d| d.ooms).to_string(),
            d.map_or(0, |d| d.tags.len()).to_string(),
            d.map_or(0, |d| d.kv_spaces.len()).to_string(),
        ]);
    }
    if rows.is_empty() {
        println!("no strata processes of this user");
    } else {
        println!("{table}");
    }
    Ok(ExitCode::SUCCESS)
}
