//! `libstrata.so`'s figures for `strata ps`, `top` and `metrics`, and `strata limit` applied
//! here: [`start`] runs `strata-ops`' publishing thread over this library's runtime, tags and
//! KV spaces. It starts with the runtime (`global.rs`), so the allocation path never checks it.

use std::sync::Arc;

use strata_allocator::TagId;
use strata_ops::{device_figures, DeviceFigures, Publisher, Source};
use strata_vmm::Result;

use crate::global::{allocator, global};

struct CApi;

impl Source for CApi {
    fn library(&self) -> &'static str {
        "strata"
    }

    fn backend(&self) -> String {
        strata_runtime::existing_global().map_or(String::new(), |g| g.backend().kind().to_string())
    }

    fn device_count(&self) -> u32 {
        strata_runtime::existing_global().map_or(0, |g| g.device_count() as u32)
    }

    fn figures(&self) -> Vec<DeviceFigures> {
        let Some(g) = strata_runtime::existing_global() else {
            return Vec::new();
        };
        g.devices()
            .iter()
            .filter_map(|d| device_figures(d, &tag_name, crate::kv::figures_on(d.device())))
            .collect()
    }

    fn apply_limit(&self, device: u32, limit: Option<u64>) -> Result<()> {
        let g = global()?;
        strata_runtime::set_limit(allocator(g, device as i32)?, limit)
    }

    fn total_bytes(&self, device: u32) -> Result<u64> {
        Ok(global()?.backend().device_info(device)?.total_memory)
    }
}

/// A tag's name: the one place the figures read the tag registry (states come from the
/// allocators' own tag figures).
fn tag_name(id: TagId) -> Option<String> {
    crate::tags::name_of(id)
}

/// Starts publishing (once: the runtime calls it when it is created), and removes the file at
/// a normal exit.
pub fn start() {
    Publisher::start(Arc::new(CApi));
    // SAFETY: `unpublish_at_exit` is a plain `extern "C" fn()` that never unwinds (it catches
    // panics); atexit only stores it. A failed registration leaves the file to the next reader.
    unsafe { libc::atexit(unpublish_at_exit) };
}

extern "C" fn unpublish_at_exit() {
    let _ = std::panic::catch_unwind(|| strata_ops::unpublish("strata"));
}
