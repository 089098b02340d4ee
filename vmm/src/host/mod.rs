//! The host backend: the CUDA VMM semantics emulated with the operating system's own VMM.
//! (Being written; see DESIGN.md.)

mod config;

pub use config::{parse_devices, parse_size, HostConfig, Link, LinkModel};

use crate::error::{Error, Result};

/// Emulated devices on memfd-backed physical memory.
pub struct HostBackend {
    _config: HostConfig,
}

impl HostBackend {
    pub fn new(config: HostConfig) -> Result<Self> {
        crate::raii::install_exit_hook();
        let _ = config;
        Err(Error::Unsupported("host backend not built yet".into()))
    }
}

/// Opens a host backend as a trait object.
pub fn open(config: HostConfig) -> Result<std::sync::Arc<dyn crate::Backend>> {
    let _ = HostBackend::new(config)?;
    Err(Error::Unsupported("host backend not built yet".into()))
}
