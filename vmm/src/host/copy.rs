//! Copies and fills on the host backend: both sides of a copy are translated through the VA
//! table to process addresses (shadow views of the memfds for device memory, with the handles
//! pinned until the bytes moved), delayed by the link model, then copied.

use std::time::Duration;

use strata_latency::Direction;

use crate::error::{Error, Result};
use crate::types::{Access, CopyDesc, DevicePtr, Location};
use crate::vatable::{Accessor, Translation};

use super::{invalid_handle, Inner, State};

/// One side of a copy, resolved to process addresses: `(address, len)` segments.
pub(super) type Segments = Vec<(usize, u64)>;

impl Inner {
    /// Translates one side of a copy and pins the handles it touches.
    pub(super) fn resolve(
        &self,
        st: &mut State,
        addr: DevicePtr,
        len: u64,
        accessor: Accessor,
        need: Access,
        pins: &mut Vec<u64>,
    ) -> Result<(Segments, bool)> {
        match st.va.translate(addr, len, accessor, need)? {
            Translation::Host => {
                if addr == 0 {
                    return Err(Error::InvalidArgument("null host pointer in a copy".into()));
                }
                let a = usize::try_from(addr).map_err(|_| Error::Overflow("host address"))?;
                Ok((vec![(a, len)], false))
            }
            Translation::Device(pieces) => {
                let mut segs = Vec::with_capacity(pieces.len());
                let mut on_device = false;
                for p in pieces {
                    let entry = st
                        .handles
                        .get_mut(&p.handle.0)
                        .ok_or(invalid_handle("physical", p.handle.0))?;
                    let index = self.pool_index(entry.location)?;
                    on_device |= matches!(entry.location, Location::Device(_));
                    let a = entry.shadow_addr(&st.pools, index, p.offset)?;
                    entry.pins += 1;
                    pins.push(p.handle.0);
                    segs.push((a, p.len));
                }
                Ok((segs, on_device))
            }
        }
    }

    pub(super) fn unpin(&self, pins: &[u64]) {
        if pins.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for &id in pins {
            if let Some(entry) = st.handles.get_mut(&id) {
                entry.pins = entry.pins.saturating_sub(1);
            }
            if let Err(e) = self.maybe_free(&mut st, id) {
                crate::raii::record_deferred(e);
            }
        }
    }

    /// Validates copies at submission (translation and access only; nothing is pinned).
    pub(super) fn validate_copies(&self, accessor: Accessor, copies: &[CopyDesc]) -> Result<()> {
        let st = self.state.lock();
        for c in copies {
            if c.len == 0 {
                continue;
            }
            for (addr, need) in [(c.src, Access::Read), (c.dst, Access::ReadWrite)] {
                if st.va.translate(addr, c.len, accessor, need)? == Translation::Host && addr == 0 {
                    return Err(Error::InvalidArgument("null host pointer in a copy".into()));
                }
            }
        }
        Ok(())
    }

    /// The link model's time for a copy, else the latency profile's (`STRATA_HOST_LATENCY`).
    pub(super) fn link_delay(&self, len: u64, src_device: bool, dst_device: bool) -> Duration {
        let Some(model) = self.config.link else {
            let direction = match (src_device, dst_device) {
                (false, true) => Direction::HostToDevice,
                (true, false) => Direction::DeviceToHost,
                (true, true) => Direction::DeviceToDevice,
                (false, false) => return Duration::ZERO,
            };
            return self.latency.profile().copy_time(direction, len);
        };
        let link = match (src_device, dst_device) {
            (false, true) => model.host_to_device,
            (true, false) => model.device_to_host,
            (true, true) => model.device_to_device,
            (false, false) => return Duration::ZERO,
        };
        if !(link.bandwidth.is_finite() && link.bandwidth > 0.0) {
            return link.latency;
        }
        let secs = len as f64 / link.bandwidth;
        link.latency + Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
    }

    /// Executes copies now (translating again: mappings may have changed since submission).
    pub(super) fn run_copies(&self, accessor: Accessor, copies: &[CopyDesc]) -> Result<()> {
        for c in copies {
            self.run_copy(accessor, c)?;
        }
        Ok(())
    }

    pub(super) fn run_copy(&self, accessor: Accessor, c: &CopyDesc) -> Result<()> {
        if c.len == 0 {
            return Ok(());
        }
        let mut pins = Vec::new();
        let resolved = {
            let mut st = self.state.lock();
            let src = self.resolve(&mut st, c.src, c.len, accessor, Access::Read, &mut pins);
            let dst = src.and_then(|s| {
                self.resolve(
                    &mut st,
                    c.dst,
                    c.len,
                    accessor,
                    Access::ReadWrite,
                    &mut pins,
                )
                .map(|d| (s, d))
            });
            drop(st);
            dst
        };
        let result = resolved.map(|((src, src_dev), (dst, dst_dev))| {
            strata_latency::wait(self.link_delay(c.len, src_dev, dst_dev));
            copy_segments(&src, &dst);
        });
        self.unpin(&pins);
        result
    }

    /// Fills device VA now.
    pub(super) fn run_memset(
        &self,
        accessor: Accessor,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let mut pins = Vec::new();
        let resolved = {
            let mut st = self.state.lock();
            if !st.va.touches_reservation(dst, len) {
                return Err(Error::IllegalAccess {
                    va: dst,
                    size: len,
                    reason: "memset target is not device memory",
                });
            }
            self.resolve(&mut st, dst, len, accessor, Access::ReadWrite, &mut pins)
        };
        let result = resolved.and_then(|(segs, _)| {
            for &(addr, n) in &segs {
                let n = usize::try_from(n).map_err(|_| Error::Overflow("memset length"))?;
                // SAFETY: `addr..addr+n` lies in a shadow view of a pinned handle (mapped
                // read-write for the backend's lifetime, and the pin keeps the range from being
                // punched or unmapped); no Rust reference points into shadow views.
                unsafe { std::ptr::write_bytes(addr as *mut u8, value, n) };
            }
            Ok(())
        });
        self.unpin(&pins);
        result
    }
}

/// The part `offset..offset+len` of a run of segments (clipped to what they hold).
pub(super) fn sub_segments(segs: &[(usize, u64)], offset: u64, len: u64) -> Segments {
    let (mut skip, mut left, mut out) = (offset, len, Vec::new());
    for &(addr, n) in segs {
        if left == 0 {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let take = (n - skip).min(left);
        out.push((addr + skip as usize, take));
        left -= take;
        skip = 0;
    }
    out
}

/// Copies the bytes of `src` segments into `dst` segments (same total length).
pub(super) fn copy_segments(src: &Segments, dst: &Segments) {
    let (mut si, mut so, mut di, mut doff) = (0usize, 0u64, 0usize, 0u64);
    while si < src.len() && di < dst.len() {
        let (sa, sl) = src[si];
        let (da, dl) = dst[di];
        let n = (sl - so).min(dl - doff);
        // Lengths fit in usize: every segment was resolved from an address range of this process.
        let (sp, dp, count) = (sa + so as usize, da + doff as usize, n as usize);
        // SAFETY: device segments lie in shadow views of pinned handles (mapped read-write for
        // the backend's lifetime; the pins keep the ranges allocated); host segments are valid
        // for reads (source) / writes (destination) of `len` bytes by the `copy_async` contract.
        // `ptr::copy` tolerates overlap between source and destination.
        unsafe { std::ptr::copy(sp as *const u8, dp as *mut u8, count) };
        so += n;
        doff += n;
        if so == sl {
            si += 1;
            so = 0;
        }
        if doff == dl {
            di += 1;
            doff = 0;
        }
    }
}
