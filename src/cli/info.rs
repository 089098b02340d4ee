//! `strata info`: what the selected backend sees, and its tier links measured now.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use comfy_table::Table;
use strata::tiers::calibrate::{self, CalibrationConfig, LinkFit};
use strata::vmm::{self, Location};

use super::size;

#[derive(Args)]
pub struct InfoArgs {
    /// Directory in which to time the disk tier (a scratch file, removed afterwards); the
    /// system's temporary directory by default.
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Skip measuring the links (host↔HBM, disk).
    #[arg(long)]
    pub no_measure: bool,
}

pub fn run(args: InfoArgs) -> Result<ExitCode, strata::Error> {
    let (backend, fallback) = vmm::from_env_explained()?;
    println!("backend: {}", backend.kind());
    if let Some(why) = fallback {
        println!("cuda: not used ({why}); auto selected the host emulation");
    }
    println!("devices: {}", backend.device_count());
    let mut table = Table::new();
    table.set_header(["device", "name", "total", "free", "granularity"]);
    for d in 0..backend.device_count() {
        let info = backend.device_info(d)?;
        let mem = backend.mem_info(d)?;
        table.add_row([
            d.to_string(),
            info.name,
            size(mem.total),
            size(mem.free),
            size(backend.granularity(Location::Device(d))?),
        ]);
    }
    println!("{table}");
    match backend.granularity(Location::Host) {
        Ok(g) => println!("host memory granularity: {}", size(g)),
        Err(e) => println!("host memory as VMM allocations: unavailable ({e})"),
    }
    if args.no_measure || backend.device_count() == 0 {
        return Ok(ExitCode::SUCCESS);
    }
    let config = CalibrationConfig {
        disk_dir: Some(args.disk_dir.unwrap_or_else(std::env::temp_dir)),
        ..CalibrationConfig::default()
    };
    let sizes: Vec<String> = config.sizes.iter().map(|&s| size(s)).collect();
    println!(
        "tier links of device 0, measured now (backend copies of {}, median of {}, least squares):",
        sizes.join(", "),
        config.repetitions
    );
    match calibrate::measure(&backend, 0, &config) {
        Ok(links) => {
            let mut table = Table::new();
            table.set_header(["link", "bandwidth", "latency"]);
            let disk = if links.disk_direct {
                "O_DIRECT"
            } else {
                "buffered"
            };
            let rows = [
                ("host → HBM".to_string(), Some(links.host_to_hbm)),
                ("HBM → host".to_string(), Some(links.hbm_to_host)),
                (format!("disk → host ({disk})"), links.disk_read),
                (format!("host → disk ({disk})"), links.disk_write),
            ];
            for (name, link) in rows {
                if let Some(link) = link {
                    table.add_row([name, rate(&link), format!("{:.1?}", link.latency)]);
                }
            }
            println!("{table}");
            if let Some(dir) = &config.disk_dir {
                println!("disk measured in {}", dir.display());
            }
        }
        Err(e) => println!("  not measured: {e}"),
    }
    Ok(ExitCode::SUCCESS)
}

fn rate(link: &LinkFit) -> String {
    format!("{:.2} GB/s", link.bandwidth / 1e9)
}
