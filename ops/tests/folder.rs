//! The folder's rules: who may own it, what a reader skips, what it prunes, and limit requests
//! taken by a publisher (over a `Source` that records what it was asked).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_ops::{
    read_all, request_limit, DeviceFigures, Folder, FolderError, LimitError, LimitValue, Owned,
    ProcessFigures, Publisher, Source, LAYOUT_VERSION,
};

/// A fresh folder path under the temporary directory (not created).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-ops-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn figures(pid: u32, start_ticks: u64) -> ProcessFigures {
    ProcessFigures {
        version: LAYOUT_VERSION,
        pid,
        library: "strata".into(),
        start_ticks,
        command: "test".into(),
        backend: "host".into(),
        updated_unix_ms: 1,
        devices: vec![DeviceFigures::default()],
        limit_error: None,
    }
}

fn my_start() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

#[test]
fn created_private_and_refused_when_others_may_write() {
    let dir = scratch("mode");
    let folder = Folder::at(&dir);
    assert!(!folder.check().unwrap(), "absent is not an error");
    folder.create().unwrap();
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    folder.write("x.strata.json", b"{}").unwrap();
    let file = std::fs::metadata(dir.join("x.strata.json")).unwrap();
    assert_eq!(file.mode() & 0o777, 0o600);
    for loose in [0o770, 0o757, 0o777] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(loose)).unwrap();
        assert!(
            matches!(folder.check(), Err(FolderError::Writable { .. })),
            "{loose:o}"
        );
        assert!(read_all(&folder).is_err());
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(folder.check().unwrap(), "readable by others is allowed");
    std::fs::remove_dir_all(&dir).unwrap();
    // A symbolic link is not a folder of ours.
    let target = scratch("target");
    std::fs::create_dir(&target).unwrap();
    std::os::unix::fs::symlink(&target, &dir).unwrap();
    assert!(matches!(
        folder.check(),
        Err(FolderError::NotADirectory { .. })
    ));
    std::fs::remove_file(&dir).unwrap();
    std::fs::remove_dir(&target).unwrap();
}

#[test]
fn reader_lists_live_skips_odd_files_and_prunes_the_dead() {
    let dir = scratch("reader");
    let folder = Folder::at(&dir);
    folder.create().unwrap();
    let me = std::process::id();
    let live = figures(me, my_start());
    folder
        .write(
            &Folder::figures_name(me, "strata"),
            &serde_json::to_vec(&live).unwrap(),
        )
        .unwrap();
    // An exited child's file, and its untaken request.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let dead_file = Folder::figures_name(dead, "strata");
    folder
        .write(&dead_file, &serde_json::to_vec(&figures(dead, 1)).unwrap())
        .unwrap();
    folder
        .write(&Folder::limit_name(dead, "strata", 0), b"{}")
        .unwrap();
    // This pid under another start time: a reused pid, also pruned.
    let reused = Folder::figures_name(me, "preload");
    folder
        .write(
            &reused,
            &serde_json::to_vec(&figures(me, my_start() + 1)).unwrap(),
        )
        .unwrap();
    // Malformed, foreign-version and wrong-pid files of a live pid: skipped with a warning.
    folder
        .write(&format!("{me}.broken.json"), b"{nope")
        .unwrap();
    folder
        .write(&format!("{me}.future.json"), br#"{"version": 2}"#)
        .unwrap();
    let other = figures(1, 0);
    folder
        .write(
            &format!("{me}.other.json"),
            &serde_json::to_vec(&other).unwrap(),
        )
        .unwrap();

    let listing = read_all(&folder).unwrap();
    assert_eq!(listing.processes, vec![live]);
    let warnings = listing.warnings.join("\n");
    assert!(warnings.contains("malformed"), "{warnings}");
    assert!(warnings.contains("layout version 2"), "{warnings}");
    assert!(warnings.contains("holds pid 1"), "{warnings}");
    assert_eq!(listing.warnings.len(), 3, "{warnings}");
    let names = folder.names().unwrap();
    assert!(!names.contains(&dead_file), "{names:?}");
    assert!(!names.contains(&reused), "{names:?}");
    assert!(!names.contains(&Folder::limit_name(dead, "strata", 0)));
    assert!(
        names.contains(&format!("{me}.broken.json")),
        "skipped, not removed"
    );
    // A file gone between listing and reading (its process exited) is no error.
    assert!(matches!(
        folder.read("123.strata.json").unwrap(),
        Owned::Missing
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A source with one device of 1000 bytes that records the caps it was asked for.
struct Recorder {
    caps: Mutex<Vec<(u32, Option<u64>)>>,
}

impl Source for Recorder {
    fn library(&self) -> &'static str {
        "recorder"
    }
    fn backend(&self) -> String {
        "host".into()
    }
    fn device_count(&self) -> u32 {
        1
    }
    fn figures(&self) -> Vec<DeviceFigures> {
        let limit = self.caps.lock().unwrap().last().and_then(|c| c.1);
        vec![DeviceFigures {
            total_bytes: 1000,
            limit_bytes: limit,
            ..DeviceFigures::default()
        }]
    }
    fn apply_limit(&self, device: u32, limit: Option<u64>) -> strata_vmm::Result<()> {
        if limit == Some(13) {
            return Err(strata_vmm::Error::InvalidArgument("unlucky".into()));
        }
        self.caps.lock().unwrap().push((device, limit));
        Ok(())
    }
    fn total_bytes(&self, _device: u32) -> strata_vmm::Result<u64> {
        Ok(1000)
    }
}

#[test]
fn limit_requests_are_taken_applied_and_reported() {
    let dir = scratch("limit");
    // The publisher reads STRATA_SHM_DIR when it starts (this test binary's only user of it).
    std::env::set_var("STRATA_SHM_DIR", &dir);
    let recorder = Arc::new(Recorder {
        caps: Mutex::new(Vec::new()),
    });
    Publisher::start(recorder.clone());
    let folder = Folder::at(&dir);
    let me = std::process::id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_all(&folder).map_or(true, |l| l.processes.is_empty()) {
        assert!(Instant::now() < deadline, "no figures published");
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    let applied = request_limit(&folder, me, Some(0), LimitValue::Fraction(0.25)).unwrap();
    let took = started.elapsed();
    assert_eq!(applied, vec![("recorder".to_string(), 0, Some(250))]);
    assert_eq!(*recorder.caps.lock().unwrap(), vec![(0, Some(250))]);
    eprintln!("applied and confirmed in {took:?}");
    let applied = request_limit(&folder, me, None, LimitValue::None).unwrap();
    assert_eq!(applied, vec![("recorder".to_string(), 0, None)]);
    // A cap the process refuses is reported with its reason.
    let refused = request_limit(&folder, me, Some(0), LimitValue::Bytes(13)).unwrap_err();
    assert!(
        matches!(&refused, LimitError::Refused { why, .. } if why.contains("unlucky")),
        "{refused}"
    );
    assert!(matches!(
        request_limit(&folder, me, Some(3), LimitValue::None),
        Err(LimitError::UnknownDevice { device: 3, .. })
    ));
    assert!(matches!(
        request_limit(&folder, (1 << 22) + 1, None, LimitValue::None),
        Err(LimitError::UnknownProcess(_))
    ));
}
