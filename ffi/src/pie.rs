//! Pie's layer swapping through the C ABI (`strata_pie_*`): the decisions of
//! [`strata_tiers::pie`] for a caller that moves the bytes itself (the transformers cache swaps
//! one KV space per layer). Pure bookkeeping: no device, no copies.
//!
//! A controller holds a [`FifoSwapper`] (the mapping table and the FIFO protocol of Pie §3.3) and
//! an [`AdaptiveExpansion`] (§3.4.2). The number of CPU-resident layers it aims for is
//! `max(floor, expansion)`: the caller's floor (the layers its device budget cannot hold) and
//! what adaptive expansion climbed to (0 when `max_cpu_layers` is 0). Controllers live in a
//! generation-checked [`HandleTable`]; each has its own lock.
//!
//! Each controller also measures what TierKV's overlap condition needs ([`LayerOverlap`]: seed
//! 002, Eq. 1–2): the caller reports each layer's compute time and each transfer's bytes and
//! time per hop (host → device, disk → host), and asks whether a layer's transfer started now is
//! hidden by the compute of the layers in between, and how many layers ahead it must start.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_tiers::overlap::{Hop, LayerOverlap};
use strata_tiers::pie::{AdaptiveExpansion, FifoSwapper, State};
use strata_vmm::{Error, Result};

use crate::boundary;
use crate::handles::HandleTable;

/// `strata_pie_decision_t`: layers to start moving, -1 for none.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct strata_pie_decision_t {
    pub swap_in: i32,
    pub swap_out: i32,
}

/// `strata_pie_overlap_t`: TierKV's Eq. 1–2 for one layer's transfer (-1: not measured yet).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(non_camel_case_types)]
pub struct strata_pie_overlap_t {
    /// Layers ahead the transfer must start to be hidden (-1: not measured, or none suffices).
    pub steps: i32,
    /// Whether the transfer started at `from`'s start is hidden: 1, 0, or -1.
    pub fits: i32,
    /// Eq. 2, seconds.
    pub t_transfer: f64,
    /// The compute of the layers from `from` up to the layer, seconds.
    pub window: f64,
}

/// Eq. 2's block size for the controller's link fits (any size works: a transfer's time is its
/// latency plus its bytes over the bandwidth).
const OVERLAP_BLOCK: u64 = 4096;

struct Pie {
    swapper: FifoSwapper,
    expansion: AdaptiveExpansion,
    overlap: LayerOverlap,
    floor: usize,
    /// The mapping table's stamps: one tick per call that changes it.
    clock: u64,
}

impl Pie {
    fn layers(&self) -> usize {
        self.swapper.table.len()
    }

    fn layer(&self, layer: u32) -> Result<usize> {
        let l = layer as usize;
        if l >= self.layers() {
            return Err(Error::InvalidArgument(format!(
                "layer {layer} out of range ({} layers)",
                self.layers()
            )));
        }
        Ok(l)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Applies `max(floor, expansion)` CPU layers to the swapper; returns it.
    fn apply(&mut self) -> usize {
        let m = self.floor.max(self.expansion.m());
        self.swapper.set_cpu_layers(m, 0);
        m
    }
}

static PIES: HandleTable<Mutex<Pie>> = HandleTable::new("pie controller");

fn with_pie<T>(pie: u64, f: impl FnOnce(&mut Pie) -> Result<T>) -> Result<T> {
    let entry = PIES.get(pie)?;
    let mut p = entry.lock();
    f(&mut p)
}

/// Borrows an `out` argument; NULL is [`Error::InvalidArgument`].
///
/// # Safety
///
/// `out` is NULL or valid for writing one `T`, and not used by anyone else, for `'a`.
unsafe fn out_ref<'a, T>(what: &str, out: *mut T) -> Result<&'a mut T> {
    // SAFETY: NULL or writable and ours for `'a`, by this function's contract.
    unsafe { out.as_mut() }.ok_or_else(|| Error::InvalidArgument(format!("{what} is NULL")))
}

fn layer_or_none(l: Option<usize>) -> i32 {
    l.map_or(-1, |l| l as i32)
}

/// Creates a controller for `layers` layers, all on the device. Adaptive expansion may move up to
/// `max_cpu_layers` (< layers) of them to the CPU on its own.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pie_create(
    layers: u32,
    max_cpu_layers: u32,
    out: *mut u64,
) -> c_int {
    boundary::status("strata_pie_create", || {
        // SAFETY: `out` is NULL or writable, by this function's contract.
        let out = unsafe { out_ref("out", out) }?;
        if layers == 0 || layers > 1 << 16 || max_cpu_layers >= layers {
            return Err(Error::InvalidArgument(format!(
                "{layers} layers (1..=65536) with at most {max_cpu_layers} on the CPU (fewer \
                 than the layers)"
            )));
        }
        let n = layers as usize;
        let pie = Pie {
            swapper: FifoSwapper::new(n, 0, 0),
            expansion: AdaptiveExpansion::new(max_cpu_layers as usize),
            overlap: LayerOverlap::new(n, OVERLAP_BLOCK, Duration::ZERO),
            floor: 0,
            clock: 0,
        };
        *out = PIES.insert(Arc::new(Mutex::new(pie)))?;
        Ok(())
    })
}

/// Destroys a controller (its handle is stale afterwards).
#[no_mangle]
pub extern "C" fn strata_pie_destroy(pie: u64) -> c_int {
    boundary::status("strata_pie_destroy", || PIES.remove(pie).map(drop))
}

/// The least layers on the CPU (what the device budget cannot hold); `*cpu_layers` (if not
/// NULL) receives the number the controller now aims for.
///
/// # Safety
///
/// `cpu_layers` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pie_set_floor(pie: u64, floor: u32, cpu_layers: *mut u32) -> c_int {
    boundary::status("strata_pie_set_floor", || {
        with_pie(pie, |p| {
            if floor as usize >= p.layers() {
                return Err(Error::InvalidArgument(format!(
                    "{floor} layers on the CPU leave none of {} on the device",
                    p.layers()
                )));
            }
            p.floor = floor as usize;
            let m = p.apply();
            if !cpu_layers.is_null() {
                // SAFETY: `cpu_layers` is writable, by this function's contract.
                *unsafe { out_ref("cpu_layers", cpu_layers) }? = m as u32;
            }
            Ok(())
        })
    })
}

/// Layer `layer` begins: Pie's protocol picks a layer to swap in (the hottest on the CPU) and
/// one to swap out (the coldest on the device), each -1 when none.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pie_layer_start(
    pie: u64,
    layer: u32,
    out: *mut strata_pie_decision_t,
) -> c_int {
    boundary::status("strata_pie_layer_start", || {
        // SAFETY: `out` is NULL or writable, by this function's contract.
        let out = unsafe { out_ref("out", out) }?;
        with_pie(pie, |p| {
            let k = p.layer(layer)?;
            let now = p.tick();
            let d = p.swapper.on_layer_start(k, now);
            *out = strata_pie_decision_t {
                swap_in: layer_or_none(d.swap_in),
                swap_out: layer_or_none(d.swap_out),
            };
            Ok(())
        })
    })
}

/// The swap-in (`direction` 0) or swap-out (1) in flight finished: phase two of the mapping
/// table's update. None in flight: STRATA_INVALID_STATE.
#[no_mangle]
pub extern "C" fn strata_pie_swap_done(pie: u64, direction: c_int) -> c_int {
    boundary::status("strata_pie_swap_done", || {
        with_pie(pie, |p| {
            let now = p.tick();
            let (busy, what) = match direction {
                0 => (p.swapper.swapping_in().is_some(), "swap-in"),
                1 => (p.swapper.swapping_out().is_some(), "swap-out"),
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "direction {direction}: 0 (swap-in) or 1 (swap-out)"
                    )))
                }
            };
            if !busy {
                return Err(Error::InvalidState(format!("no {what} in flight")));
            }
            if direction == 0 {
                p.swapper.swap_in_done(now);
            } else {
                p.swapper.swap_out_done(now);
            }
            Ok(())
        })
    })
}

/// Where `layer` is: STRATA_PIE_GPU, _CPU, _SWAPPING_IN or _SWAPPING_OUT.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pie_state(pie: u64, layer: u32, out: *mut c_int) -> c_int {
    boundary::status("strata_pie_state", || {
        // SAFETY: `out` is NULL or writable, by this function's contract.
        let out = unsafe { out_ref("out", out) }?;
        with_pie(pie, |p| {
            *out = match p.swapper.table.entry(p.layer(layer)?).state {
                State::Gpu => 0,
                State::Cpu => 1,
                State::SwappingIn => 2,
                State::SwappingOut => 3,
            };
            Ok(())
        })
    })
}

/// One measurement interval ended (a decode step): `waited` nonzero if a layer waited on a
/// swap, `throughput` (tokens/s, finite, >= 0) over it. Adaptive expansion decides; the
/// controller aims for `max(floor, expansion)` CPU layers, written to `*cpu_layers` if not NULL.
///
/// # Safety
///
/// `cpu_layers` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pie_observe(
    pie: u64,
    waited: c_int,
    throughput: f64,
    cpu_layers: *mut u32,
) -> c_int {
    boundary::status("strata_pie_observe", || {
        if !(throughput.is_finite() && throughput >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "throughput {throughput}: finite and >= 0"
            )));
        }
        with_pie(pie, |p| {
            p.expansion.observe(waited != 0, throughput);
            let m = p.apply();
            if !cpu_layers.is_null() {
                // SAFETY: `cpu_layers` is writable, by this function's contract.
                *unsafe { out_ref("cpu_layers", cpu_layers) }? = m as u32;
            }
            Ok(())
        })
    })
}

fn seconds(what: &str, s: f64) -> Result<f64> {
    if s.is_finite() && s >= 0.0 {
        Ok(s)
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} {s}: finite and >= 0"
        )))
    }
}

/// Layer `layer` computed for `seconds` (from its start to the next layer's start): a sample of
/// Eq. 1's `T_iter` for it.
#[no_mangle]
pub extern "C" fn strata_pie_observe_compute(pie: u64, layer: u32, seconds: f64) -> c_int {
    boundary::status("strata_pie_observe_compute", || {
        let s = self::seconds("seconds", seconds)?;
        with_pie(pie, |p| {
            let l = p.layer(layer)?;
            p.overlap.observe_compute(l, s);
            Ok(())
        })
    })
}

/// A transfer of `bytes` over `hop` (`STRATA_PIE_HOST_TO_DEVICE` 0, `STRATA_PIE_DISK_TO_HOST` 1)
/// took `seconds`: a sample for that link's fit (Eq. 2's latency and bandwidth).
#[no_mangle]
pub extern "C" fn strata_pie_observe_transfer(
    pie: u64,
    hop: c_int,
    bytes: u64,
    seconds: f64,
) -> c_int {
    boundary::status("strata_pie_observe_transfer", || {
        let s = self::seconds("seconds", seconds)?;
        let hop = match hop {
            0 => Hop::HostToDevice,
            1 => Hop::DiskToHost,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "hop {hop}: 0 (host to device) or 1 (disk to host)"
                )))
            }
        };
        with_pie(pie, |p| {
            p.overlap.observe_transfer(hop, bytes, s);
            Ok(())
        })
    })
}

/// TierKV's overlap condition for `layer`'s transfer (`host_bytes` in host memory, `disk_bytes`
/// on disk) started when layer `from` begins: Eq. 2's transfer time, the compute window of the
/// layers in between, Eq. 1, and the least lookahead (in layers) that hides the transfer.
///
/// # Safety
///
/// `out` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pie_overlap(
    pie: u64,
    from: u32,
    layer: u32,
    host_bytes: u64,
    disk_bytes: u64,
    out: *mut strata_pie_overlap_t,
) -> c_int {
    boundary::status("strata_pie_overlap", || {
        // SAFETY: NULL or writable for the call, by this function's contract.
        let out = unsafe { out_ref("out", out) }?;
        with_pie(pie, |p| {
            let (f, l) = (p.layer(from)?, p.layer(layer)?);
            let o = p.overlap.overlap(f, l, host_bytes, disk_bytes);
            *out = strata_pie_overlap_t {
                steps: o.steps.map_or(-1, |k| k as i32),
                fits: o.fits.map_or(-1, i32::from),
                t_transfer: o.t_transfer.map_or(-1.0, |t| t.as_secs_f64()),
                window: o.window.map_or(-1.0, |t| t.as_secs_f64()),
            };
            Ok(())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    const NONE: strata_pie_decision_t = strata_pie_decision_t {
        swap_in: -1,
        swap_out: -1,
    };

    fn create(layers: u32, max_cpu: u32) -> u64 {
        let mut h = 0;
        // SAFETY: `h` is writable.
        assert_eq!(unsafe { strata_pie_create(layers, max_cpu, &mut h) }, 0);
        h
    }

    fn start(pie: u64, layer: u32) -> strata_pie_decision_t {
        let mut d = NONE;
        // SAFETY: `d` is writable.
        assert_eq!(unsafe { strata_pie_layer_start(pie, layer, &mut d) }, 0);
        d
    }

    fn state(pie: u64, layer: u32) -> c_int {
        let mut s = -1;
        // SAFETY: `s` is writable.
        assert_eq!(unsafe { strata_pie_state(pie, layer, &mut s) }, 0);
        s
    }

    #[test]
    fn the_decision_has_the_header_layout() {
        assert_eq!(std::mem::size_of::<strata_pie_decision_t>(), 8);
        assert_eq!(std::mem::align_of::<strata_pie_decision_t>(), 4);
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut h = 0;
        let bad = Status::InvalidArgument as c_int;
        let mut d = NONE;
        // SAFETY: every out pointer is writable or NULL (refused).
        unsafe {
            assert_eq!(strata_pie_create(0, 0, &mut h), bad);
            assert_eq!(strata_pie_create(4, 4, &mut h), bad);
            assert_eq!(strata_pie_create(4, 0, std::ptr::null_mut()), bad);
            let p = create(4, 0);
            assert_eq!(strata_pie_set_floor(p, 4, std::ptr::null_mut()), bad);
            assert_eq!(strata_pie_layer_start(p, 4, &mut d), bad);
            assert_eq!(
                strata_pie_observe(p, 0, f64::NAN, std::ptr::null_mut()),
                bad
            );
            assert_eq!(strata_pie_swap_done(p, 2), bad);
            assert_eq!(strata_pie_swap_done(p, 0), Status::InvalidState as c_int);
            assert_eq!(strata_pie_destroy(p), 0);
            assert_eq!(strata_pie_destroy(p), Status::InvalidHandle as c_int);
            assert_eq!(
                strata_pie_layer_start(p, 0, &mut d),
                Status::InvalidHandle as c_int
            );
        }
    }

    #[test]
    fn a_floor_turns_into_fifo_swaps_that_bring_each_layer_back_before_it_runs() {
        // Four layers, room for two on the device: the coldest (last computed) goes out, the
        // hottest CPU layer (the next needed) comes in.
        let p = create(4, 0);
        let mut m = 0;
        // SAFETY: `m` is writable.
        assert_eq!(unsafe { strata_pie_set_floor(p, 2, &mut m) }, 0);
        assert_eq!(m, 2);
        // Everything starts on the device: the floor forces two swap-outs, one at a time.
        let d = start(p, 0);
        assert_eq!(
            (d.swap_in, d.swap_out),
            (-1, 3),
            "the coldest while layer 0 runs is 3"
        );
        assert_eq!(state(p, 3), 3);
        assert_eq!(strata_pie_swap_done(p, 1), 0);
        assert_eq!(state(p, 3), 1);
        let d = start(p, 1);
        assert_eq!(d.swap_out, 0);
        assert_eq!(strata_pie_swap_done(p, 1), 0);
        // Layer 2 runs on the device; layer 1 (just computed) goes out, then layer 3 (the next
        // needed) comes in: a FIFO.
        let d = start(p, 2);
        assert_eq!((d.swap_in, d.swap_out), (-1, 1));
        assert_eq!(strata_pie_swap_done(p, 1), 0);
        let d = start(p, 2);
        assert_eq!((d.swap_in, d.swap_out), (3, -1));
        assert_eq!(state(p, 3), 2);
        assert_eq!(strata_pie_swap_done(p, 0), 0);
        assert_eq!(state(p, 3), 0);
        // Never more than two layers on the device.
        let on_device = (0..4).filter(|&l| matches!(state(p, l), 0 | 2 | 3)).count();
        assert!(on_device <= 2, "{on_device}");
        assert_eq!(strata_pie_destroy(p), 0);
    }

    #[test]
    fn the_overlap_has_the_header_layout_and_follows_the_measurements() {
        assert_eq!(std::mem::size_of::<strata_pie_overlap_t>(), 24);
        let p = create(4, 0);
        let mut o = strata_pie_overlap_t {
            steps: 9,
            fits: 9,
            t_transfer: 9.0,
            window: 9.0,
        };
        // SAFETY: `o` is writable.
        unsafe {
            assert_eq!(strata_pie_overlap(p, 0, 2, 1 << 20, 0, &mut o), 0);
            assert_eq!(
                (o.steps, o.fits, o.t_transfer, o.window),
                (-1, -1, -1.0, -1.0)
            );
            for l in 0..4 {
                assert_eq!(strata_pie_observe_compute(p, l, 2e-3), 0);
            }
            // 1 MiB in 3 ms, 2 MiB in 5 ms: 1 ms + 2 ms per MiB.
            assert_eq!(strata_pie_observe_transfer(p, 0, 1 << 20, 3e-3), 0);
            assert_eq!(strata_pie_observe_transfer(p, 0, 2 << 20, 5e-3), 0);
            assert_eq!(strata_pie_overlap(p, 1, 2, 1 << 20, 0, &mut o), 0);
            assert!((o.t_transfer - 3e-3).abs() < 1e-9, "{o:?}");
            assert!((o.window - 2e-3).abs() < 1e-9, "{o:?}");
            assert_eq!((o.fits, o.steps), (0, 2));
            assert_eq!(strata_pie_overlap(p, 0, 2, 1 << 20, 0, &mut o), 0);
            assert_eq!(o.fits, 1);
            // A disk hop not measured yet: unknown.
            assert_eq!(strata_pie_overlap(p, 0, 2, 0, 1 << 20, &mut o), 0);
            assert_eq!((o.steps, o.fits), (-1, -1));
            let bad = Status::InvalidArgument as c_int;
            assert_eq!(strata_pie_observe_transfer(p, 2, 1, 1.0), bad);
            assert_eq!(strata_pie_observe_transfer(p, 0, 1, -1.0), bad);
            assert_eq!(strata_pie_observe_compute(p, 4, 1.0), bad);
            assert_eq!(strata_pie_observe_compute(p, 0, f64::NAN), bad);
            assert_eq!(strata_pie_overlap(p, 0, 4, 0, 0, &mut o), bad);
            assert_eq!(strata_pie_overlap(p, 0, 1, 0, 0, std::ptr::null_mut()), bad);
        }
        assert_eq!(strata_pie_destroy(p), 0);
    }

    #[test]
    fn adaptive_expansion_climbs_above_the_floor_and_backs_off_on_waits() {
        let p = create(6, 3);
        let mut m = 0;
        // SAFETY: `m` is writable.
        unsafe {
            assert_eq!(strata_pie_observe(p, 0, 100.0, &mut m), 0);
            assert_eq!(m, 1, "no wait: one more layer on the CPU");
            assert_eq!(strata_pie_observe(p, 0, 0.0, &mut m), 0);
            assert_eq!(m, 1, "the interval after a change settles");
            assert_eq!(strata_pie_observe(p, 1, 100.0, &mut m), 0);
            assert_eq!(m, 0, "a wait backs off");
            // The floor wins over the expansion.
            assert_eq!(strata_pie_set_floor(p, 2, &mut m), 0);
            assert_eq!(m, 2);
        }
        assert_eq!(strata_pie_destroy(p), 0);
    }
}
