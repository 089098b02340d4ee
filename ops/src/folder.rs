//! The per-user folder and its files: who may own them, how they are written and read.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The environment variable naming another folder (tests; several users of one machine);
/// empty turns publishing off.
pub const ENV: &str = "STRATA_SHM_DIR";

/// Why the folder cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error("{ENV} is empty: publishing is off")]
    Off,
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path} is not a directory (a symbolic link is refused too)")]
    NotADirectory { path: PathBuf },
    #[error("{path} belongs to uid {owner}, not to this user (uid {uid}); refusing to use it")]
    NotOwned { path: PathBuf, owner: u32, uid: u32 },
    #[error("{path} is writable by others (mode {mode:o}); refusing to use it (chmod 700)")]
    Writable { path: PathBuf, mode: u32 },
}

/// What reading one file found.
#[derive(Debug)]
pub enum Owned {
    /// The file's bytes (it belongs to this user).
    Bytes(Vec<u8>),
    /// Gone (its process exited or consumed it meanwhile).
    Missing,
    /// Another uid's file: not read.
    Foreign(u32),
}

/// The folder of this user's processes.
#[derive(Clone, Debug)]
pub struct Folder {
    path: PathBuf,
    uid: u32,
}

impl Folder {
    /// `STRATA_SHM_DIR`, else `/dev/shm/strata-<uid>`; [`FolderError::Off`] when the variable
    /// is set and empty.
    pub fn from_env() -> Result<Folder, FolderError> {
        let uid = rustix::process::getuid().as_raw();
        let path = match std::env::var_os(ENV) {
            Some(p) if p.is_empty() => return Err(FolderError::Off),
            Some(p) => PathBuf::from(p),
            None => PathBuf::from(format!("/dev/shm/strata-{uid}")),
        };
        Ok(Folder { path, uid })
    }

    /// The folder at `path`, for this user.
    pub fn at(path: impl Into<PathBuf>) -> Folder {
        Folder {
            path: path.into(),
            uid: rustix::process::getuid().as_raw(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the folder (mode 0700) if it does not exist, then [`Folder::check`]s it.
    pub fn create(&self) -> Result<(), FolderError> {
        match DirBuilder::new().mode(0o700).create(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(self.io(source)),
        }
        self.check().map(|_| ())
    }

    /// Whether the folder exists, refusing one that is not a directory, belongs to another
    /// uid, or is writable by group or others.
    pub fn check(&self) -> Result<bool, FolderError> {
        let meta = match fs::symlink_metadata(&self.path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(source) => return Err(self.io(source)),
        };
        let path = self.path.clone();
        if !meta.is_dir() {
            return Err(FolderError::NotADirectory { path });
        }
        if meta.uid() != self.uid {
            return Err(FolderError::NotOwned {
                path,
                owner: meta.uid(),
                uid: self.uid,
            });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o022 != 0 {
            return Err(FolderError::Writable { path, mode });
        }
        Ok(true)
    }

    fn io(&self, source: io::Error) -> FolderError {
        FolderError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// `<pid>.<library>.json`.
    pub fn figures_name(pid: u32, library: &str) -> String {
        format!("{pid}.{library}.json")
    }

    /// `<pid>.<library>.limit.<device>`.
    pub fn limit_name(pid: u32, library: &str, device: u32) -> String {
        format!("{pid}.{library}.limit.{device}")
    }

    /// Writes `bytes` to `name` whole: to a temporary file of mode 0600 first, renamed over
    /// `name` (a reader sees the old file or the new one, never a part).
    pub fn write(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let tmp = self
            .path
            .join(format!(".{name}.{}.tmp", std::process::id()));
        // A leftover of a process with the same pid, or of a failed write.
        let _ = fs::remove_file(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&tmp)?;
        let written = f.write_all(bytes).and_then(|()| {
            drop(f);
            fs::rename(&tmp, self.path.join(name))
        });
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }

    /// The bytes of `name` if it is a regular file of this user (never following a symbolic
    /// link; another uid's file is not read).
    pub fn read(&self, name: &str) -> io::Result<Owned> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(
                (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32,
            )
            .open(self.path.join(name));
        let mut file: File = match file {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Owned::Missing),
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        if meta.uid() != self.uid {
            return Ok(Owned::Foreign(meta.uid()));
        }
        if !meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a regular file",
            ));
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        file.read_to_end(&mut bytes)?;
        Ok(Owned::Bytes(bytes))
    }

    /// Removes `name` if it is this user's (a file already gone is no error).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        let path = self.path.join(name);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.uid() == self.uid => match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The names in the folder.
    pub fn names(&self) -> Result<Vec<String>, FolderError> {
        let entries = fs::read_dir(&self.path).map_err(|e| self.io(e))?;
        Ok(entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect())
    }
}
