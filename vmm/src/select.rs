//! Backend selection: `STRATA_BACKEND=cuda|host|auto` (default `auto`).

use std::sync::{Arc, OnceLock};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::host::HostConfig;

/// Which backend the environment asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Cuda,
    Host,
    /// CUDA when a driver and a device are present, else the host emulation.
    Auto,
}

impl Choice {
    /// Reads `STRATA_BACKEND`.
    pub fn from_env() -> Result<Self> {
        match std::env::var("STRATA_BACKEND")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            None | Some("") | Some("auto") => Ok(Choice::Auto),
            Some("cuda") => Ok(Choice::Cuda),
            Some("host") => Ok(Choice::Host),
            Some(other) => Err(Error::Config {
                name: "STRATA_BACKEND",
                value: other.to_string(),
                reason: "expected cuda, host or auto".into(),
            }),
        }
    }
}

/// Builds the backend `choice` names (host devices from `STRATA_HOST_*`).
pub fn open(choice: Choice) -> Result<Arc<dyn Backend>> {
    open_with(choice, HostConfig::from_env)
}

/// Builds the backend `choice` names; a host backend (chosen, or `Auto` without a CUDA device)
/// takes its configuration from `host`.
pub fn open_with(
    choice: Choice,
    host: impl FnOnce() -> Result<HostConfig>,
) -> Result<Arc<dyn Backend>> {
    open_explained_with(choice, host).map(|(backend, _)| backend)
}

/// As [`open`], and for `Auto` falling back to the host emulation, why CUDA was not taken
/// (the typed error's message: no driver library, no device, ...). `None` otherwise.
pub fn open_explained(choice: Choice) -> Result<(Arc<dyn Backend>, Option<String>)> {
    open_explained_with(choice, HostConfig::from_env)
}

fn open_explained_with(
    choice: Choice,
    host: impl FnOnce() -> Result<HostConfig>,
) -> Result<(Arc<dyn Backend>, Option<String>)> {
    match choice {
        Choice::Cuda => crate::cuda::open().map(|b| (b, None)),
        Choice::Host => crate::host::open(host()?).map(|b| (b, None)),
        Choice::Auto => match crate::cuda::open() {
            Ok(cuda) => Ok((cuda, None)),
            Err(e @ (Error::NoDriver(_) | Error::NoDevice(_))) => {
                crate::host::open(host()?).map(|b| (b, Some(e.to_string())))
            }
            Err(other) => Err(other),
        },
    }
}

/// Builds the backend the environment selects.
pub fn from_env() -> Result<Arc<dyn Backend>> {
    open(Choice::from_env()?)
}

/// The host backend `config` describes or, with `STRATA_BACKEND=cuda`, the CUDA backend (its
/// devices, sizes and granularity come from the driver, not from `config`). For the test suites,
/// which run on both (CI: over the emulated driver).
pub fn host_or_cuda(config: HostConfig) -> Result<Arc<dyn Backend>> {
    match Choice::from_env()? {
        Choice::Cuda => crate::cuda::open(),
        _ => crate::host::open(config),
    }
}

/// [`open_explained`] for the backend the environment selects.
pub fn from_env_explained() -> Result<(Arc<dyn Backend>, Option<String>)> {
    open_explained(Choice::from_env()?)
}

/// The process-wide backend, opened from the environment on first use. A failure is returned
/// again, as the same typed error, on every call (the environment is read once): a malformed
/// `STRATA_*` variable stays [`Error::Config`], CUDA asked for without a driver
/// [`Error::NoDriver`].
pub fn global() -> Result<Arc<dyn Backend>> {
    static GLOBAL: OnceLock<Result<Arc<dyn Backend>>> = OnceLock::new();
    match GLOBAL.get_or_init(from_env) {
        Ok(backend) => Ok(Arc::clone(backend)),
        Err(e) => Err(e.clone()),
    }
}
