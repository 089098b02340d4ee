//! The shim's figures for `strata ps`, `top` and `metrics`, and `strata limit` applied here:
//! `strata-ops`' publishing thread over the shim's runtime (no tags, no KV spaces), started
//! when the shim opens its backend. Its calls run as strata's own code ([`Inside`]), so
//! anything they reach of the driver passes through the hooks.

use std::sync::Arc;

use strata_ops::{device_figures, DeviceFigures, Publisher, Source};
use strata_vmm::{Error, Result};

use crate::glue::{self, Inside};

struct Shim;

impl Source for Shim {
    fn library(&self) -> &'static str {
        "preload"
    }

    fn backend(&self) -> String {
        glue::runtime().map_or(String::new(), |rt| rt.backend().kind().to_string())
    }

    fn device_count(&self) -> u32 {
        glue::runtime().map_or(0, |rt| rt.device_count() as u32)
    }

    fn figures(&self) -> Vec<DeviceFigures> {
        let _inside = Inside::enter();
        let Some(rt) = glue::runtime() else {
            return Vec::new();
        };
        rt.devices()
            .iter()
            .filter_map(|d| device_figures(d, &|_| None, Vec::new()))
            .collect()
    }

    fn apply_limit(&self, device: u32, limit: Option<u64>) -> Result<()> {
        let _inside = Inside::enter();
        let a = glue::allocator(device).ok_or_else(|| {
            Error::InvalidState(format!("the shim serves no allocations on device {device}"))
        })?;
        strata_runtime::set_limit(a, limit)
    }

    fn total_bytes(&self, device: u32) -> Result<u64> {
        let _inside = Inside::enter();
        let rt = glue::runtime().ok_or(Error::NoDevice(i64::from(device)))?;
        Ok(rt.backend().device_info(device)?.total_memory)
    }
}

/// Starts publishing (once: the shim calls it when it opens its backend), and removes the file
/// at a normal exit.
pub fn start() {
    Publisher::start(Arc::new(Shim));
    // SAFETY: `unpublish_at_exit` is a plain `extern "C" fn()` that never unwinds (it catches
    // panics); atexit only stores it. A failed registration leaves the file to the next reader.
    unsafe { libc::atexit(unpublish_at_exit) };
}

extern "C" fn unpublish_at_exit() {
    let _inside = Inside::enter();
    let _ = std::panic::catch_unwind(|| strata_ops::unpublish("preload"));
}
