//! `strata bench migrate`: a mapped run moved between device pages and host-memory pages at the
//! same VA (`MappedRun::migrate`), next to one bulk copy of the same bytes between a
//! `HostBuffer` and device VA on the same backend and link, alternated round by round.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_allocator::{MappedRun, PagePool, PoolConfig};
use strata_vmm::{
    copy_async_in, Access, Backend, CopyDesc, CopyKind, CopyScope, HostBuffer, Location,
    Reservation, Result, Stream,
};

/// Medians of one run of the benchmark.
#[derive(Clone, Debug)]
pub struct MigrateResult {
    pub bytes: u64,
    /// Device pages → host pages.
    pub offload: Duration,
    /// Host pages → device pages.
    pub onload: Duration,
    /// Device VA → host buffer, one batch.
    pub copy_d2h: Duration,
    /// Host buffer → device VA, one batch.
    pub copy_h2d: Duration,
}

pub fn gbps(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

/// `bytes` (rounded up to whole pages) migrated off and back on `device`, and copied down and
/// up, `reps` rounds each, alternated (median kept).
pub fn migrate(
    backend: &Arc<dyn Backend>,
    device: u32,
    bytes: u64,
    reps: usize,
) -> Result<MigrateResult> {
    let manual = PoolConfig {
        background: false,
        idle_trim_after: None,
        ..PoolConfig::default()
    };
    let local = PagePool::new(Arc::clone(backend), device, manual.clone())?;
    let host = PagePool::new_host(Arc::clone(backend), device, manual)?;
    let pages = bytes.div_ceil(local.page_size());
    let span = pages * local.page_size();
    let grants = [(Location::Device(device), Access::ReadWrite)];
    let res = Arc::new(Reservation::new(backend, span, 0)?);
    let mut run = MappedRun::take(&local, &res, res.ptr(), pages as usize, &grants)?;
    let buffer = HostBuffer::new(backend, span)?;
    let stream = Stream::new(backend, device)?;
    let scope = CopyScope {
        buffers: &[&buffer],
        reservations: &[&res],
    };
    let copy = |dst, src| -> Result<Duration> {
        let t = Instant::now();
        let desc = CopyDesc {
            dst,
            src,
            len: span,
        };
        copy_async_in(backend, stream.handle(), CopyKind::Batch(&[desc]), scope)?;
        stream.synchronize()?;
        Ok(t.elapsed())
    };
    let mut times: [Vec<Duration>; 4] = Default::default();
    // Round 0 warms both pools (page creation) and is not kept.
    for round in 0..=reps {
        let t = Instant::now();
        run.migrate(&host, stream.handle(), &[], &grants)?;
        let offload = t.elapsed();
        let t = Instant::now();
        run.migrate(&local, stream.handle(), &[], &grants)?;
        let onload = t.elapsed();
        let d2h = copy(buffer.ptr(), res.ptr())?;
        let h2d = copy(res.ptr(), buffer.ptr())?;
        if round > 0 {
            for (kept, time) in times.iter_mut().zip([offload, onload, d2h, h2d]) {
                kept.push(time);
            }
        }
    }
    let [offload, onload, copy_d2h, copy_h2d] = times.map(median);
    Ok(MigrateResult {
        bytes: span,
        offload,
        onload,
        copy_d2h,
        copy_h2d,
    })
}
