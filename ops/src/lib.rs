//! What operators see and steer (`strata ps`, `top`, `limit`, `metrics`).
//!
//! Every process that loads `libstrata.so` or `libstrata_preload.so` runs one [`Publisher`]
//! thread per library: every [`INTERVAL`] it writes the library's figures ([`ProcessFigures`]:
//! per device the allocator, tags, KV spaces, tiers and lending) to `<pid>.<library>.json` in
//! the user's [`Folder`], and applies the limit requests an operator left there. Nothing of this
//! touches the allocation path: the thread reads the same snapshots `strata_stats` does.
//!
//! The folder is `/dev/shm/strata-<uid>/` (`STRATA_SHM_DIR` names another; empty turns
//! publishing off). It must belong to the caller and be writable by nobody else (mode 0700
//! when created); files are 0600, written whole to a temporary name and renamed, so a reader
//! never sees half a file. A file of another uid is neither read nor written nor removed.
//! [`read_all`] lists the live processes, removes the files of dead ones, and skips malformed
//! or foreign-version files with a warning.
#![deny(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod figures;
mod folder;
mod layout;
mod limit;
mod proc;
mod publisher;
mod reader;

pub use figures::device_figures;
pub use folder::{Folder, FolderError, Owned};
pub use layout::{
    DeviceFigures, KvFigures, LimitRequest, LimitValue, ProcessFigures, TagFigures, TagState,
    TierBytes, LAYOUT_VERSION,
};
pub use limit::{parse_limit, request_limit, LimitError};
pub use publisher::{unpublish, Publisher, Source, INTERVAL};
pub use reader::{read_all, Listing};
