//! KVPR (seed 003): transfer part of the KV cache, recompute the rest from activations.
//!
//! The planner minimizes Eq. 10 over the split point `l` (Eq. 11) for one layer:
//!
//! ```text
//! M_X[0:l]   = b·l·h·p                       (Eq. 6)
//! M_KV[l:s'] = 2·b·(s'−l)·h·p                (Eq. 6)
//! N_KV[0:l]  = 4·b·l·h²                      (Eq. 8)
//! t_recomp   = N_KV[0:l] / v_gpu             (Eq. 9)
//! t          = M_X[0:l]/v_com + max(t_recomp, M_KV[l:s']/v_com)   (Eq. 10, column-by-column)
//! ```
//!
//! and for the row-by-row schedule the first term is omitted (§3.2: "If the first term in
//! Eq. (10) is omitted, the problem simplifies to the row-by-row schedule"). Eq. 11 writes the
//! constraint as `0 ≤ l ≤ s`; the text before Eq. 6 says `0 ≤ l ≤ s'`, and Appendix A.4 reports
//! l = 182 for a prompt of 128, so we search `0 ≤ l ≤ s'`.
//!
//! The runtime piece comes twice; in both the merged cache equals the fully transferred one:
//!
//! - [`transfer_recompute`], on the CPU: `K,V[l:s']` move on a copy thread while the caller's
//!   thread recomputes `K,V[0:l] = X[0:l]·W_K, X[0:l]·W_V` with the GEMM twin
//!   ([`strata_kernels::gemm`]).
//! - [`KvprDevice`] (and the one-shot [`transfer_recompute_device`]), on a device through
//!   [`DeviceWork::gemm_f32_async`]: W_K/W_V resident in device memory; `X[0:l]` crosses first on a
//!   copy stream; a compute stream waits for its event and recomputes into rows `0..l` of the K
//!   and V tensors while the copy stream fills rows `l..s'`; a last event marks the merge. On
//!   CUDA the GEMM is cuBLAS `cublasSgemm` (FP32: equal to the twin up to rounding, exactly for
//!   data whose partial sums are representable); on the host backend it is the twin, bit for bit.

use std::sync::Arc;

use strata_kernels::gemm::{Gemm, GemmError};
use strata_vmm::{
    copy_async_in, device_work, Backend, CopyDesc, CopyKind, CopyScope, DeviceBuffer, DevicePtr,
    DeviceWork, Error, Event, GemmF32, HostBuffer, Result, Stream,
};

/// Profiled inputs of the planner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitInputs {
    /// b: batch size.
    pub batch: u64,
    /// s': current sequence length.
    pub seq: u64,
    /// h: hidden (embedding) dimension.
    pub hidden: u64,
    /// p: bytes per element (2 for FP16).
    pub bytes_per_elem: u64,
    /// v_com: bytes/s over the CPU→GPU link.
    pub v_com: f64,
    /// v_gpu: FLOP/s the GPU sustains for the recomputation.
    pub v_gpu: f64,
}

/// Which pipeline the plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Latency-oriented: Eq. 10 without its first term.
    RowByRow,
    /// Throughput-oriented: Eq. 10 in full.
    ColumnByColumn,
}

/// A chosen split and its predicted time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Split {
    /// l: tokens whose KV is recomputed from transferred activations.
    pub l: u64,
    /// t^i (Eq. 10) at that l, seconds.
    pub t: f64,
    /// t^i at l = 0 (transfer everything), seconds.
    pub t_full_transfer: f64,
}

impl SplitInputs {
    /// `M_X[0:l]` (Eq. 6), bytes.
    pub fn m_x(&self, l: u64) -> f64 {
        (self.batch * l * self.hidden * self.bytes_per_elem) as f64
    }
    /// `M_KV[l:s']` (Eq. 6), bytes.
    pub fn m_kv(&self, l: u64) -> f64 {
        (2 * self.batch * (self.seq - l.min(self.seq)) * self.hidden * self.bytes_per_elem) as f64
    }
    /// `N_KV[0:l]` (Eq. 8), FLOPs.
    pub fn n_kv(&self, l: u64) -> f64 {
        4.0 * self.batch as f64 * l as f64 * (self.hidden as f64).powi(2)
    }
    /// t_recomp (Eq. 9), seconds.
    pub fn t_recomp(&self, l: u64) -> f64 {
        self.n_kv(l) / self.v_gpu
    }
    /// t^i (Eq. 10) for `schedule`, seconds.
    pub fn time(&self, l: u64, schedule: Schedule) -> f64 {
        let overlap = self.t_recomp(l).max(self.m_kv(l) / self.v_com);
        match schedule {
            Schedule::ColumnByColumn => self.m_x(l) / self.v_com + overlap,
            Schedule::RowByRow => overlap,
        }
    }
}

/// Eq. 11: the `l` in `0..=s'` minimizing Eq. 10 (the smallest such `l` on ties). One integer
/// variable, so an exhaustive search is exact and cheap (s' evaluations).
pub fn plan_split(inputs: &SplitInputs, schedule: Schedule) -> Split {
    let mut best = (0u64, inputs.time(0, schedule));
    for l in 1..=inputs.seq {
        let t = inputs.time(l, schedule);
        if t < best.1 {
            best = (l, t);
        }
    }
    Split {
        l: best.0,
        t: best.1,
        t_full_transfer: inputs.time(0, schedule),
    }
}

/// One layer's host-resident state for a sequence: activations and the KV cache, row-major,
/// `seq × hidden` each, and the projection weights (`hidden × hidden`).
pub struct HostLayer<'a> {
    pub x: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub w_k: &'a [f32],
    pub w_v: &'a [f32],
    pub seq: usize,
    pub hidden: usize,
}

impl HostLayer<'_> {
    /// Checks every slice against the shape; returns `seq·hidden`.
    fn check(&self) -> Result<usize> {
        if self.hidden == 0 {
            return Err(Error::InvalidArgument("a layer with hidden size 0".into()));
        }
        let cells = self
            .seq
            .checked_mul(self.hidden)
            .ok_or(Error::Overflow("seq × hidden"))?;
        check_weights(self.w_k, self.w_v, self.hidden)?;
        for (name, len) in [
            ("X", self.x.len()),
            ("K", self.k.len()),
            ("V", self.v.len()),
        ] {
            if len != cells {
                return Err(Error::InvalidArgument(format!(
                    "{name} holds {len} elements, not seq × hidden = {} × {}",
                    self.seq, self.hidden
                )));
            }
        }
        Ok(cells)
    }

    /// Checks `l ≤ s'` on top of the shape.
    fn check_split(&self, l: usize) -> Result<usize> {
        let cells = self.check()?;
        if l > self.seq {
            return Err(Error::InvalidArgument(format!(
                "split point l = {l} beyond the sequence length s' = {}",
                self.seq
            )));
        }
        Ok(cells)
    }
}

fn check_weights(w_k: &[f32], w_v: &[f32], hidden: usize) -> Result<()> {
    let cells = hidden
        .checked_mul(hidden)
        .ok_or(Error::Overflow("hidden × hidden"))?;
    for (name, len) in [("W_K", w_k.len()), ("W_V", w_v.len())] {
        if len != cells {
            return Err(Error::InvalidArgument(format!(
                "{name} holds {len} elements, not hidden × hidden = {hidden} × {hidden}"
            )));
        }
    }
    Ok(())
}

fn gemm_error(e: GemmError) -> Error {
    Error::InvalidArgument(e.to_string())
}

/// KVPR's runtime on the CPU: the first `l` rows of K and V are recomputed from `X[0:l]`
/// (which is "transferred" first: copied to the destination side) with the GEMM twin
/// ([`strata_kernels::gemm`]), while a copy thread moves `K,V[l:s']`; returns the merged
/// `(K, V)`. Bad shapes and `l > s'` are [`Error::InvalidArgument`].
pub fn transfer_recompute(layer: &HostLayer<'_>, l: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let cells = layer.check_split(l)?;
    let h = layer.hidden;
    let mut k = vec![0f32; cells];
    let mut v = vec![0f32; cells];
    let (k_re, k_tx) = k.split_at_mut(l * h);
    let (v_re, v_tx) = v.split_at_mut(l * h);
    // X[0:l] crosses the link first.
    let x_dev: Vec<f32> = layer.x[..l * h].to_vec();
    let recompute = Gemm::packed(l, h, h);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            k_tx.copy_from_slice(&layer.k[l * h..]);
            v_tx.copy_from_slice(&layer.v[l * h..]);
        });
        recompute.run(&x_dev, layer.w_k, k_re)?;
        recompute.run(&x_dev, layer.w_v, v_re)
    })
    .map_err(gemm_error)?;
    Ok((k, v))
}

/// Bytes per element.
const F32: u64 = 4;

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `count` f32 elements in bytes.
fn f32_len(count: usize) -> Result<u64> {
    (count as u64)
        .checked_mul(F32)
        .ok_or(Error::Overflow("f32 bytes"))
}

/// One layer's activations and KV cache staged in pinned host memory (`X | K | V`, row-major
/// `seq × hidden` each): where the device runtime transfers from.
pub struct PinnedLayer {
    buffer: HostBuffer,
    seq: usize,
    hidden: usize,
}

impl PinnedLayer {
    /// Copies `layer`'s X, K and V into a new pinned buffer (its weights stay out: they are
    /// resident on the device, see [`KvprDevice::new`]).
    pub fn new(backend: &Arc<dyn Backend>, layer: &HostLayer<'_>) -> Result<Self> {
        let cells = layer.check()?;
        let third = f32_len(cells)?;
        let total = third
            .checked_mul(3)
            .ok_or(Error::Overflow("pinned layer bytes"))?;
        let buffer = HostBuffer::new(backend, total.max(F32))?;
        for (i, part) in [layer.x, layer.k, layer.v].into_iter().enumerate() {
            buffer.write_at(i as u64 * third, &f32_bytes(part))?;
        }
        Ok(PinnedLayer {
            buffer,
            seq: layer.seq,
            hidden: layer.hidden,
        })
    }

    /// Host address of row `row` of part `part` (0: X, 1: K, 2: V).
    fn row(&self, part: u64, row: usize) -> Result<DevicePtr> {
        let row_bytes = f32_len(self.hidden)?;
        let third = f32_len(self.seq * self.hidden)?;
        Ok(self.buffer.ptr() + part * third + row as u64 * row_bytes)
    }
}

/// KVPR's runtime on a device (any backend with a [`DeviceWork`] GEMM: cuBLAS on CUDA, the CPU
/// twin on the host backend): W_K and W_V resident in device memory, a copy stream that moves
/// activations and KV, and a compute stream that recomputes.
pub struct KvprDevice {
    backend: Arc<dyn Backend>,
    work: Arc<dyn DeviceWork>,
    device: u32,
    hidden: usize,
    /// `W_K | W_V`, `hidden × hidden` each, row-major.
    weights: DeviceBuffer,
    copy: Stream,
    compute: Stream,
}

impl KvprDevice {
    /// Creates the streams on `device` and uploads W_K and W_V (`hidden × hidden`, row-major);
    /// returns once the weights are resident. [`Error::Unsupported`] for a backend without
    /// [`DeviceWork`].
    pub fn new(
        backend: &Arc<dyn Backend>,
        device: u32,
        w_k: &[f32],
        w_v: &[f32],
        hidden: usize,
    ) -> Result<Self> {
        if hidden == 0 {
            return Err(Error::InvalidArgument("a layer with hidden size 0".into()));
        }
        check_weights(w_k, w_v, hidden)?;
        let work = device_work(backend)?;
        let one = f32_len(w_k.len())?;
        let weights = DeviceBuffer::new(backend, device, 2 * one)?;
        let staging = HostBuffer::new(backend, 2 * one)?;
        staging.write_at(0, &f32_bytes(w_k))?;
        staging.write_at(one, &f32_bytes(w_v))?;
        let copy = Stream::new(backend, device)?;
        let upload = CopyDesc {
            dst: weights.ptr(),
            src: staging.ptr(),
            len: 2 * one,
        };
        copy_async_in(
            backend,
            copy.handle(),
            CopyKind::Batch(&[upload]),
            CopyScope {
                buffers: &[&staging],
                reservations: &[weights.reservation()],
            },
        )?
        .synchronize()?;
        copy.synchronize()?;
        Ok(KvprDevice {
            backend: Arc::clone(backend),
            work,
            device,
            hidden,
            weights,
            compute: Stream::new(backend, device)?,
            copy,
        })
    }

    /// Queues one layer's load with `l` tokens recomputed and returns at once:
    ///
    /// 1. copy stream: `X[0:l]` host → device, then event `x_arrived`;
    /// 2. compute stream: waits for `x_arrived`, then `K[0:l] = X[0:l]·W_K` and
    ///    `V[0:l] = X[0:l]·W_V` straight into the first `l` rows of the K and V tensors;
    /// 3. copy stream, overlapping step 2: `K,V[l:s']` into rows `l..s'` of the same tensors,
    ///    then event `kv_arrived`;
    /// 4. compute stream: waits for `kv_arrived`, records [`DeviceKv::ready`].
    ///
    /// The merged tensors are complete when `ready` is: every dependency is an event, none a
    /// host-side wait. `l > s'` and shapes that differ from the weights are
    /// [`Error::InvalidArgument`]. On an error after submission began, both streams are drained
    /// before the device memory goes.
    pub fn run(&self, layer: &PinnedLayer, l: usize) -> Result<DeviceKv> {
        if layer.hidden != self.hidden {
            return Err(Error::InvalidArgument(format!(
                "layer hidden size {} differs from the weights' {}",
                layer.hidden, self.hidden
            )));
        }
        if l > layer.seq {
            return Err(Error::InvalidArgument(format!(
                "split point l = {l} beyond the sequence length s' = {}",
                layer.seq
            )));
        }
        let (s, h) = (layer.seq, layer.hidden);
        let x_len = f32_len(l * h)?;
        let tensor = f32_len(s * h)?;
        let total = tensor
            .checked_mul(2)
            .and_then(|kv| kv.checked_add(x_len))
            .ok_or(Error::Overflow("KVPR device bytes"))?;
        let buffer = DeviceBuffer::new(&self.backend, self.device, total)?;
        let queued = self.submit(layer, l, &buffer);
        if queued.is_err() {
            // Nothing may still touch `buffer` when it unmaps; the first error is the one to
            // report, so later ones from draining are dropped.
            let _ = self.copy.synchronize();
            let _ = self.compute.synchronize();
        }
        let (k, v, ready) = queued?;
        Ok(DeviceKv {
            backend: Arc::clone(&self.backend),
            ready,
            k,
            v,
            cells: s * h,
            _buffer: buffer,
        })
    }

    /// Steps 1–4 of [`Self::run`] into `buffer` (`X[0:l] | K | V`); returns the K and V tensors
    /// and the ready event.
    fn submit(
        &self,
        layer: &PinnedLayer,
        l: usize,
        buffer: &DeviceBuffer,
    ) -> Result<(DevicePtr, DevicePtr, Event)> {
        let (s, h) = (layer.seq, layer.hidden);
        let (h64, l64) = (h as u64, l as u64);
        let row = f32_len(h)?;
        let x = buffer.ptr();
        let k = x + l64 * row;
        let v = k + s as u64 * row;
        let (w_k, w_v) = (self.weights.ptr(), self.weights.ptr() + h64 * row);
        let scope = CopyScope {
            buffers: &[&layer.buffer],
            reservations: &[buffer.reservation()],
        };
        let (copy, compute) = (self.copy.handle(), self.compute.handle());
        let x_desc = CopyDesc {
            dst: x,
            src: layer.row(0, 0)?,
            len: l64 * row,
        };
        let x_arrived = copy_async_in(&self.backend, copy, CopyKind::Batch(&[x_desc]), scope)?;
        self.backend
            .stream_wait_event(compute, x_arrived.handle())?;
        for (w, out) in [(w_k, k), (w_v, v)] {
            let recompute = GemmF32::packed(l64, h64, h64, x, w, out);
            self.work.gemm_f32_async(compute, &recompute)?;
        }
        let tail = (s - l) as u64 * row;
        let kv_descs = [
            CopyDesc {
                dst: k + l64 * row,
                src: layer.row(1, l)?,
                len: tail,
            },
            CopyDesc {
                dst: v + l64 * row,
                src: layer.row(2, l)?,
                len: tail,
            },
        ];
        let kv_arrived = copy_async_in(&self.backend, copy, CopyKind::Batch(&kv_descs), scope)?;
        self.backend
            .stream_wait_event(compute, kv_arrived.handle())?;
        let ready = Event::new(&self.backend)?;
        ready.record(compute)?;
        Ok((k, v, ready))
    }

    /// Waits for everything queued on both streams; reports a failure of queued work (a GEMM
    /// or copy that failed after submission) as [`Error::Async`].
    pub fn synchronize(&self) -> Result<()> {
        self.copy.synchronize()?;
        self.compute.synchronize()
    }
}

impl Drop for KvprDevice {
    fn drop(&mut self) {
        if strata_vmm::process_is_exiting() {
            return;
        }
        // GEMMs may still read the weights: drain before they unmap.
        if let Err(e) = self.synchronize() {
            strata_vmm::record_deferred(e);
        }
    }
}

/// The merged K and V of one layer in device memory: contiguous `s' × hidden` row-major
/// tensors, rows `0..l` recomputed and rows `l..s'` transferred. Dropping it waits for
/// [`DeviceKv::ready`] before the memory goes.
pub struct DeviceKv {
    backend: Arc<dyn Backend>,
    ready: Event,
    k: DevicePtr,
    v: DevicePtr,
    cells: usize,
    _buffer: DeviceBuffer,
}

impl DeviceKv {
    /// Device address of K (`s' × hidden` f32).
    pub fn k(&self) -> DevicePtr {
        self.k
    }

    /// Device address of V.
    pub fn v(&self) -> DevicePtr {
        self.v
    }

    /// Complete when both halves are in place: consumers on another stream wait for it
    /// (`stream_wait_event`) before reading K and V.
    pub fn ready(&self) -> &Event {
        &self.ready
    }

    /// Waits for [`Self::ready`] and reads K and V back with backend copies (tests, checks).
    pub fn read_back(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        self.ready.synchronize()?;
        let mut bytes = strata_vmm::try_host_vec(f32_len(self.cells)?)?;
        self.backend.read(self.k, &mut bytes)?;
        let k = f32_values(&bytes);
        self.backend.read(self.v, &mut bytes)?;
        Ok((k, f32_values(&bytes)))
    }
}

impl Drop for DeviceKv {
    fn drop(&mut self) {
        if strata_vmm::process_is_exiting() {
            return;
        }
        if let Err(e) = self.ready.synchronize() {
            strata_vmm::record_deferred(e);
        }
    }
}

/// KVPR's runtime on `device` for one layer, start to finish: uploads the layer's weights,
/// stages X and KV in pinned memory, runs [`KvprDevice::run`] and waits for it, reporting
/// failures of queued work. For repeated layers keep a [`KvprDevice`] instead.
pub fn transfer_recompute_device(
    backend: &Arc<dyn Backend>,
    device: u32,
    layer: &HostLayer<'_>,
    l: usize,
) -> Result<DeviceKv> {
    layer.check_split(l)?;
    let runtime = KvprDevice::new(backend, device, layer.w_k, layer.w_v, layer.hidden)?;
    let kv = runtime.run(&PinnedLayer::new(backend, layer)?, l)?;
    runtime.synchronize()?;
    Ok(kv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table1(hidden: u64) -> SplitInputs {
        // KVPR Table 1 / Fig. 1: A100, PCIe 4.0 x16 at 32 GB/s, FP16, batch 32, s' = 1024,
        // 312 TFLOPS.
        SplitInputs {
            batch: 32,
            seq: 1024,
            hidden,
            bytes_per_elem: 2,
            v_com: 32e9,
            v_gpu: 312e12,
        }
    }

    #[test]
    fn the_plan_is_the_exhaustive_minimum_and_beats_full_transfer() {
        for h in [4096, 5120, 7168] {
            let i = table1(h);
            for sched in [Schedule::RowByRow, Schedule::ColumnByColumn] {
                let p = plan_split(&i, sched);
                assert!(p.l > 0 && p.l < i.seq, "{h} {sched:?} {p:?}");
                assert!(p.t < p.t_full_transfer);
                for l in 0..=i.seq {
                    assert!(i.time(l, sched) >= p.t);
                }
            }
            // Transferring X costs time, so the column plan recomputes no more than the row one.
            let row = plan_split(&i, Schedule::RowByRow);
            let col = plan_split(&i, Schedule::ColumnByColumn);
            assert!(col.l <= row.l && col.t >= row.t);
        }
    }

    #[test]
    fn eq6_matches_table1_kv_size() {
        // OPT-6.7B: 2·32·1024·4096·2 B = 512 MiB per layer (Table 1 "KV Cache (MB)": 512).
        assert_eq!(table1(4096).m_kv(0), 512.0 * 1048576.0);
        assert_eq!(table1(5120).m_kv(0), 640.0 * 1048576.0);
        assert_eq!(table1(7168).m_kv(0), 896.0 * 1048576.0);
    }

    #[test]
    fn a_slow_gpu_transfers_everything() {
        let mut i = table1(4096);
        i.v_gpu = 1e6;
        assert_eq!(plan_split(&i, Schedule::RowByRow).l, 0);
    }

    #[test]
    fn merged_kv_equals_the_transferred_kv() {
        let (s, h) = (37, 16);
        let gen = |n: usize, seed: u32| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let x = (i as u32 ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(2_654_435_761);
                    (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
                })
                .collect()
        };
        let x = gen(s * h, 1);
        let w_k = gen(h * h, 2);
        let w_v = gen(h * h, 3);
        let mut k = vec![0f32; s * h];
        let mut v = vec![0f32; s * h];
        Gemm::packed(s, h, h).run(&x, &w_k, &mut k).unwrap();
        Gemm::packed(s, h, h).run(&x, &w_v, &mut v).unwrap();
        let layer = HostLayer {
            x: &x,
            k: &k,
            v: &v,
            w_k: &w_k,
            w_v: &w_v,
            seq: s,
            hidden: h,
        };
        for l in [0, 1, 20, s] {
            let (mk, mv) = transfer_recompute(&layer, l).unwrap();
            assert!(mk == k, "K differs at l = {l}");
            assert!(mv == v, "V differs at l = {l}");
        }
        // A wrong weight shows up: the test can fail.
        let bad = HostLayer { w_k: &w_v, ..layer };
        assert!(transfer_recompute(&bad, 5).unwrap().0 != k);
        // Bad input is a typed error, not a panic.
        assert!(matches!(
            transfer_recompute(&layer, s + 1),
            Err(Error::InvalidArgument(_))
        ));
        let short = HostLayer {
            x: &x[1..],
            ..layer
        };
        assert!(matches!(
            transfer_recompute(&short, 1),
            Err(Error::InvalidArgument(_))
        ));
    }
}
