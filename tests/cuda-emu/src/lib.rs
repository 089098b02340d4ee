//! An emulated CUDA driver: a `libcuda.so.1` implementing the driver calls strata makes, over
//! host memory, so that `CudaBackend`, the C ABI and the preload shim run their CUDA code paths
//! in CI without a GPU.
//!
//! It follows the driver API's documented semantics and result codes (CONTRIBUTING.md, "Driver
//! rules the emulator and the host backend follow", lists each rule and its source):
//!
//! - `cuInit` first, else `CUDA_ERROR_NOT_INITIALIZED`; devices from `STRATA_CUDA_EMU_DEVICES`
//!   (`2x8GiB`: count × memory, the default) and `STRATA_CUDA_EMU_GRANULARITY` (`2MiB`), compute
//!   capability 9.0;
//! - primary contexts with a per-thread current context: calls that work "in the current
//!   context" (`cuMemGetInfo`, `cuMemAlloc*`, `cuMemHostAlloc`, streams, events, work on the
//!   default stream) fail with `CUDA_ERROR_INVALID_CONTEXT` without one, and with
//!   `CUDA_ERROR_CONTEXT_IS_DESTROYED` once its primary context was released;
//! - VMM (`mem/`): reservations are `PROT_NONE` address space that the CPU can never touch
//!   (device memory is not CPU-accessible, as on a GPU); physical memory is a `memfd` per handle,
//!   shared by mappings and exportable as a file descriptor; unmapping a range that queued work
//!   still touches is a device fault (a sticky `CUDA_ERROR_ILLEGAL_ADDRESS` from then on);
//! - streams are in-order worker threads, events complete when their stream reaches them,
//!   copies and fills really copy (`stream.rs`);
//! - kernels are not emulated: `cuModuleLoadData` is `CUDA_ERROR_NOT_SUPPORTED`;
//! - `STRATA_HOST_LATENCY` (`none`, `a100`, `h200`, a file: `strata-latency`) charges each VMM,
//!   stream, event and pinned-memory call its cost and each copy its link time, as the host
//!   backend does; `STRATA_CUDA_EMU_IMPORTED_MAPS=refuse` refuses to map imported handles.
//!
//! Struct layouts come from cudarc's bindings of NVIDIA's `cuda.h`; enum fields written by a
//! caller are read as raw integers (an unknown value is an error code, never undefined
//! behaviour).

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::{CUcontext, CUdevice, CUresult};

mod mem;
mod proc;
mod stream;

/// Bytes of the mapping granularity (every location): `STRATA_CUDA_EMU_GRANULARITY`
/// (`64KiB`, `2MiB`, ...; a power of two of at least 64 KiB), 2 MiB by default.
static GRANULARITY: AtomicU64 = AtomicU64::new(2 << 20);

pub(crate) fn granularity() -> u64 {
    GRANULARITY.load(Ordering::Relaxed)
}

/// Device memory an active primary context takes for itself (one granule here; a real
/// context's is larger): its free memory is below the device's total, as on a GPU.
fn context_bytes() -> u64 {
    granularity()
}

/// The driver version the emulator reports (CUDA 12.8, with `cuMemcpyBatchAsync`).
const DRIVER_VERSION: c_int = 12080;

/// One emulated device and its primary context.
pub(crate) struct Device {
    pub(crate) total: u64,
    /// Bytes of physical memory created on it (handles not yet freed).
    pub(crate) used: AtomicU64,
    /// Primary-context retains; 0: inactive.
    retains: AtomicU32,
    /// The primary context's handle value (the address of this field's box).
    ctx: Box<u8>,
}

pub(crate) struct Emu {
    pub(crate) devices: Vec<Device>,
    /// `STRATA_CUDA_EMU_IMPORTED_MAPS=refuse`: `cuMemMap` of an imported handle is
    /// `CUDA_ERROR_NOT_SUPPORTED`, as on the H200 virtual machine of 2026-11-27 (driver 580.159,
    /// `shared/gpu-runs/2026-11-27-h200`), in the importing process and in the exporting one.
    pub(crate) refuse_imported_maps: bool,
    /// `STRATA_HOST_LATENCY`: what each call and copy costs (nothing by default).
    pub(crate) latency: strata_latency::Charger,
}

/// Pays for `call` under the latency profile (once initialized).
pub(crate) fn charge(call: strata_latency::Call) {
    if let Some(emu) = EMU.get() {
        emu.latency.call(call);
    }
}

static EMU: OnceLock<Emu> = OnceLock::new();

thread_local! {
    /// The calling thread's current context (its handle value; 0: none).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

pub(crate) use CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED as CONTEXT_IS_DESTROYED;
pub(crate) use CUresult::CUDA_ERROR_INVALID_CONTEXT as INVALID_CONTEXT;
pub(crate) use CUresult::CUDA_ERROR_INVALID_DEVICE as INVALID_DEVICE;
pub(crate) use CUresult::CUDA_ERROR_INVALID_HANDLE as INVALID_HANDLE;
pub(crate) use CUresult::CUDA_ERROR_INVALID_VALUE as INVALID_VALUE;
pub(crate) use CUresult::CUDA_ERROR_NOT_INITIALIZED as NOT_INITIALIZED;
pub(crate) use CUresult::CUDA_ERROR_NOT_SUPPORTED as NOT_SUPPORTED;
pub(crate) use CUresult::CUDA_ERROR_OUT_OF_MEMORY as OUT_OF_MEMORY;
pub(crate) use CUresult::CUDA_SUCCESS as SUCCESS;

/// `Ok` or a driver error code.
pub(crate) type Res<T = ()> = Result<T, CUresult>;

/// A sticky error (as after a device fault): once set, every call returns it.
static STICKY: AtomicU32 = AtomicU32::new(0);

/// Records a device fault: `CUDA_ERROR_ILLEGAL_ADDRESS` from every later call, as a real
/// context is unusable after a kernel or copy touched unmapped memory.
pub(crate) fn fault(why: &str) {
    eprintln!("strata-cuda-emu: device fault: {why}; every later call fails");
    STICKY.store(
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS as u32,
        Ordering::Release,
    );
}

/// Turns a body's result into the code the C caller gets; a panic becomes
/// `CUDA_ERROR_UNKNOWN` (never an unwind into C).
pub(crate) fn api(f: impl FnOnce() -> Res) -> CUresult {
    if STICKY.load(Ordering::Acquire) != 0 {
        return CUresult::CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
    }
}

/// The initialized driver.
pub(crate) fn emu() -> Res<&'static Emu> {
    EMU.get().ok_or(NOT_INITIALIZED)
}

/// Writes `value` through a caller's out-pointer (`CUDA_ERROR_INVALID_VALUE` when null).
pub(crate) fn out<T>(ptr: *mut T, value: T) -> Res {
    if ptr.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null; the driver API's contract makes every out-pointer valid for a write
    // of its type.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Reads a `u32`-sized enum field at `offset` bytes into the caller's struct at `base`.
///
/// # Safety
///
/// `base` points to a readable value of the struct whose field lies at `offset`.
pub(crate) unsafe fn raw_u32(base: *const c_void, offset: usize) -> u32 {
    // SAFETY: the caller guarantees the struct and the field's offset (from `offset_of!` on
    // cudarc's binding); an unaligned read is used so no alignment is assumed.
    unsafe { base.cast::<u8>().add(offset).cast::<u32>().read_unaligned() }
}

/// `SIZE` with an optional KiB/MiB/GiB suffix.
fn parse_size(size: &str) -> Option<u64> {
    let size = size.trim();
    let (digits, unit) = size
        .find(|c: char| !c.is_ascii_digit())
        .map_or((size, ""), |i| size.split_at(i));
    let unit = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(unit)
}

/// Reads `STRATA_CUDA_EMU_GRANULARITY` and `STRATA_CUDA_EMU_DEVICES` (`NxSIZE`).
fn device_config() -> Vec<u64> {
    if let Ok(spec) = std::env::var("STRATA_CUDA_EMU_GRANULARITY") {
        match parse_size(&spec).filter(|g| g.is_power_of_two() && *g >= 64 << 10) {
            Some(g) => GRANULARITY.store(g, Ordering::Relaxed),
            None => eprintln!("strata-cuda-emu: bad STRATA_CUDA_EMU_GRANULARITY={spec:?}; 2MiB"),
        }
    }
    let spec = std::env::var("STRATA_CUDA_EMU_DEVICES").unwrap_or_else(|_| "2x8GiB".into());
    let parse = |s: &str| -> Option<Vec<u64>> {
        let (n, size) = s.trim().split_once('x')?;
        let n: usize = n.parse().ok()?;
        let bytes = parse_size(size)?;
        let g = granularity();
        (n > 0 && bytes % g == 0 && bytes >= 2 * g).then(|| vec![bytes; n])
    };
    parse(&spec).unwrap_or_else(|| {
        eprintln!("strata-cuda-emu: bad STRATA_CUDA_EMU_DEVICES={spec:?}; using 2x8GiB");
        vec![8 << 30; 2]
    })
}

/// Reads `STRATA_CUDA_EMU_IMPORTED_MAPS` (`allow`, the default, or `refuse`).
fn imported_maps_refused() -> bool {
    match std::env::var("STRATA_CUDA_EMU_IMPORTED_MAPS").as_deref() {
        Ok("refuse") => true,
        Ok("allow") | Err(_) => false,
        Ok(other) => {
            eprintln!("strata-cuda-emu: bad STRATA_CUDA_EMU_IMPORTED_MAPS={other:?}; allow");
            false
        }
    }
}

/// The device of the calling thread's current context.
pub(crate) fn current_device() -> Res<usize> {
    let emu = emu()?;
    let ctx = CURRENT.with(Cell::get);
    if ctx == 0 {
        return Err(INVALID_CONTEXT);
    }
    let d = emu
        .devices
        .iter()
        .position(|d| ctx_value(d) == ctx)
        .ok_or(INVALID_CONTEXT)?;
    if emu.devices[d].retains.load(Ordering::Acquire) == 0 {
        return Err(CONTEXT_IS_DESTROYED);
    }
    Ok(d)
}

fn ctx_value(d: &Device) -> usize {
    std::ptr::from_ref::<u8>(&d.ctx) as usize
}

pub(crate) fn device_index(emu: &Emu, dev: c_int) -> Res<usize> {
    usize::try_from(dev)
        .ok()
        .filter(|&d| d < emu.devices.len())
        .ok_or(INVALID_DEVICE)
}

/// # Safety
///
/// As the driver's `cuInit`.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    api(|| {
        if flags != 0 {
            return Err(INVALID_VALUE);
        }
        EMU.get_or_init(|| Emu {
            devices: device_config()
                .into_iter()
                .map(|total| Device {
                    total,
                    used: AtomicU64::new(0),
                    retains: AtomicU32::new(0),
                    ctx: Box::new(0),
                })
                .collect(),
            refuse_imported_maps: imported_maps_refused(),
            latency: strata_latency::Charger::new(
                strata_latency::Profile::from_env().unwrap_or_else(|e| {
                    eprintln!("strata-cuda-emu: {e}; charging nothing");
                    strata_latency::Profile::none()
                }),
            ),
        });
        Ok(())
    })
}

/// # Safety
///
/// As the driver's `cuDriverGetVersion`.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    api(|| out(version, DRIVER_VERSION))
}

/// # Safety
///
/// As the driver's `cuDeviceGetCount`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    api(|| out(count, emu()?.devices.len() as c_int))
}

/// # Safety
///
/// As the driver's `cuDeviceGet`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    api(|| {
        device_index(emu()?, ordinal)?;
        out(device, ordinal)
    })
}

/// # Safety
///
/// As the driver's `cuDeviceGetName`: `name` writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    api(|| {
        device_index(emu()?, dev)?;
        let len = usize::try_from(len).map_err(|_| INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(INVALID_VALUE);
        }
        let text = format!("strata emulated device {dev}");
        let n = text.len().min(len - 1);
        // SAFETY: `name` is writable for `len` bytes (the caller's contract); `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// # Safety
///
/// As the driver's `cuDeviceTotalMem_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    api(|| {
        let emu = emu()?;
        let d = device_index(emu, dev)?;
        out(bytes, emu.devices[d].total as usize)
    })
}

/// Compute capability 9.0, and the grid limit the block-copy launcher reads; other attributes
/// are not emulated (`CUDA_ERROR_NOT_SUPPORTED`).
///
/// # Safety
///
/// As the driver's `cuDeviceGetAttribute`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_uint,
    dev: CUdevice,
) -> CUresult {
    use cudarc::driver::sys::CUdevice_attribute as A;
    api(|| {
        device_index(emu()?, dev)?;
        let v = match attribute {
            a if a == A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as u32 => 9,
            a if a == A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as u32 => 0,
            a if a == A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X as u32 => i32::MAX,
            a if a == A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING as u32 => 1,
            a if a == A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED as u32 => 1,
            a if a == A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED as u32 => {
                1
            }
            _ => return Err(NOT_SUPPORTED),
        };
        out(value, v)
    })
}

/// # Safety
///
/// As the driver's `cuDevicePrimaryCtxRetain`.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    api(|| {
        let emu = emu()?;
        let d = &emu.devices[device_index(emu, dev)?];
        out(ctx, ctx_value(d) as CUcontext)?;
        if d.retains.fetch_add(1, Ordering::AcqRel) == 0 {
            d.used.fetch_add(context_bytes(), Ordering::AcqRel);
        }
        Ok(())
    })
}

/// Releasing the last retain deactivates the context: its streams, events and `cuMemAlloc`
/// memory are destroyed, and it stays current (unusable) where it was.
///
/// # Safety
///
/// As the driver's `cuDevicePrimaryCtxRelease_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    api(|| {
        let emu = emu()?;
        let index = device_index(emu, dev)?;
        let d = &emu.devices[index];
        let mut n = d.retains.load(Ordering::Acquire);
        loop {
            if n == 0 {
                return Err(INVALID_CONTEXT);
            }
            match d
                .retains
                .compare_exchange(n, n - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => n = now,
            }
        }
        if n == 1 {
            stream::destroy_context_objects(index);
            mem::free_context_allocations(index);
            d.used.fetch_sub(context_bytes(), Ordering::AcqRel);
        }
        Ok(())
    })
}

/// # Safety
///
/// As the driver's `cuCtxSetCurrent`: `ctx` null or a context handle.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    api(|| {
        let emu = emu()?;
        let value = ctx as usize;
        if value != 0 && !emu.devices.iter().any(|d| ctx_value(d) == value) {
            return Err(INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(value));
        Ok(())
    })
}

/// # Safety
///
/// As the driver's `cuCtxGetCurrent`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    api(|| {
        emu()?;
        out(ctx, CURRENT.with(Cell::get) as CUcontext)
    })
}

/// # Safety
///
/// As the driver's `cuCtxGetDevice`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    api(|| out(device, current_device()? as CUdevice))
}

/// # Safety
///
/// As the driver's `cuCtxSynchronize`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    api(|| {
        let d = current_device()?;
        stream::synchronize_context(d);
        Ok(())
    })
}

/// `(name, description)` of every code the emulator knows, as leaked C strings.
fn error_strings() -> &'static HashMap<u32, (CString, CString)> {
    static TABLE: OnceLock<HashMap<u32, (CString, CString)>> = OnceLock::new();
    TABLE.get_or_init(|| {
        use CUresult as R;
        [
            (R::CUDA_SUCCESS, "no error"),
            (R::CUDA_ERROR_INVALID_VALUE, "invalid argument"),
            (R::CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
            (R::CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
            (
                R::CUDA_ERROR_NO_DEVICE,
                "no CUDA-capable device is detected",
            ),
            (R::CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
            (R::CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
            (R::CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
            (R::CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
            (R::CUDA_ERROR_NOT_FOUND, "named symbol not found"),
            (R::CUDA_ERROR_NOT_READY, "device not ready"),
            (R::CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
            (
                R::CUDA_ERROR_ILLEGAL_ADDRESS,
                "an illegal memory access was encountered",
            ),
            (R::CUDA_ERROR_UNKNOWN, "unknown error"),
        ]
        .into_iter()
        .map(|(code, text)| {
            let name = CString::new(format!("{code:?}")).expect("no NUL in a variant name");
            let text = CString::new(text).expect("no NUL in a literal");
            (code as u32, (name, text))
        })
        .collect()
    })
}

fn error_string(code: c_uint, out_ptr: *mut *const c_char, name: bool) -> CUresult {
    let Some((n, s)) = error_strings().get(&code) else {
        return INVALID_VALUE;
    };
    match out(out_ptr, if name { n.as_ptr() } else { s.as_ptr() }) {
        Ok(()) => SUCCESS,
        Err(e) => e,
    }
}

/// Works before `cuInit`, as the driver's does.
///
/// # Safety
///
/// As the driver's `cuGetErrorName`.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: c_uint, name: *mut *const c_char) -> CUresult {
    error_string(error, name, true)
}

/// # Safety
///
/// As the driver's `cuGetErrorString`.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: c_uint, text: *mut *const c_char) -> CUresult {
    error_string(error, text, false)
}

/// A NUL-terminated C string argument (`CUDA_ERROR_INVALID_VALUE` when null).
///
/// # Safety
///
/// `p` is null or a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn c_str<'a>(p: *const c_char) -> Res<&'a CStr> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    Ok(unsafe { CStr::from_ptr(p) })
}
