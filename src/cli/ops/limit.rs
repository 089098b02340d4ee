//! `strata limit <pid>[:<device>] <size>|none`.

use std::process::ExitCode;

use clap::Args;
use strata_ops::{parse_limit, request_limit, Folder, LimitError};

use super::{failed, BAD_INPUT};
use crate::cli::size;

#[derive(Args)]
pub struct LimitArgs {
    /// The process (`strata ps`), and optionally one device (`1234:0`; every device it uses
    /// without).
    pub target: String,
    /// The cap on the device memory strata holds for it: bytes (`512MiB`, `1.5GiB`, `2GB`,
    /// `1048576`), a fraction of the device (`0.5`), or `none`.
    #[arg(allow_hyphen_values = true)]
    pub size: String,
}

fn bad(message: String) -> Result<ExitCode, strata::Error> {
    eprintln!("strata: {message}");
    Ok(ExitCode::from(BAD_INPUT))
}

/// `pid` or `pid:device`.
fn target(text: &str) -> Option<(u32, Option<u32>)> {
    match text.split_once(':') {
        Some((pid, device)) => Some((pid.parse().ok()?, Some(device.parse().ok()?))),
        None => Some((text.parse().ok()?, None)),
    }
}

pub fn run(args: LimitArgs) -> Result<ExitCode, strata::Error> {
    let Some((pid, device)) = target(&args.target) else {
        return bad(format!(
            "bad target {:?}: give a pid or pid:device (`1234`, `1234:0`)",
            args.target
        ));
    };
    let limit = match parse_limit(&args.size) {
        Ok(l) => l,
        Err(e) => return bad(e.to_string()),
    };
    let folder = match Folder::from_env() {
        Ok(f) => f,
        Err(e) => return failed(e),
    };
    match request_limit(&folder, pid, device, limit) {
        Ok(applied) => {
            for (library, device, bytes) in applied {
                let cap = bytes.map_or("none".into(), size);
                println!("pid {pid} ({library}) device {device}: limit {cap}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ (LimitError::UnknownProcess(_) | LimitError::UnknownDevice { .. })) => {
            bad(e.to_string())
        }
        Err(e) => failed(e),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn targets_parse() {
        assert_eq!(super::target("12"), Some((12, None)));
        assert_eq!(super::target("12:1"), Some((12, Some(1))));
        for bad in ["", "x", "12:", ":1", "12:x", "-1"] {
            assert_eq!(super::target(bad), None, "{bad:?}");
        }
    }
}
