//! `strata info`: what the selected backend sees.

use std::process::ExitCode;

use comfy_table::Table;
use strata::vmm::{self, Location};

use super::size;

pub fn run() -> Result<ExitCode, strata::Error> {
    let backend = vmm::from_env()?;
    println!("backend: {}", backend.kind());
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
    Ok(ExitCode::SUCCESS)
}
