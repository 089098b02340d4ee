//! The CUDA backend on cudarc's `driver::sys`. (Being written.)

use crate::error::{Error, Result};

/// The CUDA driver, primary contexts of every device.
pub struct CudaBackend {
    _private: (),
}

impl CudaBackend {
    pub fn new() -> Result<Self> {
        crate::raii::install_exit_hook();
        Err(Error::NoDriver("CUDA backend not built yet".into()))
    }
}

/// Opens the CUDA backend as a trait object.
pub fn open() -> Result<std::sync::Arc<dyn crate::Backend>> {
    let _ = CudaBackend::new()?;
    Err(Error::NoDriver("CUDA backend not built yet".into()))
}
