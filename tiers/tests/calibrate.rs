//! Calibration on the host backend: a configured link model is what the measurement must find.

use std::sync::Arc;
use std::time::Duration;

use strata_tiers::calibrate::{self, CalibrationConfig};
use strata_vmm::host::{Link, LinkModel};
use strata_vmm::{Backend, HostBackend, HostConfig};

/// A strict host backend whose every link is `bandwidth` bytes/s after `latency`.
fn slow_backend(bandwidth: f64, latency: Duration) -> Arc<dyn Backend> {
    let link = Link { bandwidth, latency };
    let config = HostConfig {
        devices: vec![1 << 30],
        strict: true,
        link: Some(LinkModel {
            host_to_device: link,
            device_to_host: link,
            device_to_device: link,
        }),
        ..HostConfig::default()
    };
    Arc::new(HostBackend::new(config).unwrap())
}

#[test]
fn measurement_recovers_a_configured_slow_link() {
    // 1 GB/s and 50 µs: the modelled sleep (up to 8 ms per copy here) dominates the memcpy
    // underneath and the scheduler's noise on a busy machine, so the slope is the link's. The
    // bound is generous on purpose (a factor of 3 either way): this checks that the fit finds
    // the link, not how fast the machine is.
    let bandwidth = 1e9;
    let b = slow_backend(bandwidth, Duration::from_micros(50));
    let dir = tempfile::tempdir().unwrap();
    let config = CalibrationConfig {
        sizes: vec![64 << 10, 512 << 10, 2 << 20, 8 << 20],
        repetitions: 3,
        disk_dir: Some(dir.path().to_path_buf()),
    };
    let links = calibrate::measure(&b, 0, &config).unwrap();
    for (name, link) in [("h2d", links.host_to_hbm), ("d2h", links.hbm_to_host)] {
        assert!(
            link.bandwidth > bandwidth / 3.0 && link.bandwidth < bandwidth * 3.0,
            "{name}: measured {:.3e} B/s for a {bandwidth:.0e} B/s link",
            link.bandwidth
        );
        // The intercept is noisy (scheduler wake-ups add to every copy): only not absurd.
        assert!(link.latency < Duration::from_millis(50), "{name}: {link:?}");
    }
    // The disk was timed through the tier's own file (numbers depend on the machine).
    let read = links.disk_read.expect("disk read measured");
    let write = links.disk_write.expect("disk write measured");
    assert!(read.bandwidth > 0.0 && write.bandwidth > 0.0);
    // The scratch file is gone.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // Nothing of the measurement is left on the device.
    assert_eq!(b.live_counts().mappings, 0);
    assert_eq!(b.live_counts().reservations, 0);
    assert_eq!(b.live_counts().handles, 0);
}

#[test]
fn bad_sizes_are_typed_errors() {
    let b = slow_backend(1e12, Duration::ZERO);
    for sizes in [vec![], vec![4096, 1000], vec![0, 4096]] {
        let config = CalibrationConfig {
            sizes,
            ..CalibrationConfig::default()
        };
        assert!(matches!(
            calibrate::measure(&b, 0, &config),
            Err(strata_vmm::Error::InvalidArgument(_))
        ));
    }
    let config = CalibrationConfig {
        sizes: vec![4096, 8192],
        repetitions: 1,
        disk_dir: None,
    };
    assert!(matches!(
        calibrate::measure(&b, 7, &config),
        Err(strata_vmm::Error::NoDevice(7))
    ));
}
