//! `STRATA_PRELOAD_*`: read once, on first use.

use std::sync::OnceLock;

/// The shim's settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// `STRATA_PRELOAD_DISABLE=1`: every hook passes straight through to the real function.
    pub disable: bool,
    /// `STRATA_PRELOAD_LOG=1`: one stderr line per hooked call.
    pub log: bool,
    /// `STRATA_PRELOAD_LIMIT=SIZE`: cap on the bytes strata holds per device.
    pub limit: Option<u64>,
}

fn flag(name: &str) -> bool {
    matches!(
        std::env::var(name).ok().as_deref().map(str::trim),
        Some("1" | "true" | "yes" | "on")
    )
}

impl Config {
    /// Reads the environment. A malformed limit is reported once and ignored.
    pub fn from_env() -> Config {
        let limit = match std::env::var("STRATA_PRELOAD_LIMIT") {
            Ok(text) if !text.trim().is_empty() => match strata_vmm::host::parse_size(&text) {
                Ok(bytes) => Some(bytes),
                Err(reason) => {
                    eprintln!("strata-preload: ignoring STRATA_PRELOAD_LIMIT: {reason}");
                    None
                }
            },
            _ => None,
        };
        Config {
            disable: flag("STRATA_PRELOAD_DISABLE"),
            log: flag("STRATA_PRELOAD_LOG"),
            limit,
        }
    }
}

/// The process-wide settings.
pub fn get() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env)
}

/// Logs one line to stderr when `STRATA_PRELOAD_LOG=1`.
macro_rules! log {
    ($($arg:tt)*) => {
        if $crate::config::get().log {
            eprintln!("strata-preload: {}", format_args!($($arg)*));
        }
    };
}
pub(crate) use log;
