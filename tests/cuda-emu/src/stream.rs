//! Streams, events, copies and fills.
//!
//! A created stream is a worker thread running its operations in order. The default streams
//! (`0`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) run each operation at once on the calling
//! thread, after the context's blocking streams drained (the legacy stream's rule; strata
//! creates only non-blocking streams). Copies follow the documented host-synchronization rules:
//! from pageable memory the bytes are staged before the call returns; into pageable memory the
//! call returns once the copy completed; pinned and device memory are truly asynchronous.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUevent, CUmemcpyAttributes, CUresult, CUstream};
use parking_lot::{Condvar, Mutex};
use strata_latency::Direction;

use crate::mem::{resolve, Endpoint, Piece};
use crate::{api, current_device, out, Res, INVALID_CONTEXT, INVALID_HANDLE, INVALID_VALUE};

type Op = Box<dyn FnOnce() + Send>;

/// Submitted and completed operation counts, and a condition variable for waiters.
#[derive(Default)]
struct Progress {
    counts: Mutex<(u64, u64)>,
    cv: Condvar,
}

pub(crate) struct StreamObj {
    device: usize,
    blocking: bool,
    tx: Mutex<Option<Sender<Op>>>,
    progress: Arc<Progress>,
}

impl StreamObj {
    fn new(device: usize, blocking: bool) -> Arc<Self> {
        let (tx, rx) = channel::<Op>();
        let progress = Arc::new(Progress::default());
        let p = Arc::clone(&progress);
        std::thread::Builder::new()
            .name("cuda-emu-stream".into())
            .spawn(move || {
                for op in rx {
                    op();
                    p.counts.lock().1 += 1;
                    p.cv.notify_all();
                }
            })
            .expect("spawn a stream worker");
        Arc::new(StreamObj {
            device,
            blocking,
            tx: Mutex::new(Some(tx)),
            progress,
        })
    }

    fn submit(&self, op: Op) {
        let tx = self.tx.lock();
        if let Some(tx) = tx.as_ref() {
            self.progress.counts.lock().0 += 1;
            if tx.send(op).is_err() {
                self.progress.counts.lock().1 += 1;
            }
        }
    }

    fn synchronize(&self) {
        let mut c = self.progress.counts.lock();
        while c.1 < c.0 {
            self.progress.cv.wait(&mut c);
        }
    }
}

struct EventObj {
    device: usize,
    /// (records so far, records completed)
    state: Mutex<(u64, u64)>,
    cv: Condvar,
}

impl EventObj {
    fn complete(&self, generation: u64) {
        let mut st = self.state.lock();
        st.1 = st.1.max(generation);
        self.cv.notify_all();
    }

    fn wait_for(&self, generation: u64) {
        let mut st = self.state.lock();
        while st.1 < generation {
            self.cv.wait(&mut st);
        }
    }
}

#[derive(Default)]
struct Tables {
    streams: HashMap<usize, Arc<StreamObj>>,
    events: HashMap<usize, Arc<EventObj>>,
    next: usize,
}

static TABLES: Mutex<Option<Tables>> = Mutex::new(None);

fn tables<T>(f: impl FnOnce(&mut Tables) -> T) -> T {
    f(TABLES.lock().get_or_insert_with(Tables::default))
}

fn new_id(t: &mut Tables) -> usize {
    t.next += 1;
    0x7e57_0000_0000 + 0x100 * t.next
}

/// Where a stream's work runs.
pub(crate) enum Target {
    /// A default stream of `device`: run at once.
    Now(usize),
    Stream(Arc<StreamObj>),
}

impl Target {
    fn device(&self) -> usize {
        match self {
            Target::Now(d) => *d,
            Target::Stream(s) => s.device,
        }
    }
}

const LEGACY: usize = 1;
const PER_THREAD: usize = 2;

/// The target of `stream` for work queued with the current context (a created stream must
/// belong to it).
pub(crate) fn target(stream: CUstream) -> Res<Target> {
    let d = current_device()?;
    match stream as usize {
        0 | LEGACY | PER_THREAD => {
            // The legacy default stream waits for the context's blocking streams.
            let blocking: Vec<Arc<StreamObj>> = tables(|t| {
                t.streams
                    .values()
                    .filter(|s| s.device == d && s.blocking)
                    .cloned()
                    .collect()
            });
            for s in blocking {
                s.synchronize();
            }
            Ok(Target::Now(d))
        }
        id => {
            let s = tables(|t| t.streams.get(&id).cloned()).ok_or(INVALID_HANDLE)?;
            if s.device != d {
                return Err(INVALID_CONTEXT);
            }
            Ok(Target::Stream(s))
        }
    }
}

pub(crate) fn submit(target: &Target, op: Op) {
    match target {
        Target::Now(_) => op(),
        Target::Stream(s) => s.submit(op),
    }
}

/// Device VA ranges that queued, not yet finished, copies and fills touch.
#[derive(Default)]
struct Busy {
    next: u64,
    /// operation id → its `(va, len)` ranges
    ranges: HashMap<u64, Vec<(u64, u64)>>,
}

static IN_FLIGHT: Mutex<Option<Busy>> = Mutex::new(None);

/// Registers `ranges` as in flight until the returned guard drops (in the operation).
fn in_flight(ranges: Vec<(u64, u64)>) -> InFlight {
    let mut g = IN_FLIGHT.lock();
    let busy = g.get_or_insert_with(Busy::default);
    busy.next += 1;
    busy.ranges.insert(busy.next, ranges);
    InFlight(busy.next)
}

struct InFlight(u64);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(busy) = IN_FLIGHT.lock().as_mut() {
            busy.ranges.remove(&self.0);
        }
    }
}

/// True when queued work still touches `va..va+len` (unmapping it now would fault the device).
pub(crate) fn touched_in_flight(va: u64, len: u64) -> bool {
    IN_FLIGHT.lock().as_ref().is_some_and(|busy| {
        busy.ranges
            .values()
            .flatten()
            .any(|&(a, n)| a < va.saturating_add(len) && va < a.saturating_add(n))
    })
}

fn device_ranges(e: &Endpoint, va: u64, len: u64) -> Vec<(u64, u64)> {
    match e {
        Endpoint::Device(_) => vec![(va, len)],
        _ => Vec::new(),
    }
}

/// Waits for every stream of device `d`.
pub(crate) fn synchronize_context(d: usize) {
    let mine: Vec<Arc<StreamObj>> = tables(|t| {
        t.streams
            .values()
            .filter(|s| s.device == d)
            .cloned()
            .collect()
    });
    for s in mine {
        s.synchronize();
    }
}

/// Forgets every stream and event of device `d` (its primary context was released); queued
/// work still completes.
pub(crate) fn destroy_context_objects(d: usize) {
    tables(|t| {
        t.streams.retain(|_, s| {
            if s.device == d {
                s.tx.lock().take();
            }
            s.device != d
        });
        t.events.retain(|_, e| e.device != d);
    });
}

/// # Safety
///
/// As the driver's `cuStreamCreate`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut CUstream, flags: c_uint) -> CUresult {
    crate::charge(strata_latency::Call::StreamCreate);
    api(|| {
        let d = current_device()?;
        if flags > 1 || stream.is_null() {
            return Err(INVALID_VALUE);
        }
        let obj = StreamObj::new(d, flags == 0);
        let id = tables(|t| {
            let id = new_id(t);
            t.streams.insert(id, obj);
            id
        });
        out(stream, id as CUstream)
    })
}

/// Queued work still completes; the handle is invalid at once.
///
/// # Safety
///
/// As the driver's `cuStreamDestroy_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    crate::charge(strata_latency::Call::StreamDestroy);
    api(|| {
        let s = tables(|t| t.streams.remove(&(stream as usize))).ok_or(INVALID_HANDLE)?;
        s.tx.lock().take();
        Ok(())
    })
}

/// # Safety
///
/// As the driver's `cuStreamSynchronize`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    api(|| {
        match stream as usize {
            0 | LEGACY | PER_THREAD => {
                target(stream)?;
            }
            id => {
                let s = tables(|t| t.streams.get(&id).cloned()).ok_or(INVALID_HANDLE)?;
                s.synchronize();
            }
        }
        Ok(())
    })
}

fn event(e: CUevent) -> Res<Arc<EventObj>> {
    tables(|t| t.events.get(&(e as usize)).cloned()).ok_or(INVALID_HANDLE)
}

/// # Safety
///
/// As the driver's `cuEventCreate`.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut CUevent, flags: c_uint) -> CUresult {
    crate::charge(strata_latency::Call::EventCreate);
    api(|| {
        let d = current_device()?;
        if flags & !0b111 != 0 || e.is_null() {
            return Err(INVALID_VALUE);
        }
        let obj = Arc::new(EventObj {
            device: d,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
        });
        let id = tables(|t| {
            let id = new_id(t);
            t.events.insert(id, obj);
            id
        });
        out(e, id as CUevent)
    })
}

/// # Safety
///
/// As the driver's `cuEventDestroy_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    crate::charge(strata_latency::Call::EventDestroy);
    api(|| {
        tables(|t| t.events.remove(&(e as usize)))
            .map(drop)
            .ok_or(INVALID_HANDLE)
    })
}

/// The event and the stream must belong to the same context.
///
/// # Safety
///
/// As the driver's `cuEventRecord`.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: CUevent, stream: CUstream) -> CUresult {
    crate::charge(strata_latency::Call::EventRecord);
    api(|| {
        let ev = event(e)?;
        let target = target(stream)?;
        if target.device() != ev.device {
            return Err(INVALID_HANDLE);
        }
        let generation = {
            let mut st = ev.state.lock();
            st.0 += 1;
            st.0
        };
        submit(&target, Box::new(move || ev.complete(generation)));
        Ok(())
    })
}

/// # Safety
///
/// As the driver's `cuEventQuery`.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    api(|| {
        let ev = event(e)?;
        let st = ev.state.lock();
        if st.1 >= st.0 {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_NOT_READY)
        }
    })
}

/// # Safety
///
/// As the driver's `cuEventSynchronize`.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    api(|| {
        let ev = event(e)?;
        let generation = ev.state.lock().0;
        ev.wait_for(generation);
        Ok(())
    })
}

/// Waits for the event's most recent record at the time of the call (none: no wait); the event
/// may belong to another context.
///
/// # Safety
///
/// As the driver's `cuStreamWaitEvent`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: CUstream,
    e: CUevent,
    flags: c_uint,
) -> CUresult {
    crate::charge(strata_latency::Call::StreamWaitEvent);
    api(|| {
        if flags > 1 {
            return Err(INVALID_VALUE);
        }
        let ev = event(e)?;
        let target = target(stream)?;
        let generation = ev.state.lock().0;
        submit(&target, Box::new(move || ev.wait_for(generation)));
        Ok(())
    })
}

/// A CPU address range the copy engine reads or writes.
struct Span {
    addr: usize,
    len: usize,
}

fn spans(pieces: &[Piece]) -> Vec<Span> {
    pieces
        .iter()
        .map(|p| Span {
            addr: p.addr,
            len: p.len,
        })
        .collect()
}

/// Copies between two span lists of equal total length.
///
/// # Safety
///
/// Every span is valid for its access (read for `src`, write for `dst`) during the call.
unsafe fn copy_spans(dst: &[Span], src: &[Span]) {
    let (mut di, mut doff, mut si, mut soff) = (0, 0, 0, 0);
    while di < dst.len() && si < src.len() {
        let n = (dst[di].len - doff).min(src[si].len - soff);
        // SAFETY: both ranges lie inside their spans (the caller's guarantee); `copy`
        // tolerates overlap.
        unsafe {
            std::ptr::copy(
                (src[si].addr + soff) as *const u8,
                (dst[di].addr + doff) as *mut u8,
                n,
            );
        }
        doff += n;
        soff += n;
        if doff == dst[di].len {
            di += 1;
            doff = 0;
        }
        if soff == src[si].len {
            si += 1;
            soff = 0;
        }
    }
}

/// A copy validated for `target` and ready to queue.
struct Copy {
    op: Op,
    /// Into pageable memory: the call returns once it completed.
    wait: bool,
}

/// Validates one copy of `len` bytes for the target's device; `stage` snapshots the source
/// now (pageable memory, or a batch's `DURING_API_CALL` order).
fn prepare_copy(target: &Target, dst: u64, src: u64, len: u64, stage: bool) -> Res<Copy> {
    let d = target.device();
    let to = resolve(dst, len, d, true)?;
    let from = resolve(src, len, d, false)?;
    let staged: Option<Vec<u8>> = match &from {
        Endpoint::Pageable(p) => Some(p),
        Endpoint::Pinned(p) if stage => Some(p),
        _ => None,
    }
    // SAFETY: the caller's host range is readable during the call.
    .map(|p| unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len) }.to_vec());
    let wait = matches!(to, Endpoint::Pageable(_));
    let direction = match (&from, &to) {
        (Endpoint::Device(_), Endpoint::Device(_)) => Some(Direction::DeviceToDevice),
        (Endpoint::Device(_), _) => Some(Direction::DeviceToHost),
        (_, Endpoint::Device(_)) => Some(Direction::HostToDevice),
        _ => None,
    };
    let mut ranges = device_ranges(&to, dst, len);
    ranges.extend(device_ranges(&from, src, len));
    let busy = in_flight(ranges);
    let (dst_pieces, src_pieces) = (pieces(to), pieces(from));
    let src_spans = match &staged {
        Some(v) => vec![Span {
            addr: v.as_ptr() as usize,
            len: v.len(),
        }],
        None => spans(&src_pieces),
    };
    let dst_spans = spans(&dst_pieces);
    let op: Op = Box::new(move || {
        if let (Some(direction), Some(emu)) = (direction, crate::EMU.get()) {
            emu.latency.copy(direction, len);
        }
        // SAFETY: device spans are views of memory kept alive by the pieces moved here; host
        // spans are valid until completion (the caller's contract); the staging vector moves
        // with the closure.
        unsafe { copy_spans(&dst_spans, &src_spans) };
        drop((dst_pieces, src_pieces, staged, busy));
    });
    Ok(Copy { op, wait })
}

fn queue(target: &Target, copies: Vec<Copy>) {
    let wait = copies.iter().any(|c| c.wait);
    for c in copies {
        submit(target, c.op);
    }
    if wait {
        if let Target::Stream(s) = target {
            s.synchronize();
        }
    }
}

/// # Safety
///
/// As the driver's `cuMemcpyAsync`: host ranges valid until the copy completes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    stream: CUstream,
) -> CUresult {
    api(|| {
        let target = target(stream)?;
        if len == 0 {
            return Ok(());
        }
        let copy = prepare_copy(&target, dst, src, len as u64, false)?;
        queue(&target, vec![copy]);
        Ok(())
    })
}

/// The CUDA 12.8 batch: every copy validated before any is queued; `failIdx` names the copy
/// that failed (`SIZE_MAX` when the failure is not one copy's). Not on the legacy default
/// stream; `attrsIdxs` starts at 0 and increases strictly; a valid `srcAccessOrder` each.
///
/// # Safety
///
/// As the driver's `cuMemcpyBatchAsync` (12.8 ABI): the arrays hold `count` and `num_attrs`
/// entries.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CUmemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: CUstream,
) -> CUresult {
    api(|| {
        let _ = out(fail_idx, usize::MAX);
        let ptrs_ok = !(dsts.is_null() || srcs.is_null() || sizes.is_null());
        let attrs_ok = !(attrs.is_null() || attrs_idxs.is_null());
        if count == 0 || !ptrs_ok || !attrs_ok || num_attrs == 0 || num_attrs > count {
            return Err(INVALID_VALUE);
        }
        if matches!(stream as usize, 0 | LEGACY) {
            return Err(INVALID_VALUE);
        }
        let target = target(stream)?;
        // SAFETY: the caller's arrays hold `count` / `num_attrs` entries.
        let (dsts, srcs, sizes, idxs) = unsafe {
            (
                std::slice::from_raw_parts(dsts, count),
                std::slice::from_raw_parts(srcs, count),
                std::slice::from_raw_parts(sizes, count),
                std::slice::from_raw_parts(attrs_idxs, num_attrs),
            )
        };
        if idxs[0] != 0 || idxs.windows(2).any(|w| w[1] <= w[0]) || idxs[num_attrs - 1] >= count {
            return Err(INVALID_VALUE);
        }
        let mut copies = Vec::with_capacity(count);
        for i in 0..count {
            let a = idxs.partition_point(|&start| start <= i) - 1;
            // SAFETY: `a < num_attrs` entries of the caller's array; the enum field is read as
            // a raw integer at its offset in cudarc's binding.
            let order = unsafe {
                crate::raw_u32(
                    attrs.add(a).cast(),
                    std::mem::offset_of!(CUmemcpyAttributes, srcAccessOrder),
                )
            };
            if !(1..=3).contains(&order) {
                let _ = out(fail_idx, i);
                return Err(INVALID_VALUE);
            }
            if sizes[i] == 0 {
                continue;
            }
            // DURING_API_CALL (2): the source is read before the call returns.
            match prepare_copy(&target, dsts[i], srcs[i], sizes[i] as u64, order == 2) {
                Ok(c) => copies.push(c),
                Err(e) => {
                    let _ = out(fail_idx, i);
                    return Err(e);
                }
            }
        }
        queue(&target, copies);
        Ok(())
    })
}

fn pieces(e: Endpoint) -> Vec<Piece> {
    match e {
        Endpoint::Device(p) => p,
        Endpoint::Pinned(p) | Endpoint::Pageable(p) => vec![p],
    }
}

/// # Safety
///
/// As the driver's `cuMemsetD8Async`.
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    value: u8,
    len: usize,
    stream: CUstream,
) -> CUresult {
    api(|| {
        let target = target(stream)?;
        if len == 0 {
            return Ok(());
        }
        let Endpoint::Device(pieces) = resolve(dst, len as u64, target.device(), true)? else {
            return Err(INVALID_VALUE);
        };
        let dst_spans = spans(&pieces);
        let busy = in_flight(vec![(dst, len as u64)]);
        submit(
            &target,
            Box::new(move || {
                for s in &dst_spans {
                    // SAFETY: views of device memory kept alive by `pieces`.
                    unsafe { std::ptr::write_bytes(s.addr as *mut u8, value, s.len) };
                }
                drop((pieces, busy));
            }),
        );
        Ok(())
    })
}

/// Kernels are not emulated.
///
/// # Safety
///
/// As the driver's `cuModuleLoadData`.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(
    _module: *mut *mut c_void,
    _image: *const c_void,
) -> CUresult {
    api(|| {
        current_device()?;
        Err(crate::NOT_SUPPORTED)
    })
}

/// Never reached (no module loads).
///
/// # Safety
///
/// As the driver's `cuModuleUnload`.
#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(_module: *mut c_void) -> CUresult {
    api(|| Err(INVALID_HANDLE))
}

/// Never reached (no module loads).
///
/// # Safety
///
/// As the driver's `cuModuleGetFunction`.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    _function: *mut *mut c_void,
    _module: *mut c_void,
    _name: *const std::ffi::c_char,
) -> CUresult {
    api(|| Err(INVALID_HANDLE))
}

/// Kernels are not emulated.
///
/// # Safety
///
/// As the driver's `cuLaunchKernel`.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    _f: *mut c_void,
    _grid_x: c_uint,
    _grid_y: c_uint,
    _grid_z: c_uint,
    _block_x: c_uint,
    _block_y: c_uint,
    _block_z: c_uint,
    _shared: c_uint,
    _stream: CUstream,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    api(|| Err(crate::NOT_SUPPORTED))
}
