//! Tier links measured at start: "each tier has a capacity, a bandwidth and a latency
//! (configured, or measured at start)".
//!
//! [`measure`] times the backend's own copies (never a CPU dereference of device memory) between
//! a [`HostBuffer`] and a mapping on the device, host→HBM and HBM→host, and, given a directory,
//! the disk tier's file reads and writes. Each direction runs a few transfer sizes (64 KiB …
//! 16 MiB by default) a few times; the median time per size goes into a least-squares line
//! `time = latency + bytes / bandwidth` ([`fit`]): the intercept is the latency, the inverse of
//! the slope the bandwidth. [`StoreConfig::with_measured_links`] puts the result into a store's
//! configuration.
//!
//! Timings are measurements, not promises: on a loaded machine they are noisy, which is why the
//! fit uses medians and callers treat the numbers as estimates.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_vmm::{
    copy_async_in, Backend, CopyDesc, CopyKind, CopyScope, DeviceBuffer, Error, HostBuffer, Result,
    Stream,
};

use crate::disk::DiskFile;
use crate::store::{StoreConfig, TierSpec};

/// A fitted link: `time(bytes) = latency + bytes / bandwidth`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkFit {
    /// Bytes per second (the inverse of the slope).
    pub bandwidth: f64,
    /// Per-transfer latency (the intercept, never negative).
    pub latency: Duration,
}

impl LinkFit {
    /// The predicted time of one transfer of `bytes`.
    pub fn time(&self, bytes: u64) -> Duration {
        self.latency
            + Duration::try_from_secs_f64(bytes as f64 / self.bandwidth).unwrap_or_default()
    }
}

/// Fits `seconds = latency + bytes / bandwidth` to `(bytes, seconds)` samples by least squares,
/// weighted by `1 / seconds²` (relative errors): timing noise grows with the time, and without
/// the weights the largest transfers would swamp the small ones that carry the latency.
///
/// [`Error::InvalidArgument`] for fewer than two distinct sizes or a non-finite or negative time;
/// [`Error::InvalidState`] when the times do not grow with the size (no bandwidth to report). A
/// negative intercept (noise around a near-zero latency) is reported as zero latency.
pub fn fit(samples: &[(u64, f64)]) -> Result<LinkFit> {
    if samples.iter().any(|&(_, t)| !t.is_finite() || t < 0.0) {
        return Err(Error::InvalidArgument(
            "calibration times must be finite and non-negative".into(),
        ));
    }
    let weight = |t: f64| 1.0 / t.max(1e-9).powi(2);
    let total: f64 = samples.iter().map(|&(_, t)| weight(t)).sum();
    let mean = |f: &dyn Fn(f64, f64) -> f64| {
        samples
            .iter()
            .map(|&(b, t)| weight(t) * f(b as f64, t))
            .sum::<f64>()
            / total
    };
    let (mean_x, mean_y) = (mean(&|x, _| x), mean(&|_, y| y));
    let sxx = mean(&|x, _| (x - mean_x).powi(2));
    if samples.len() < 2 || sxx.is_nan() || sxx <= 0.0 {
        return Err(Error::InvalidArgument(
            "a link fit needs samples of at least two distinct sizes".into(),
        ));
    }
    let slope = mean(&|x, y| (x - mean_x) * (y - mean_y)) / sxx;
    if !(slope.is_finite() && slope > 0.0) {
        return Err(Error::InvalidState(format!(
            "transfer times do not grow with size (slope {slope:e} s/B): no bandwidth to fit"
        )));
    }
    let intercept = mean_y - slope * mean_x;
    Ok(LinkFit {
        bandwidth: 1.0 / slope,
        latency: Duration::try_from_secs_f64(intercept.max(0.0)).unwrap_or_default(),
    })
}

/// What [`measure`] runs.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrationConfig {
    /// Transfer sizes in bytes (multiples of 4096, at least two distinct).
    pub sizes: Vec<u64>,
    /// Timed runs per size (the median counts), after one untimed warm-up.
    pub repetitions: u32,
    /// Directory for a scratch file to time the disk tier (removed afterwards); `None` skips it.
    pub disk_dir: Option<PathBuf>,
}

impl Default for CalibrationConfig {
    /// 64 KiB, 256 KiB, 1 MiB, 4 MiB and 16 MiB, five runs each, no disk.
    fn default() -> Self {
        CalibrationConfig {
            sizes: vec![64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20],
            repetitions: 5,
            disk_dir: None,
        }
    }
}

/// The measured links of one device.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredLinks {
    pub device: u32,
    pub host_to_hbm: LinkFit,
    pub hbm_to_host: LinkFit,
    /// Disk file → host memory (present when a directory was given).
    pub disk_read: Option<LinkFit>,
    /// Host memory → disk file.
    pub disk_write: Option<LinkFit>,
    /// Whether the disk file used `O_DIRECT` (else the page cache is in the numbers).
    pub disk_direct: bool,
}

impl MeasuredLinks {
    /// The host tier's spec: `capacity`, with the host→HBM link (towards the tier above).
    pub fn host_spec(&self, capacity: u64) -> TierSpec {
        TierSpec {
            capacity,
            bandwidth: self.host_to_hbm.bandwidth,
            latency: self.host_to_hbm.latency,
        }
    }

    /// The disk tier's spec: `capacity`, with the disk→host link (towards the tier above).
    pub fn disk_spec(&self, capacity: u64) -> Option<TierSpec> {
        self.disk_read.map(|l| TierSpec {
            capacity,
            bandwidth: l.bandwidth,
            latency: l.latency,
        })
    }
}

impl StoreConfig {
    /// This configuration with the host tier's (and, when measured and configured, the disk
    /// tier's) bandwidth and latency replaced by measured ones; capacities stay as configured.
    pub fn with_measured_links(mut self, links: &MeasuredLinks) -> Self {
        self.host = links.host_spec(self.host.capacity);
        if let Some(disk) = self.disk.as_mut() {
            if let Some(spec) = links.disk_spec(disk.spec.capacity) {
                disk.spec = spec;
            }
        }
        self
    }
}

/// Median of the times of `runs` calls of `op` after one untimed warm-up.
fn median_time(runs: u32, mut op: impl FnMut() -> Result<()>) -> Result<f64> {
    op()?;
    let mut times = Vec::with_capacity(runs as usize);
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        op()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Times `op(bytes)` for every size and fits the line.
fn measure_link(
    config: &CalibrationConfig,
    mut op: impl FnMut(u64) -> Result<()>,
) -> Result<LinkFit> {
    let mut samples = Vec::with_capacity(config.sizes.len());
    for &bytes in &config.sizes {
        samples.push((bytes, median_time(config.repetitions, || op(bytes))?));
    }
    fit(&samples)
}

/// Measures host→HBM and HBM→host on `device` with the backend's copies, and the disk tier in
/// `config.disk_dir` when given. Needs the largest size in device memory (rounded up to the
/// granularity) and twice in host memory; everything is freed before returning.
pub fn measure(
    backend: &Arc<dyn Backend>,
    device: u32,
    config: &CalibrationConfig,
) -> Result<MeasuredLinks> {
    let largest = config.sizes.iter().copied().max().unwrap_or(0);
    if largest == 0 || config.sizes.iter().any(|&s| s == 0 || s % 4096 != 0) {
        return Err(Error::InvalidArgument(
            "calibration sizes must be non-zero multiples of 4096".into(),
        ));
    }
    let device_buffer = DeviceBuffer::new(backend, device, largest)?;
    let host = HostBuffer::new(backend, largest)?;
    let stream = Stream::new(backend, device)?;
    let scope = CopyScope {
        buffers: &[&host],
        reservations: &[device_buffer.reservation()],
    };
    let copy = |dst: u64, src: u64, len: u64| -> Result<()> {
        let desc = [CopyDesc { dst, src, len }];
        copy_async_in(backend, stream.handle(), CopyKind::Batch(&desc), scope)?.synchronize()
    };
    let dev = device_buffer.ptr();
    let host_to_hbm = measure_link(config, |len| copy(dev, host.ptr(), len))?;
    let hbm_to_host = measure_link(config, |len| copy(host.ptr(), dev, len))?;
    let (disk_read, disk_write, disk_direct) = match &config.disk_dir {
        Some(dir) => {
            let (read, write, direct) = measure_disk(dir, &host, config)?;
            (Some(read), Some(write), direct)
        }
        None => (None, None, false),
    };
    Ok(MeasuredLinks {
        device,
        host_to_hbm,
        hbm_to_host,
        disk_read,
        disk_write,
        disk_direct,
    })
}

/// Disk read and write fits through the disk tier's own file type (`O_DIRECT` where allowed).
fn measure_disk(
    dir: &Path,
    host: &HostBuffer,
    config: &CalibrationConfig,
) -> Result<(LinkFit, LinkFit, bool)> {
    let file = DiskFile::create(dir, true)?;
    let write = measure_link(config, |len| file.write_from(host, 0, 0, len))?;
    let read = measure_link(config, |len| file.read_into(host, 0, 0, len))?;
    Ok((read, write, file.is_direct()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_an_exact_line() {
        let (latency, bandwidth) = (5e-6, 25e9);
        let samples: Vec<(u64, f64)> = [64u64 << 10, 1 << 20, 16 << 20]
            .iter()
            .map(|&b| (b, latency + b as f64 / bandwidth))
            .collect();
        let got = fit(&samples).unwrap();
        assert!((got.bandwidth / bandwidth - 1.0).abs() < 1e-9, "{got:?}");
        let lat = got.latency.as_secs_f64();
        assert!((lat - latency).abs() < 1e-12, "{got:?}");
        assert!((got.time(1 << 20).as_secs_f64() - samples[1].1).abs() < 1e-9);
    }

    #[test]
    fn fit_refuses_what_has_no_line() {
        assert!(matches!(fit(&[]), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            fit(&[(4096, 1e-3), (4096, 2e-3)]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            fit(&[(4096, 1e-3), (8192, f64::NAN)]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            fit(&[(4096, 2e-3), (8192, 1e-3)]),
            Err(Error::InvalidState(_))
        ));
        // A negative intercept is zero latency, the slope still counts.
        let got = fit(&[(1000, 0.0), (2000, 2e-6)]).unwrap();
        assert_eq!(got.latency, Duration::ZERO);
        assert!((got.bandwidth - 5e8).abs() < 1.0);
    }

    #[test]
    fn measured_links_replace_speeds_not_capacities() {
        let link = LinkFit {
            bandwidth: 7e9,
            latency: Duration::from_micros(3),
        };
        let links = MeasuredLinks {
            device: 0,
            host_to_hbm: link,
            hbm_to_host: link,
            disk_read: Some(LinkFit {
                bandwidth: 2e9,
                latency: Duration::from_micros(80),
            }),
            disk_write: None,
            disk_direct: false,
        };
        let mut config = StoreConfig::new(1 << 16, 1 << 24, 1 << 26);
        config.disk = Some(crate::store::DiskConfig {
            dir: std::env::temp_dir(),
            spec: TierSpec {
                capacity: 1 << 30,
                bandwidth: 1.0,
                latency: Duration::ZERO,
            },
            io_threads: 1,
            direct: false,
        });
        let got = config.with_measured_links(&links);
        assert_eq!(got.host.capacity, 1 << 26);
        assert_eq!(got.host.bandwidth, 7e9);
        assert_eq!(got.host.latency, Duration::from_micros(3));
        let disk = got.disk.unwrap().spec;
        assert_eq!(disk.capacity, 1 << 30);
        assert_eq!(disk.bandwidth, 2e9);
        assert_eq!(got.hbm.capacity, 1 << 24);
    }
}
