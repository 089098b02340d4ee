//! MIRAGE through the C ABI (`strata_params_*`): a model's layers as strata parameter memory
//! with a host copy as authority; the remapping controller gives idle models' layer pages to
//! the device's pool (where KV spaces and `strata_malloc` grow) and takes them back; streamed
//! layers are reloaded into slots with `prepare_layer`, ordered on the caller's stream.
//!
//! One [`Mirage`] per device, kept by the device's runtime and created on first use over its
//! one pool (as parameter pool and KV pool alike), behind a lock per device. A model handle is
//! `(device + 1) << 32 | (model id + 1)`; ids are never reused, so a handle stays valid until
//! `strata_params_unregister`, and any other value (an unregistered model's included) is
//! `STRATA_INVALID_HANDLE`.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use strata_tiers::mirage::{Mirage, ModelId};
use strata_vmm::{Error, Event, Result};

use crate::boundary;
use crate::global::global;
use crate::{stream_of, CudaStream};

/// `strata_params_model_stats_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_params_model_stats_t {
    pub device: i32,
    pub layers: u32,
    pub layer_bytes: u64,
    pub pages_per_layer: u64,
    pub remapped_layers: u32,
    pub streamed_layers: u32,
    pub slots: u32,
    pub remap_limit: u32,
    pub gpu_pages: u64,
    pub transfer_ns: u64,
    pub streamed_runs: u64,
    pub slot_loads: u64,
    pub loads_ahead: u64,
    pub found_prepared: u64,
    pub load_waits: u64,
    pub spare: [u64; 4],
}

/// `STRATA_PARAMS_NO_LAYER`: `strata_params_prepare_next` had no layer to prepare.
pub const NO_LAYER: u32 = u32::MAX;

/// Runs `f` on `device`'s MIRAGE state, creating it on first use
/// ([`DeviceRuntime::with_mirage`](strata_runtime::DeviceRuntime::with_mirage)).
fn with_device<T>(device: u32, f: impl FnOnce(&mut Mirage) -> Result<T>) -> Result<T> {
    global()?.device(device)?.with_mirage(f)
}

/// The device and model of a handle; anything no registration returned is a stale handle.
fn model_of(handle: u64) -> Result<(u32, ModelId)> {
    let stale = || Error::StaleId {
        kind: "parameter model",
        index: (handle & 0xffff_ffff) as u32,
        generation: (handle >> 32) as u32,
    };
    let device = ((handle >> 32) as u32)
        .checked_sub(1)
        .filter(|&d| (d as usize) < global().map_or(0, |g| g.device_count()))
        .ok_or_else(stale)?;
    let id = ((handle & 0xffff_ffff) as u32)
        .checked_sub(1)
        .ok_or_else(stale)?;
    Ok((device, ModelId(id)))
}

/// Runs `f` on the model of `handle` (unknown models are stale handles).
fn with_model<T>(handle: u64, f: impl FnOnce(&mut Mirage, ModelId) -> Result<T>) -> Result<T> {
    let (device, id) = model_of(handle)?;
    with_device(device, |m| {
        m.registry().layers(id).map_err(|_| Error::StaleId {
            kind: "parameter model",
            index: id.0,
            generation: device,
        })?;
        f(m, id)
    })
}

fn out_ptr<T>(what: &str, out: *mut T) -> Result<*mut T> {
    if out.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    Ok(out)
}

/// Registers a model of `layers` layers of `layer_bytes` bytes on `device`.
///
/// # Safety
///
/// `host_layers` is NULL (an error) or holds `layers` pointers, each readable for
/// `layer_bytes` bytes; `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_params_register(
    device: c_int,
    layers: u32,
    layer_bytes: u64,
    cap: u32,
    host_layers: *const *const c_void,
    out: *mut u64,
) -> c_int {
    boundary::status("strata_params_register", || {
        let out = out_ptr("out", out)?;
        if layers == 0 || layer_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "{layers} layers of {layer_bytes} bytes"
            )));
        }
        let len = usize::try_from(layer_bytes).map_err(|_| Error::Overflow("layer_bytes"))?;
        if host_layers.is_null() {
            return Err(Error::InvalidArgument("host_layers is NULL".into()));
        }
        // SAFETY: `layers` readable pointers by this function's contract.
        let sources = unsafe { std::slice::from_raw_parts(host_layers, layers as usize) };
        if let Some(l) = sources.iter().position(|p| p.is_null()) {
            return Err(Error::InvalidArgument(format!("host_layers[{l}] is NULL")));
        }
        let d = global()?.device(device)?.device();
        let id = with_device(d, |m| {
            m.register_model(layers, layer_bytes, cap, |l, dst| {
                // SAFETY: each source is readable for `layer_bytes` bytes (contract); `dst`
                // holds at least that many (the layer rounded up to pages).
                let src = unsafe { std::slice::from_raw_parts(sources[l as usize].cast(), len) };
                dst[..len].copy_from_slice(src);
            })
        })?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(u64::from(d + 1) << 32 | u64::from(id.0 + 1)) };
        Ok(())
    })
}

/// Unregisters a model: every page it holds goes back to the device's pool; the handle is
/// stale from then on. Refused (`STRATA_INVALID_STATE`, nothing changed) while the model is
/// active or a slot holds a layer not reported done.
///
/// # Safety
///
/// `pages_returned` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_params_unregister(model: u64, pages_returned: *mut u64) -> c_int {
    boundary::status("strata_params_unregister", || {
        let given = with_model(model, |m, id| m.unregister_model(id))?;
        if !pages_returned.is_null() {
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { pages_returned.write(given as u64) };
        }
        Ok(())
    })
}

/// Where `layer`'s parameters are now (resident: its own address; streamed: its slot, once
/// prepared).
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_params_layer_ptr(model: u64, layer: u32, out: *mut u64) -> c_int {
    boundary::status("strata_params_layer_ptr", || {
        let out = out_ptr("out", out)?;
        let ptr = with_model(model, |m, id| m.layer_ptr(id, layer))?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(ptr) };
        Ok(())
    })
}

/// Marks a model serving (its layers are not remapped) or idle.
#[no_mangle]
pub extern "C" fn strata_params_set_active(model: u64, active: c_int) -> c_int {
    boundary::status("strata_params_set_active", || {
        with_model(model, |m, id| {
            m.controller_mut().set_active(id, active != 0);
            Ok(())
        })
    })
}

/// Reports a model's prefill time (its `T_compute` while idle: MIRAGE §5.3).
#[no_mangle]
pub extern "C" fn strata_params_report_prefill(model: u64, prefill_ns: u64) -> c_int {
    boundary::status("strata_params_report_prefill", || {
        with_model(model, |m, id| {
            m.controller_mut()
                .report_prefill(id, Duration::from_nanos(prefill_ns));
            Ok(())
        })
    })
}

/// Reports a model's compute time per layer (`T_c` of MIRAGE's budget `T_T · N ≤ T_compute`).
#[no_mangle]
pub extern "C" fn strata_params_report_compute(model: u64, per_layer_ns: u64) -> c_int {
    boundary::status("strata_params_report_compute", || {
        with_model(model, |m, id| {
            m.controller_mut()
                .report_compute(id, Duration::from_nanos(per_layer_ns));
            Ok(())
        })
    })
}

/// One controller step on `device`: `pages_short` pages the KV cache could not get (0: revert
/// what the pool could hand out covers: free pages and room left on the device).
///
/// # Safety
///
/// `decisions` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_params_step(
    device: c_int,
    pages_short: u64,
    decisions: *mut u32,
) -> c_int {
    boundary::status("strata_params_step", || {
        let short = usize::try_from(pages_short).map_err(|_| Error::Overflow("pages_short"))?;
        let d = global()?.device(device)?.device();
        let n = with_device(d, |m| {
            let pressure = m.pressure(short);
            m.step(pressure).map(|ds| ds.len())
        })?;
        if !decisions.is_null() {
            // SAFETY: non-NULL and writable by this function's contract.
            unsafe { decisions.write(n as u32) };
        }
        Ok(())
    })
}

/// Reverts every remapped layer of every model on `device`.
#[no_mangle]
pub extern "C" fn strata_params_revert_all(device: c_int) -> c_int {
    boundary::status("strata_params_revert_all", || {
        let d = global()?.device(device)?.device();
        with_device(d, |m| m.revert_all().map(drop))
    })
}

/// Makes `layer` ready; `stream` waits for its reload (no host synchronization).
#[no_mangle]
pub extern "C" fn strata_params_prepare_layer(model: u64, layer: u32, stream: CudaStream) -> c_int {
    boundary::status("strata_params_prepare_layer", || {
        with_model(model, |m, id| {
            let ev = m.prepare_layer(id, layer)?;
            m.engine()
                .backend()
                .stream_wait_event(stream_of(stream), ev.handle())
        })
    })
}

/// The look-ahead: queues the load of the next streamed layer after `after` (ring order) into a
/// slot that can take it now; no stream waits for it until `strata_params_prepare_layer`.
///
/// # Safety
///
/// `prepared` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_params_prepare_next(
    model: u64,
    after: u32,
    prepared: *mut u32,
) -> c_int {
    boundary::status("strata_params_prepare_next", || {
        let prepared = out_ptr("prepared", prepared)?;
        let next = with_model(model, |m, id| {
            let layers = m.registry().layers(id)?;
            if after >= layers {
                return Err(Error::InvalidArgument(format!(
                    "no layer {after}: the model has {layers}"
                )));
            }
            m.prepare_next(id, after)
        })?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { prepared.write(next.map_or(NO_LAYER, |(layer, _)| layer)) };
        Ok(())
    })
}

/// The layer's kernels were queued on `stream`: its slot may be reloaded once they complete.
#[no_mangle]
pub extern "C" fn strata_params_layer_done(model: u64, layer: u32, stream: CudaStream) -> c_int {
    boundary::status("strata_params_layer_done", || {
        with_model(model, |m, id| {
            let ev = Event::new(m.engine().backend())?;
            ev.record(stream_of(stream))?;
            m.layer_done(id, layer, Arc::new(ev))
        })
    })
}

/// Copies `len` bytes of `layer` at `offset` into host memory (a backend copy; test support).
///
/// # Safety
///
/// `dst` is NULL with `len == 0`, or writable for `len` bytes and ours for the call.
#[no_mangle]
pub unsafe extern "C" fn strata_params_read(
    model: u64,
    layer: u32,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> c_int {
    boundary::status("strata_params_read", || {
        if len == 0 {
            return Ok(());
        }
        let dst = out_ptr("dst", dst)?;
        with_model(model, |m, id| {
            let bytes = m.registry().layer_bytes(id)?;
            if offset.checked_add(len as u64).is_none_or(|end| end > bytes) {
                return Err(Error::InvalidArgument(format!(
                    "{len} bytes at {offset} past the layer's {bytes}"
                )));
            }
            let ptr = m.layer_ptr(id, layer)?;
            // SAFETY: writable for `len` bytes and ours for the call (contract).
            let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) };
            m.engine().backend().read(ptr + offset, out)
        })
    })
}

/// A model's figures.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_params_model_stats(
    model: u64,
    out: *mut strata_params_model_stats_t,
) -> c_int {
    boundary::status("strata_params_model_stats", || {
        let out = out_ptr("out", out)?;
        let (device, _) = model_of(model)?;
        let stats = with_model(model, |m, id| {
            let r = m.registry();
            let plan = r.plan(id)?;
            let streams = r.stream_stats(id)?;
            Ok(strata_params_model_stats_t {
                device: device as i32,
                layers: r.layers(id)?,
                layer_bytes: r.layer_bytes(id)?,
                pages_per_layer: r.pages_per_layer(id)? as u64,
                remapped_layers: plan.alpha,
                streamed_layers: plan.streamed.len() as u32,
                slots: plan.beta(),
                remap_limit: m.controller().limit(id),
                gpu_pages: r.gpu_pages(id)? as u64,
                transfer_ns: m
                    .controller()
                    .transfer_time()
                    .map_or(0, |t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)),
                streamed_runs: streams.streamed_runs,
                slot_loads: streams.slot_loads,
                loads_ahead: streams.loads_ahead,
                found_prepared: streams.found_prepared,
                load_waits: streams.load_waits,
                spare: [0; 4],
            })
        })?;
        // SAFETY: non-NULL and writable by this function's contract.
        unsafe { out.write(stats) };
        Ok(())
    })
}
