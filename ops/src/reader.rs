//! Reading the folder: the live processes' figures, the dead ones' files pruned.

use crate::folder::{Folder, FolderError, Owned};
use crate::layout::{ProcessFigures, LAYOUT_VERSION};
use crate::proc;

/// What [`read_all`] found.
#[derive(Debug, Default)]
pub struct Listing {
    /// One entry per process and library, by pid then library.
    pub processes: Vec<ProcessFigures>,
    /// Files skipped (malformed, another version, another uid) and prunes that failed.
    pub warnings: Vec<String>,
}

/// The figures of every live process in `folder` (none when it does not exist). Files of
/// processes that exited (or whose pid now belongs to another process) are removed with their
/// limit requests; a file that vanishes while being read is no error.
pub fn read_all(folder: &Folder) -> Result<Listing, FolderError> {
    let mut listing = Listing::default();
    if !folder.check()? {
        return Ok(listing);
    }
    let mut names = folder.names()?;
    names.sort();
    for name in &names {
        if let Some(pid) = figures_pid(name) {
            read_one(folder, name, pid, &mut listing);
        } else if let Some(pid) = request_pid(name) {
            // A request its process never took (it exited first).
            if proc::start_ticks(pid).is_none() {
                prune(folder, name, &mut listing);
            }
        }
    }
    listing
        .processes
        .sort_by(|a, b| (a.pid, &a.library).cmp(&(b.pid, &b.library)));
    Ok(listing)
}

fn read_one(folder: &Folder, name: &str, pid: u32, listing: &mut Listing) {
    let skip = |why: String| format!("skipped {}: {why}", folder.path().join(name).display());
    let bytes = match folder.read(name) {
        Ok(Owned::Bytes(b)) => b,
        Ok(Owned::Missing) => return,
        Ok(Owned::Foreign(uid)) => {
            listing
                .warnings
                .push(skip(format!("it belongs to uid {uid}")));
            return;
        }
        Err(e) => {
            listing.warnings.push(skip(e.to_string()));
            return;
        }
    };
    let figures = match parse(&bytes) {
        Ok(f) => f,
        Err(why) => {
            listing.warnings.push(skip(why));
            return;
        }
    };
    if figures.pid != pid {
        listing
            .warnings
            .push(skip(format!("it holds pid {}", figures.pid)));
        return;
    }
    match proc::start_ticks(pid) {
        Some(t) if t == figures.start_ticks => listing.processes.push(figures),
        _ => prune(folder, name, listing),
    }
}

/// The figures in `bytes`, checking the version before the layout.
fn parse(bytes: &[u8]) -> Result<ProcessFigures, String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("malformed ({e})"))?;
    match value.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(LAYOUT_VERSION) => {}
        Some(v) => {
            return Err(format!(
                "layout version {v}, this strata reads {LAYOUT_VERSION}"
            ))
        }
        None => return Err("malformed (no version)".into()),
    }
    serde_json::from_value(value).map_err(|e| format!("malformed ({e})"))
}

fn prune(folder: &Folder, name: &str, listing: &mut Listing) {
    if let Err(e) = folder.remove(name) {
        listing.warnings.push(format!(
            "could not remove {} of an exited process: {e}",
            folder.path().join(name).display()
        ));
    }
}

/// The pid of `<pid>.<library>.json`.
fn figures_pid(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(".json")?;
    let (pid, library) = stem.split_once('.')?;
    (!library.is_empty() && !library.contains('.'))
        .then(|| pid.parse().ok())
        .flatten()
}

/// The pid of `<pid>.<library>.limit.<device>`.
fn request_pid(name: &str) -> Option<u32> {
    let (pid, rest) = name.split_once('.')?;
    rest.contains(".limit.").then(|| pid.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(figures_pid("12.strata.json"), Some(12));
        assert_eq!(figures_pid(".12.strata.json.12.tmp"), None);
        assert_eq!(figures_pid("12.json"), None);
        assert_eq!(figures_pid("x.strata.json"), None);
        assert_eq!(request_pid("12.preload.limit.0"), Some(12));
        assert_eq!(request_pid("12.preload.json"), None);
    }
}
