//! The thread that publishes a library's figures and applies limit requests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::folder::{Folder, Owned};
use crate::layout::{DeviceFigures, LimitRequest, ProcessFigures, LAYOUT_VERSION};
use crate::proc;

/// Set at exit ([`unpublish`]): the publisher writes no more.
static STOPPED: AtomicBool = AtomicBool::new(false);

/// How often figures are written and requests read: a limit applies within two of these.
pub const INTERVAL: Duration = Duration::from_millis(250);

/// What a library publishes and how it applies a cap (its own runtime, tags and KV spaces).
pub trait Source: Send + Sync + 'static {
    /// `"strata"` or `"preload"`.
    fn library(&self) -> &'static str;
    /// `host` or `cuda`.
    fn backend(&self) -> String;
    /// Number of devices (limit requests are read for these).
    fn device_count(&self) -> u32;
    /// The figures of every device something was created on.
    fn figures(&self) -> Vec<DeviceFigures>;
    /// Caps `device`'s own memory at `limit` (`None`: no cap) with
    /// `strata_set_memory_fraction`'s semantics.
    fn apply_limit(&self, device: u32, limit: Option<u64>) -> strata_vmm::Result<()>;
    /// The device's memory in bytes (to resolve fractions).
    fn total_bytes(&self, device: u32) -> strata_vmm::Result<u64>;
}

/// The publishing thread of one library in this process.
pub struct Publisher {
    folder: Folder,
    source: Arc<dyn Source>,
    pid: u32,
    start_ticks: u64,
    command: String,
    limit_error: Option<String>,
}

impl Publisher {
    /// Starts the thread for `source` (once per library and process: the caller keeps that
    /// promise). When the folder is off or refused, says so once on stderr and publishes
    /// nothing; a failing write later is retried on the next tick.
    pub fn start(source: Arc<dyn Source>) {
        let folder = match Folder::from_env().and_then(|f| f.create().map(|()| f)) {
            Ok(f) => f,
            Err(crate::FolderError::Off) => return,
            Err(e) => {
                eprintln!("strata: not publishing figures for `strata ps`: {e}");
                return;
            }
        };
        let pid = std::process::id();
        let mut publisher = Publisher {
            folder,
            source,
            pid,
            start_ticks: proc::start_ticks(pid).unwrap_or(0),
            command: proc::command(pid),
            limit_error: None,
        };
        let spawned = std::thread::Builder::new()
            .name("strata-publish".into())
            .spawn(move || loop {
                publisher.tick();
                std::thread::sleep(INTERVAL);
            });
        if let Err(e) = spawned {
            eprintln!("strata: not publishing figures for `strata ps`: {e}");
        }
    }

    /// Applies the requests waiting, then writes the figures.
    fn tick(&mut self) {
        self.apply_requests();
        let figures = ProcessFigures {
            version: LAYOUT_VERSION,
            pid: self.pid,
            library: self.source.library().to_string(),
            start_ticks: self.start_ticks,
            command: self.command.clone(),
            backend: self.source.backend(),
            updated_unix_ms: now_ms(),
            devices: self.source.figures(),
            limit_error: self.limit_error.clone(),
        };
        if let Ok(bytes) = serde_json::to_vec(&figures) {
            let name = Folder::figures_name(self.pid, self.source.library());
            if STOPPED.load(Ordering::Acquire) {
                return;
            }
            // A failed write (folder removed, tmpfs full) is retried on the next tick.
            let _ = self.folder.write(&name, &bytes);
            // The process began to exit meanwhile: take back what this tick wrote.
            if STOPPED.load(Ordering::Acquire) {
                let _ = self.folder.remove(&name);
            }
        }
    }

    /// Reads, removes and applies each device's request.
    fn apply_requests(&mut self) {
        for device in 0..self.source.device_count() {
            let name = Folder::limit_name(self.pid, self.source.library(), device);
            let bytes = match self.folder.read(&name) {
                Ok(Owned::Bytes(b)) => b,
                Ok(Owned::Missing) => continue,
                Ok(Owned::Foreign(uid)) => {
                    self.limit_error = Some(format!("{name} belongs to uid {uid}: ignored"));
                    continue;
                }
                Err(e) => {
                    self.limit_error = Some(format!("{name}: {e}"));
                    continue;
                }
            };
            let _ = self.folder.remove(&name);
            self.limit_error = self.apply(device, &bytes).err();
        }
    }

    fn apply(&self, device: u32, bytes: &[u8]) -> Result<(), String> {
        let request: LimitRequest = serde_json::from_slice(bytes)
            .map_err(|e| format!("unreadable limit request for device {device}: {e}"))?;
        if request.version != LAYOUT_VERSION || request.device != device {
            return Err(format!(
                "limit request of version {} for device {} in device {device}'s file",
                request.version, request.device
            ));
        }
        let total = self.source.total_bytes(device).map_err(|e| e.to_string())?;
        self.source
            .apply_limit(device, request.limit.resolve(total))
            .map_err(|e| format!("device {device}: {e}"))
    }
}

/// Stops publishing and removes this process's file of `library` (at exit, so a reader need
/// not prune it; a tick writing meanwhile removes what it wrote).
pub fn unpublish(library: &str) {
    STOPPED.store(true, Ordering::Release);
    if let Ok(folder) = Folder::from_env() {
        let _ = folder.remove(&Folder::figures_name(std::process::id(), library));
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
