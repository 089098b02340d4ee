//! The profile file: one `key=value` per line, `#` comments, blank lines ignored.
//!
//! - `base=none|a100|h200` (first, optional): start from that profile;
//! - `<call>=<µs>` for each [`Call::key`] (`create=193`, `map=1.5`, ...);
//! - `h2d_gbps`, `d2h_gbps`, `d2d_gbps` = GB/s (10⁹ bytes per second) of copies in that
//!   direction; `0` turns charging that direction off.

use std::time::Duration;

use crate::{Call, Direction, Profile};

impl Profile {
    /// Parses a profile file's text (see the module documentation of `file.rs`).
    pub fn parse_file(text: &str) -> Result<Profile, String> {
        let mut profile = Profile::none();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let at = |e: String| format!("line {}: {e}", n + 1);
            let (key, value) = line
                .split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| at(format!("{line:?} is not key=value")))?;
            if key == "base" {
                let name = std::mem::take(&mut profile.name);
                profile = match value {
                    "none" | "a100" | "h200" => Profile::parse(value).map_err(at)?,
                    other => return Err(at(format!("unknown base {other:?}"))),
                };
                profile.name = name;
                continue;
            }
            let number: f64 = value
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| at(format!("{value:?} is not a non-negative number")))?;
            let direction = match key {
                "h2d_gbps" => Some(Direction::HostToDevice),
                "d2h_gbps" => Some(Direction::DeviceToHost),
                "d2d_gbps" => Some(Direction::DeviceToDevice),
                _ => None,
            };
            if let Some(d) = direction {
                profile.set_bandwidth(d, Some(number * 1e9));
                continue;
            }
            let call = Call::ALL
                .into_iter()
                .find(|c| c.key() == key)
                .ok_or_else(|| at(format!("unknown key {key:?}")))?;
            profile.set(call, Duration::from_nanos((number * 1000.0) as u64));
        }
        Ok(profile)
    }
}
