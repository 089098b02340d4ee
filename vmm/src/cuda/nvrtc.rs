//! NVRTC, the run-time CUDA C compiler (cudarc's `nvrtc::sys`, loaded dynamically).
//!
//! Its absence is no reason to refuse the backend: every failure here (no `libnvrtc`, a missing
//! symbol, a compile error) is [`Error::Unsupported`], so callers of the block-copy kernel fall
//! back to DMA. cudarc's loader panics on a missing library or symbol; symbols are probed up front
//! and every call is wrapped as in [`call`](super::result::call).

use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::nvrtc::sys as nv;

use crate::error::{Error, Result};

/// Every NVRTC symbol this module calls.
pub const SYMBOLS: &[&CStr] = &[
    c"nvrtcCreateProgram",
    c"nvrtcCompileProgram",
    c"nvrtcDestroyProgram",
    c"nvrtcGetProgramLogSize",
    c"nvrtcGetProgramLog",
    c"nvrtcGetPTXSize",
    c"nvrtcGetPTX",
    c"nvrtcGetCUBINSize",
    c"nvrtcGetCUBIN",
    c"nvrtcGetNumSupportedArchs",
    c"nvrtcGetSupportedArchs",
];

/// What a compilation produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Image {
    /// Machine code for exactly one architecture (`--gpu-architecture=sm_XY`).
    Cubin,
    /// PTX for a virtual architecture (`compute_XY`), JIT-compiled by the driver at load.
    Ptx,
}

fn unsupported(what: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("NVRTC: {what}"))
}

/// One NVRTC call: a loader panic or a failure code becomes [`Error::Unsupported`].
fn call_nv(name: &'static str, f: impl FnOnce() -> nv::nvrtcResult) -> Result<()> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(nv::nvrtcResult::NVRTC_SUCCESS) => Ok(()),
        Ok(code) => Err(unsupported(format_args!("{name} failed: {code:?}"))),
        Err(_) => Err(unsupported(format_args!(
            "{name}: libnvrtc or this symbol could not be loaded"
        ))),
    }
}

/// Checks that `libnvrtc` loads and exports every symbol in [`SYMBOLS`]
/// ([`Error::Unsupported`] naming what is missing otherwise).
pub fn check_present() -> Result<()> {
    let present = catch_unwind(|| {
        // SAFETY: loading libnvrtc runs only its initializers; nothing else is called.
        unsafe { nv::is_culib_present() }
    })
    .unwrap_or(false);
    if !present {
        return Err(unsupported("libnvrtc could not be loaded"));
    }
    let missing: Vec<String> = SYMBOLS
        .iter()
        .filter(|name| {
            !catch_unwind(|| {
                // SAFETY: `culib` returns the library just found; looking a symbol up calls
                // nothing, so the pointer type is irrelevant.
                unsafe {
                    nv::culib()
                        .get::<unsafe extern "C" fn()>(name.to_bytes_with_nul())
                        .is_ok()
                }
            })
            .unwrap_or(false)
        })
        .map(|name| name.to_string_lossy().into_owned())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(unsupported(format_args!(
            "libnvrtc lacks {}",
            missing.join(", ")
        )))
    }
}

/// The real architectures this NVRTC compiles for (`[75, 80, 86, 89, 90, ...]`).
pub fn supported_archs() -> Result<Vec<u32>> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the call.
    call_nv("nvrtcGetNumSupportedArchs", || unsafe {
        nv::nvrtcGetNumSupportedArchs(&mut n)
    })?;
    let mut archs = vec![0 as c_int; usize::try_from(n).unwrap_or(0)];
    if archs.is_empty() {
        return Ok(Vec::new());
    }
    // SAFETY: `archs` holds exactly the number of entries NVRTC reported.
    call_nv("nvrtcGetSupportedArchs", || unsafe {
        nv::nvrtcGetSupportedArchs(archs.as_mut_ptr())
    })?;
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

/// A program, destroyed on drop.
struct Program(nv::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `nvrtcCreateProgram` and is destroyed once
        // (NVRTC takes a pointer to the handle and nulls it).
        let _ = call_nv("nvrtcDestroyProgram", || unsafe {
            nv::nvrtcDestroyProgram(&mut self.0)
        });
    }
}

impl Program {
    /// Reads a sized NVRTC output (log, PTX, cubin) into a vector.
    fn output(
        &self,
        what: (&'static str, &'static str),
        size: unsafe fn(nv::nvrtcProgram, *mut usize) -> nv::nvrtcResult,
        read: unsafe fn(nv::nvrtcProgram, *mut c_char) -> nv::nvrtcResult,
    ) -> Result<Vec<u8>> {
        let mut n: usize = 0;
        // SAFETY: the program is live (owned by `self`) and `n` a valid out-pointer.
        call_nv(what.0, || unsafe { size(self.0, &mut n) })?;
        let mut out = vec![0u8; n];
        if n > 0 {
            // SAFETY: `out` holds exactly the `n` bytes NVRTC reported for this output.
            call_nv(what.1, || unsafe {
                read(self.0, out.as_mut_ptr().cast::<c_char>())
            })?;
        }
        Ok(out)
    }
}

/// Compiles `source` (program name `name`) for architecture `arch` (`90` for sm_90) into
/// `image`. PTX comes back NUL-terminated, ready for [`module::load_data`](super::result::module::load_data). Call
/// [`check_present`] first. A compile error carries NVRTC's log.
pub fn compile(source: &str, name: &CStr, arch: u32, image: Image) -> Result<Vec<u8>> {
    compile_logged(source, name, arch, image).map(|(image, _)| image)
}

/// [`compile`], also returning NVRTC's log of a successful compile (its warnings; empty
/// when there are none).
pub fn compile_logged(
    source: &str,
    name: &CStr,
    arch: u32,
    image: Image,
) -> Result<(Vec<u8>, String)> {
    let source = CString::new(source).map_err(|_| unsupported("source contains NUL"))?;
    let option = match image {
        Image::Cubin => format!("--gpu-architecture=sm_{arch}"),
        Image::Ptx => format!("--gpu-architecture=compute_{arch}"),
    };
    let option = CString::new(option).map_err(|_| unsupported("option contains NUL"))?;
    let mut raw: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer; `source` and `name` are NUL-terminated and
    // outlive the program (dropped below, before them); no headers.
    call_nv("nvrtcCreateProgram", || unsafe {
        nv::nvrtcCreateProgram(
            &mut raw,
            source.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    })?;
    let program = Program(raw);
    let options = [option.as_ptr()];
    // SAFETY: the program is live; `options` holds one NUL-terminated option that outlives
    // the call.
    let compiled = call_nv("nvrtcCompileProgram", || unsafe {
        nv::nvrtcCompileProgram(program.0, 1, options.as_ptr())
    });
    let log = program
        .output(
            ("nvrtcGetProgramLogSize", "nvrtcGetProgramLog"),
            nv::nvrtcGetProgramLogSize,
            nv::nvrtcGetProgramLog,
        )
        .map(|l| {
            String::from_utf8_lossy(&l)
                .trim_end_matches('\0')
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(unsupported(format_args!("{e}; log: {log}")));
    }
    let mut out = match image {
        Image::Cubin => program.output(
            ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
            nv::nvrtcGetCUBINSize,
            nv::nvrtcGetCUBIN,
        )?,
        Image::Ptx => program.output(
            ("nvrtcGetPTXSize", "nvrtcGetPTX"),
            nv::nvrtcGetPTXSize,
            nv::nvrtcGetPTX,
        )?,
    };
    if out.is_empty() {
        return Err(unsupported(format_args!("{image:?} output is empty")));
    }
    if image == Image::Ptx && out.last() != Some(&0) {
        out.push(0);
    }
    Ok((out, log))
}
