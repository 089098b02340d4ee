//! Configuration of the host backend, from the environment or built in code.

use std::time::Duration;

use strata_latency::Profile;

use crate::error::{Error, Result};

/// Default emulated device: one 8 GiB device.
pub const DEFAULT_DEVICES: &str = "1x8GiB";
/// Default granularity, as on A100/H100-class GPUs.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

/// Bandwidth and latency of one kind of transfer in the optional link model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes per second.
    pub bandwidth: f64,
    /// Fixed cost per copy.
    pub latency: Duration,
}

/// Optional link model: when set, stream workers take `latency + len / bandwidth` per copy,
/// so tier moves take realistic relative time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    pub host_to_device: Link,
    pub device_to_host: Link,
    pub device_to_device: Link,
}

/// Everything the host backend needs to start.
#[derive(Clone, Debug, PartialEq)]
pub struct HostConfig {
    /// Capacity in bytes of each emulated device.
    pub devices: Vec<u64>,
    /// Mapping granularity (a power of two, a multiple of the OS page size).
    pub granularity: u64,
    /// Strict mode: device memory is never CPU-accessible through the user VA.
    pub strict: bool,
    /// Optional link model.
    pub link: Option<LinkModel>,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            devices: vec![8 << 30],
            granularity: DEFAULT_GRANULARITY,
            strict: false,
            link: None,
        }
    }
}

impl HostConfig {
    /// Reads `STRATA_HOST_DEVICES` (e.g. `2x8GiB` or `8GiB,4GiB`), `STRATA_HOST_GRANULARITY`
    /// (default `2MiB`), `STRATA_HOST_STRICT` (`1` enables strict mode) and
    /// `STRATA_HOST_LINK` (`BANDWIDTH[,LATENCY]`, e.g. `25GB,5us`, applied to every direction).
    pub fn from_env() -> Result<Self> {
        let devices = parse_devices(DEFAULT_DEVICES)
            .map_err(|r| config("STRATA_HOST_DEVICES", DEFAULT_DEVICES, r))?;
        Self::from_env_or(&devices)
    }

    /// As [`HostConfig::from_env`], with `devices` as the capacities when
    /// `STRATA_HOST_DEVICES` is not set.
    pub fn from_env_or(devices: &[u64]) -> Result<Self> {
        let var = |name: &'static str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let devices = match var("STRATA_HOST_DEVICES") {
            Some(v) => {
                parse_devices(&v).map_err(|reason| config("STRATA_HOST_DEVICES", &v, reason))?
            }
            None => devices.to_vec(),
        };
        let granularity = match var("STRATA_HOST_GRANULARITY") {
            Some(v) => parse_granularity(&v)
                .map_err(|reason| config("STRATA_HOST_GRANULARITY", &v, reason))?,
            None => DEFAULT_GRANULARITY,
        };
        let strict = match var("STRATA_HOST_STRICT").as_deref() {
            None | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(v) => return Err(config("STRATA_HOST_STRICT", v, "expected 0 or 1".into())),
        };
        let link = match var("STRATA_HOST_LINK") {
            Some(v) => {
                Some(parse_link(&v).map_err(|reason| config("STRATA_HOST_LINK", &v, reason))?)
            }
            None => None,
        };
        Ok(HostConfig {
            devices,
            granularity,
            strict,
            link,
        })
    }
}

/// What the host backend reads besides [`HostConfig`]: the latency profile
/// (`STRATA_HOST_LATENCY`, `none` when unset) and whether imported handles are refused
/// (`STRATA_HOST_IMPORTED_MAPS`: `allow`, the default, or `refuse`).
pub(super) fn driver_env() -> Result<(Profile, bool)> {
    let var = |name: &'static str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let latency = Profile::from_env().map_err(|reason| {
        config(
            "STRATA_HOST_LATENCY",
            &var("STRATA_HOST_LATENCY").unwrap_or_default(),
            reason,
        )
    })?;
    let refuse = match var("STRATA_HOST_IMPORTED_MAPS").as_deref() {
        None | Some("allow") => false,
        Some("refuse") => true,
        Some(v) => {
            return Err(config(
                "STRATA_HOST_IMPORTED_MAPS",
                v,
                "expected allow or refuse".into(),
            ))
        }
    };
    Ok((latency, refuse))
}

fn config(name: &'static str, value: &str, reason: String) -> Error {
    Error::Config {
        name,
        value: value.to_string(),
        reason,
    }
}

/// Parses a byte size such as `8GiB`, `512MiB`, `2MiB` or `4096`.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    text.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("{text:?} is not a size: {e}"))
}

/// Parses `NxSIZE` or a comma-separated list of sizes.
pub fn parse_devices(text: &str) -> std::result::Result<Vec<u64>, String> {
    let mut devices = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        if let Some((count, size)) = part
            .split_once(['x', 'X'])
            .filter(|(c, _)| c.chars().all(|ch| ch.is_ascii_digit()) && !c.is_empty())
        {
            let count: usize = count
                .parse()
                .map_err(|e| format!("bad count {count:?}: {e}"))?;
            let size = parse_size(size)?;
            devices.extend(std::iter::repeat_n(size, count));
        } else {
            devices.push(parse_size(part)?);
        }
    }
    if devices.is_empty() || devices.len() > 64 {
        return Err(format!("expected 1 to 64 devices, got {}", devices.len()));
    }
    if devices.contains(&0) {
        return Err("a device needs a capacity above zero".into());
    }
    Ok(devices)
}

fn parse_granularity(text: &str) -> std::result::Result<u64, String> {
    let g = parse_size(text)?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let os_page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    if !g.is_power_of_two() || g < os_page {
        return Err(format!(
            "granularity must be a power of two of at least {os_page} bytes"
        ));
    }
    Ok(g)
}

fn parse_link(text: &str) -> std::result::Result<LinkModel, String> {
    let mut parts = text.split(',');
    let bandwidth = parse_size(parts.next().unwrap_or_default())? as f64;
    if bandwidth <= 0.0 {
        return Err("bandwidth must be positive".into());
    }
    let latency = match parts.next() {
        Some(l) => parse_duration(l.trim())?,
        None => Duration::ZERO,
    };
    let link = Link { bandwidth, latency };
    Ok(LinkModel {
        host_to_device: link,
        device_to_host: link,
        device_to_device: link,
    })
}

fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    let (number, scale) = if let Some(n) = text.strip_suffix("ns") {
        (n, 1e-9)
    } else if let Some(n) = text.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(format!("{text:?} needs a unit (ns, us, ms, s)"));
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|e| format!("{text:?}: {e}"))?;
    if !(value.is_finite() && value >= 0.0) {
        return Err(format!("{text:?} is not a duration"));
    }
    Ok(Duration::from_secs_f64(value * scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_in_both_forms() {
        assert_eq!(parse_devices("2x8GiB").unwrap(), vec![8 << 30, 8 << 30]);
        assert_eq!(
            parse_devices("8GiB, 512MiB").unwrap(),
            vec![8 << 30, 512 << 20]
        );
        assert!(parse_devices("0x8GiB").is_err());
        assert!(parse_devices("2xlots").is_err());
        assert!(parse_devices("0").is_err());
    }

    #[test]
    fn granularity_must_be_a_power_of_two() {
        assert_eq!(parse_granularity("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_granularity("64KiB").unwrap(), 64 << 10);
        assert!(parse_granularity("3MiB").is_err());
        assert!(parse_granularity("1").is_err());
    }

    #[test]
    fn link_parses_bandwidth_and_latency() {
        let m = parse_link("25GB,5us").unwrap();
        assert_eq!(m.host_to_device.bandwidth, 25e9);
        assert_eq!(m.host_to_device.latency, Duration::from_micros(5));
        assert!(parse_link("25GB,5").is_err());
    }
}
