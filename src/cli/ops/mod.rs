//! `strata ps`, `top`, `limit` and `metrics`: what every strata process of this user publishes
//! (`strata-ops`), read from its folder (`/dev/shm/strata-<uid>/`, or `STRATA_SHM_DIR`).
//!
//! Exit status: 0 done, 1 the folder or the process failed, 2 bad input (an unknown pid or
//! device, a bad size).

use std::process::ExitCode;

use strata_ops::{read_all, DeviceFigures, Folder, FolderError, Listing, ProcessFigures};

pub mod limit;
pub mod metrics;
pub mod ps;
pub mod top;

/// Exit status of bad input.
pub const BAD_INPUT: u8 = 2;

/// This user's folder and what it holds now; warnings (skipped files) go to stderr.
pub fn listing() -> Result<(Folder, Listing), FolderError> {
    let folder = Folder::from_env()?;
    let listing = read_all(&folder)?;
    for w in &listing.warnings {
        eprintln!("strata: warning: {w}");
    }
    Ok((folder, listing))
}

/// A folder error as the commands report it.
pub fn failed(e: impl std::fmt::Display) -> Result<ExitCode, strata::Error> {
    eprintln!("strata: {e}");
    Ok(ExitCode::FAILURE)
}

/// One process (one library of it) on one device; a process with no device yet has one row
/// without.
pub struct Row<'a> {
    pub process: &'a ProcessFigures,
    pub device: Option<&'a DeviceFigures>,
}

impl Row<'_> {
    /// The row's identity across refreshes.
    pub fn key(&self) -> (u32, String, Option<u32>) {
        (
            self.process.pid,
            self.process.library.clone(),
            self.device.map(|d| d.device),
        )
    }

    /// A figure of the device, 0 without one.
    pub fn get(&self, f: impl Fn(&DeviceFigures) -> u64) -> u64 {
        self.device.map_or(0, f)
    }
}

/// Every process and device, in the listing's order.
pub fn rows(listing: &Listing) -> Vec<Row<'_>> {
    listing
        .processes
        .iter()
        .flat_map(|p| {
            let devices: Vec<Option<&DeviceFigures>> = if p.devices.is_empty() {
                vec![None]
            } else {
                p.devices.iter().map(Some).collect()
            };
            devices
                .into_iter()
                .map(move |device| Row { process: p, device })
        })
        .collect()
}
