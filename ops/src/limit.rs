//! `strata limit`: sizes as operators write them, and requests a process applies.

use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::folder::{Folder, FolderError, Owned};
use crate::layout::{LimitRequest, LimitValue, LAYOUT_VERSION};
use crate::reader::read_all;

/// How long [`request_limit`] waits for the process (it applies within two publishing
/// intervals when it runs).
const WAIT: Duration = Duration::from_secs(3);

/// Why a limit was not applied.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error("bad size {0:?}: give bytes with a unit (`512MiB`, `1.5GiB`, `2GB`, `1048576`), a fraction of the device in [0, 1] (`0.5`), or `none`")]
    BadSize(String),
    #[error("no strata process {0} of this user (see `strata ps`)")]
    UnknownProcess(u32),
    #[error("process {pid} uses no device {device} (it publishes {known:?})")]
    UnknownDevice {
        pid: u32,
        device: u32,
        known: Vec<u32>,
    },
    #[error(transparent)]
    Folder(#[from] FolderError),
    #[error("writing the request: {0}")]
    Io(#[from] std::io::Error),
    #[error("process {pid} did not take the request within {WAIT:?} (exited, or stuck)")]
    NotTaken { pid: u32 },
    #[error("process {pid} refused the limit: {why}")]
    Refused { pid: u32, why: String },
}

/// A size (`512MiB`, `1.5 GiB`, `2GB`, `1048576`), a fraction of the device (`0.5`: a number
/// with a decimal point and no unit, in [0, 1]), or `none`.
pub fn parse_limit(text: &str) -> Result<LimitValue, LimitError> {
    let t = text.trim();
    let bad = || LimitError::BadSize(text.to_string());
    if t.eq_ignore_ascii_case("none") {
        return Ok(LimitValue::None);
    }
    if t.contains('.') && t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        let f: f64 = t.parse().map_err(|_| bad())?;
        return if (0.0..=1.0).contains(&f) {
            Ok(LimitValue::Fraction(f))
        } else {
            Err(bad())
        };
    }
    if !t.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(bad());
    }
    bytesize::ByteSize::from_str(t)
        .map(|b| LimitValue::Bytes(b.as_u64()))
        .map_err(|_| bad())
}

/// Asks process `pid` (every library of it that publishes) to cap `device` (every device it
/// publishes when `None`) at `limit`, and waits until it did. Returns `(library, device,
/// limit_bytes)` as the process then reports them.
pub fn request_limit(
    folder: &Folder,
    pid: u32,
    device: Option<u32>,
    limit: LimitValue,
) -> Result<Vec<(String, u32, Option<u64>)>, LimitError> {
    let before = read_all(folder)?;
    let mine: Vec<_> = before.processes.iter().filter(|p| p.pid == pid).collect();
    if mine.is_empty() {
        return Err(LimitError::UnknownProcess(pid));
    }
    let mut requests = Vec::new();
    for p in &mine {
        let known: Vec<u32> = p.devices.iter().map(|d| d.device).collect();
        match device {
            Some(d) if known.contains(&d) => requests.push((p.library.clone(), d)),
            Some(_) => {}
            None => requests.extend(known.iter().map(|&d| (p.library.clone(), d))),
        }
    }
    if requests.is_empty() {
        let known = mine.iter().flat_map(|p| p.devices.iter().map(|d| d.device));
        return Err(LimitError::UnknownDevice {
            pid,
            device: device.unwrap_or(0),
            known: known.collect(),
        });
    }
    for (library, d) in &requests {
        let request = LimitRequest {
            version: LAYOUT_VERSION,
            device: *d,
            limit,
        };
        let bytes = serde_json::to_vec(&request).map_err(std::io::Error::other)?;
        folder.write(&Folder::limit_name(pid, library, *d), &bytes)?;
    }
    wait_taken(folder, pid, &requests)?;
    // The process writes its figures right after applying: read them once it has.
    let applied_after = mine.iter().map(|p| p.updated_unix_ms).max().unwrap_or(0);
    let deadline = Instant::now() + WAIT;
    loop {
        let now = read_all(folder)?;
        let fresh: Vec<_> = now
            .processes
            .iter()
            .filter(|p| p.pid == pid && p.updated_unix_ms > applied_after)
            .collect();
        if fresh.len() == mine.len() {
            if let Some(why) = fresh.iter().find_map(|p| p.limit_error.clone()) {
                return Err(LimitError::Refused { pid, why });
            }
            return Ok(requests
                .iter()
                .map(|(library, d)| {
                    let limit = fresh
                        .iter()
                        .filter(|p| &p.library == library)
                        .flat_map(|p| &p.devices)
                        .find(|f| f.device == *d)
                        .and_then(|f| f.limit_bytes);
                    (library.clone(), *d, limit)
                })
                .collect());
        }
        if Instant::now() > deadline {
            return Err(LimitError::NotTaken { pid });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the process removed every request (it removes one when it applies it).
fn wait_taken(folder: &Folder, pid: u32, requests: &[(String, u32)]) -> Result<(), LimitError> {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut pending = false;
        for (library, d) in requests {
            if let Owned::Bytes(_) = folder.read(&Folder::limit_name(pid, library, *d))? {
                pending = true;
            }
        }
        if !pending {
            return Ok(());
        }
        if Instant::now() > deadline {
            for (library, d) in requests {
                let _ = folder.remove(&Folder::limit_name(pid, library, *d));
            }
            return Err(LimitError::NotTaken { pid });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_fractions_and_none() {
        assert_eq!(parse_limit("none").unwrap(), LimitValue::None);
        assert_eq!(parse_limit("512MiB").unwrap(), LimitValue::Bytes(512 << 20));
        assert_eq!(parse_limit("1.5GiB").unwrap(), LimitValue::Bytes(3 << 29));
        assert_eq!(
            parse_limit("2GB").unwrap(),
            LimitValue::Bytes(2_000_000_000)
        );
        assert_eq!(parse_limit("1048576").unwrap(), LimitValue::Bytes(1 << 20));
        assert_eq!(parse_limit("0.5").unwrap(), LimitValue::Fraction(0.5));
        assert_eq!(parse_limit("1.0").unwrap(), LimitValue::Fraction(1.0));
        for bad in ["", "-1", "1.5", "lots", "12 parsecs", "0.5x", "MiB", "1..2"] {
            assert!(
                matches!(parse_limit(bad), Err(LimitError::BadSize(_))),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn fractions_resolve_like_set_memory_fraction() {
        assert_eq!(LimitValue::Fraction(0.5).resolve(1000), Some(500));
        assert_eq!(LimitValue::Fraction(1.0).resolve(1000), None);
        assert_eq!(LimitValue::Bytes(7).resolve(1000), Some(7));
        assert_eq!(LimitValue::None.resolve(1000), None);
    }
}
