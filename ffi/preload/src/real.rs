//! The real-function resolver: the real `dlsym`, and the real pointer behind every hook.
//!
//! Inside a hook the shim only ever calls the pointers kept here, never the public name (which
//! would bind to the shim itself). Each pointer is resolved once through the real `dlsym`: on
//! the real libcuda's handle for driver names (`dlopen(RTLD_NOLOAD)`: the shim never loads the
//! driver itself), else `RTLD_NEXT` (the next object after the shim). A real pointer that a
//! caller's own `dlsym`/`cuGetProcAddress` revealed first is kept too ([`offer`]).

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::table::{Hook, Library};

/// `void* dlsym(void*, const char*)`
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(ptr::null_mut());

thread_local! {
    /// Set while this thread resolves the real `dlsym` (recursion guard).
    static RESOLVING: Cell<bool> = const { Cell::new(false) };
}

/// glibc's versions of `dlsym`: 2.34 moved it into libc.so.6 (new default version), the
/// others are the base versions of x86_64 and aarch64.
const DLSYM_VERSIONS: [&CStr; 3] = [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"];

/// The real `dlsym`, resolved once through `dlvsym(RTLD_NEXT, ...)`. `None` when it cannot be
/// found, or when called again while resolving it on this thread.
pub fn dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        if RESOLVING.with(|r| r.replace(true)) {
            return None;
        }
        for version in DLSYM_VERSIONS {
            // SAFETY: both strings are NUL-terminated literals; dlvsym does not call dlsym.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        RESOLVING.with(|r| r.set(false));
        if p.is_null() {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: `p` is glibc's dlsym, whose ABI is `DlsymFn`.
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// Looks `name` up through the real `dlsym` on `handle`.
///
/// # Safety
///
/// `handle` must be `RTLD_DEFAULT`, `RTLD_NEXT` or a live handle from `dlopen`.
pub unsafe fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    match dlsym() {
        // SAFETY: the caller vouches for the handle; the name is NUL-terminated.
        Some(real) => unsafe { real(handle, name.as_ptr()) },
        None => ptr::null_mut(),
    }
}

/// Driver functions the hooks call besides the hooked ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extra {
    /// `CUresult cuCtxGetDevice(CUdevice*)`
    CtxGetDevice,
    /// `CUresult cuCtxSynchronize(void)`
    CtxSynchronize,
    /// `CUresult cuStreamSynchronize(CUstream)`
    StreamSynchronize,
    /// `cudaError_t cudaGetDevice(int*)`
    CudaGetDevice,
}

impl Extra {
    const ALL: [Extra; 4] = [
        Extra::CtxGetDevice,
        Extra::CtxSynchronize,
        Extra::StreamSynchronize,
        Extra::CudaGetDevice,
    ];

    fn symbol(self) -> &'static CStr {
        match self {
            Extra::CtxGetDevice => c"cuCtxGetDevice",
            Extra::CtxSynchronize => c"cuCtxSynchronize",
            Extra::StreamSynchronize => c"cuStreamSynchronize",
            Extra::CudaGetDevice => c"cudaGetDevice",
        }
    }

    fn library(self) -> Library {
        match self {
            Extra::CudaGetDevice => Library::Runtime,
            _ => Library::Driver,
        }
    }
}

static HOOK_SLOTS: [AtomicPtr<c_void>; Hook::ALL.len()] =
    [const { AtomicPtr::new(ptr::null_mut()) }; Hook::ALL.len()];
static EXTRA_SLOTS: [AtomicPtr<c_void>; Extra::ALL.len()] =
    [const { AtomicPtr::new(ptr::null_mut()) }; Extra::ALL.len()];

/// The real driver library's handle, if this process has loaded one (never loads it).
fn libcuda() -> *mut c_void {
    static HANDLE: AtomicPtr<c_void> = AtomicPtr::new(ptr::null_mut());
    let h = HANDLE.load(Ordering::Acquire);
    if !h.is_null() {
        return h;
    }
    for name in [c"libcuda.so.1", c"libcuda.so"] {
        // SAFETY: NUL-terminated name; RTLD_NOLOAD only returns an already-loaded object
        // (taking a reference that is kept for the life of the process).
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            HANDLE.store(h, Ordering::Release);
            return h;
        }
    }
    ptr::null_mut()
}

/// Resolves `name` of `library`, never returning one of the shim's own wrappers.
fn resolve(name: &CStr, library: Library) -> *mut c_void {
    if library == Library::Driver {
        let h = libcuda();
        if !h.is_null() {
            // SAFETY: `h` is a live dlopen handle (kept open for the life of the process).
            let p = unsafe { lookup(h, name) };
            if !p.is_null() && !crate::is_wrapper(p) {
                return p;
            }
        }
    }
    // SAFETY: RTLD_NEXT is a valid pseudo-handle.
    let p = unsafe { lookup(libc::RTLD_NEXT, name) };
    if p.is_null() || crate::is_wrapper(p) {
        ptr::null_mut()
    } else {
        p
    }
}

fn cached(slot: &AtomicPtr<c_void>, name: &CStr, library: Library) -> Option<*mut c_void> {
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        return Some(p);
    }
    let p = resolve(name, library);
    if p.is_null() {
        // Not cached: the library may be loaded later.
        return None;
    }
    slot.store(p, Ordering::Release);
    Some(p)
}

/// The real function behind `hook`.
pub fn hook(hook: Hook) -> Option<*mut c_void> {
    cached(&HOOK_SLOTS[hook.index()], hook.symbol(), hook.library())
}

/// The real function `extra`.
pub fn extra(extra: Extra) -> Option<*mut c_void> {
    let i = Extra::ALL
        .iter()
        .position(|&e| e == extra)
        .unwrap_or_default();
    cached(&EXTRA_SLOTS[i], extra.symbol(), extra.library())
}

/// Remembers `p`, which a caller's `dlsym`/`cuGetProcAddress` returned for `hook`'s ABI, as the
/// real function when none is known yet. The shim's own wrappers are never taken.
pub fn offer(hook: Hook, p: *mut c_void) {
    if p.is_null() || crate::is_wrapper(p) {
        return;
    }
    let _ = HOOK_SLOTS[hook.index()].compare_exchange(
        ptr::null_mut(),
        p,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
}

/// Calls the real `cuCtxGetDevice`: `Some(Ok(device))`, `Some(Err(code))` when the driver
/// refuses (no current context), `None` when the symbol is unknown.
pub fn ctx_device() -> Option<Result<c_int, c_int>> {
    let p = extra(Extra::CtxGetDevice)?;
    // SAFETY: `p` is the driver's cuCtxGetDevice, `CUresult (CUdevice*)`.
    let f =
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> c_int>(p) };
    let mut dev: c_int = 0;
    // SAFETY: `dev` is a valid out-pointer for the duration of the call.
    let rc = unsafe { f(&mut dev) };
    Some(if rc == 0 { Ok(dev) } else { Err(rc) })
}

/// Calls the real `cudaGetDevice`; `None` when unknown or failing.
pub fn runtime_device() -> Option<c_int> {
    let p = extra(Extra::CudaGetDevice)?;
    // SAFETY: `p` is the runtime's cudaGetDevice, `cudaError_t (int*)`.
    let f =
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> c_int>(p) };
    let mut dev: c_int = 0;
    // SAFETY: `dev` is a valid out-pointer for the duration of the call.
    (unsafe { f(&mut dev) } == 0).then_some(dev)
}

/// Waits for the work that may still use memory being freed: `cuStreamSynchronize(stream)`
/// for a stream-ordered free on a non-null stream, else `cuCtxSynchronize()`. Returns the
/// driver's code (0 when the driver offers neither call).
pub fn synchronize(stream: Option<*mut c_void>) -> c_int {
    match stream {
        Some(s) if !s.is_null() => {
            let Some(p) = extra(Extra::StreamSynchronize) else {
                return 0;
            };
            // SAFETY: `p` is the driver's cuStreamSynchronize, `CUresult (CUstream)`; the
            // stream is the caller's own, passed on untouched.
            unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void) -> c_int>(p)(s)
            }
        }
        _ => {
            let Some(p) = extra(Extra::CtxSynchronize) else {
                return 0;
            };
            // SAFETY: `p` is the driver's cuCtxSynchronize, `CUresult (void)`.
            unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(p)() }
        }
    }
}
