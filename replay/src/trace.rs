//! Allocation traces: the three formats `strata bench replay` reads, each turned into one list
//! of allocate/free operations keyed by allocation id.
//!
//! - **CSV** `op,id,bytes` (header optional): `alloc,ID,BYTES` and `free,ID[,BYTES]`; what
//!   `python -m strata.trace record` writes.
//! - **Chrome trace** JSON from the PyTorch profiler (`profile_memory=True`,
//!   `export_chrome_trace`): its `[memory]` instant events, `Addr` and `Bytes` (negative for a
//!   free), of one device type (the one with the most traffic unless chosen).
//! - **Memory snapshot** pickle (`torch.cuda.memory._dump_snapshot`): the `device_traces` of one
//!   device (the busiest unless chosen); `alloc` allocates, `free_completed` frees (the block is
//!   reusable from then on), and `free_requested` frees only in traces without any
//!   `free_completed`.
//!
//! Any of them may be gzip-compressed. Frees of allocations the trace never made (they predate
//! the recording) are skipped and counted.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::Deserialize;

/// One operation of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocation `id` of `bytes` bytes on trace stream `stream` (0: the default stream).
    Alloc { id: u64, bytes: u64, stream: u64 },
    /// Free of allocation `id`.
    Free { id: u64 },
}

/// The format a trace was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Csv,
    ChromeTrace,
    Snapshot,
}

/// A parsed trace.
#[derive(Clone, Debug)]
pub struct Trace {
    pub format: Format,
    pub ops: Vec<Op>,
    /// Frees of allocations made before the recording began (skipped).
    pub unmatched_frees: u64,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("CSV line {line}: {reason}")]
    Csv { line: usize, reason: String },
    #[error("Chrome trace JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("memory snapshot pickle: {0}")]
    Pickle(#[from] serde_pickle::Error),
    #[error("{0}")]
    Content(String),
}

/// Which device's events to keep (Chrome trace: a device type, 0 CPU, 1 CUDA; snapshot: a
/// device index). `None`: the one with the most traffic.
pub type DeviceChoice = Option<i64>;

impl Trace {
    /// Reads a trace file, detecting gzip and the format from its first bytes.
    pub fn load(path: &Path, device: DeviceChoice) -> Result<Trace, TraceError> {
        let file = std::fs::File::open(path)?;
        let mut raw = BufReader::new(file);
        let gz = raw.fill_buf()?.starts_with(&[0x1f, 0x8b]);
        let mut reader: Box<dyn BufRead> = if gz {
            Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(raw)))
        } else {
            Box::new(raw)
        };
        let head = reader.fill_buf()?;
        match head.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(0x80) => Self::from_snapshot(reader, device),
            Some(b'{') => Self::from_chrome(reader, device),
            _ => Self::from_csv(reader),
        }
    }

    /// Parses the CSV format.
    pub fn from_csv(reader: impl BufRead) -> Result<Trace, TraceError> {
        let mut b = Builder::default();
        for (i, line) in reader.lines().enumerate() {
            let line = line?;
            let line = line.trim();
            let bad = |reason: &str| TraceError::Csv {
                line: i + 1,
                reason: format!("{reason}: {line:?}"),
            };
            if line.is_empty() || line.starts_with('#') || (i == 0 && line.starts_with("op,")) {
                continue;
            }
            let mut fields = line.split(',').map(str::trim);
            let op = fields.next().unwrap_or_default();
            let id: u64 = fields
                .next()
                .and_then(|f| f.parse().ok())
                .ok_or_else(|| bad("expected an id"))?;
            let bytes: Option<u64> = match fields.next() {
                Some(f) => Some(f.parse().map_err(|_| bad("expected a byte count"))?),
                None => None,
            };
            match op {
                "alloc" => {
                    let bytes = bytes.ok_or_else(|| bad("alloc without a byte count"))?;
                    if !b.alloc(id, bytes, 0) {
                        return Err(bad("id allocated twice"));
                    }
                }
                "free" => b.free(id),
                _ => return Err(bad("op must be alloc or free")),
            }
        }
        Ok(b.finish(Format::Csv))
    }

    /// Parses a Chrome trace's `[memory]` events.
    pub fn from_chrome(reader: impl Read, device: DeviceChoice) -> Result<Trace, TraceError> {
        #[derive(Deserialize)]
        struct Chrome {
            #[serde(rename = "traceEvents", default)]
            events: Vec<Event>,
        }
        #[derive(Deserialize)]
        struct Event {
            #[serde(default)]
            name: String,
            #[serde(default)]
            ts: f64,
            #[serde(default)]
            args: Option<Args>,
        }
        #[derive(Deserialize)]
        struct Args {
            #[serde(rename = "Addr")]
            addr: Option<u64>,
            #[serde(rename = "Bytes")]
            bytes: Option<i64>,
            #[serde(rename = "Device Type", default)]
            device_type: i64,
        }
        let chrome: Chrome = serde_json::from_reader(reader)?;
        let mut events: Vec<(f64, u64, i64, i64)> = chrome
            .events
            .into_iter()
            .filter(|e| e.name == "[memory]")
            .filter_map(|e| {
                let a = e.args?;
                Some((e.ts, a.addr?, a.bytes?, a.device_type))
            })
            .collect();
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        let dev = device.or_else(|| busiest(events.iter().map(|e| (e.3, e.2.unsigned_abs()))));
        let mut b = Builder::default();
        let mut by_addr: HashMap<u64, u64> = HashMap::new();
        let mut next = 0u64;
        for &(_, addr, bytes, dtype) in &events {
            if Some(dtype) != dev || bytes == 0 {
                continue;
            }
            if bytes > 0 {
                by_addr.insert(addr, next);
                b.alloc(next, bytes as u64, 0);
                next += 1;
            } else {
                match by_addr.remove(&addr) {
                    Some(id) => b.free(id),
                    None => b.unmatched += 1,
                }
            }
        }
        Ok(b.finish(Format::ChromeTrace))
    }

    /// Parses a memory snapshot pickle's `device_traces`.
    pub fn from_snapshot(reader: impl Read, device: DeviceChoice) -> Result<Trace, TraceError> {
        #[derive(Deserialize)]
        struct Snapshot {
            #[serde(default)]
            device_traces: Vec<Vec<Entry>>,
        }
        #[derive(Deserialize)]
        struct Entry {
            action: String,
            #[serde(default)]
            addr: u64,
            #[serde(default)]
            size: u64,
            #[serde(default)]
            stream: u64,
        }
        let options = serde_pickle::DeOptions::new().replace_unresolved_globals();
        let snap: Snapshot = serde_pickle::from_reader(reader, options)?;
        let traces = snap.device_traces;
        let dev = match device {
            Some(d) => usize::try_from(d)
                .ok()
                .filter(|&d| d < traces.len())
                .ok_or_else(|| {
                    TraceError::Content(format!(
                        "device {d} not in the snapshot ({} devices)",
                        traces.len()
                    ))
                })?,
            None => (0..traces.len())
                .max_by_key(|&d| traces[d].len())
                .unwrap_or(0),
        };
        let entries = traces.get(dev).map(Vec::as_slice).unwrap_or_default();
        let completes = entries.iter().any(|e| e.action == "free_completed");
        let free_action = if completes {
            "free_completed"
        } else {
            "free_requested"
        };
        let mut b = Builder::default();
        let mut by_addr: HashMap<u64, u64> = HashMap::new();
        let mut next = 0u64;
        for e in entries {
            if e.action == "alloc" {
                by_addr.insert(e.addr, next);
                b.alloc(next, e.size, e.stream);
                next += 1;
            } else if e.action == free_action {
                match by_addr.remove(&e.addr) {
                    Some(id) => b.free(id),
                    None => b.unmatched += 1,
                }
            }
        }
        Ok(b.finish(Format::Snapshot))
    }

    /// Allocations and frees.
    pub fn counts(&self) -> (u64, u64) {
        let allocs = self
            .ops
            .iter()
            .filter(|o| matches!(o, Op::Alloc { .. }))
            .count() as u64;
        (allocs, self.ops.len() as u64 - allocs)
    }

    /// The most bytes live at once, by the trace's own sizes.
    pub fn peak_live_bytes(&self) -> u64 {
        let mut size: HashMap<u64, u64> = HashMap::new();
        let (mut live, mut peak) = (0u64, 0u64);
        for op in &self.ops {
            match *op {
                Op::Alloc { id, bytes, .. } => {
                    size.insert(id, bytes);
                    live += bytes;
                    peak = peak.max(live);
                }
                Op::Free { id } => live -= size.remove(&id).unwrap_or(0),
            }
        }
        peak
    }
}

/// The key with the most bytes.
fn busiest(items: impl Iterator<Item = (i64, u64)>) -> Option<i64> {
    let mut by: HashMap<i64, u64> = HashMap::new();
    for (k, v) in items {
        *by.entry(k).or_default() += v;
    }
    by.into_iter().max_by_key(|&(k, v)| (v, -k)).map(|(k, _)| k)
}

#[derive(Default)]
struct Builder {
    ops: Vec<Op>,
    live: std::collections::HashSet<u64>,
    unmatched: u64,
}

impl Builder {
    /// False when `id` is already live. Zero-byte allocations are kept (the allocator returns
    /// a null pointer for them, and their free is a no-op).
    fn alloc(&mut self, id: u64, bytes: u64, stream: u64) -> bool {
        if !self.live.insert(id) {
            return false;
        }
        self.ops.push(Op::Alloc { id, bytes, stream });
        true
    }

    fn free(&mut self, id: u64) {
        if self.live.remove(&id) {
            self.ops.push(Op::Free { id });
        } else {
            self.unmatched += 1;
        }
    }

    fn finish(self, format: Format) -> Trace {
        Trace {
            format,
            ops: self.ops,
            unmatched_frees: self.unmatched,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_with_header_comments_and_unmatched_frees() {
        let text =
            "op,id,bytes\n# a comment\nalloc,1,4096\nalloc,2,100\nfree,7,5\nfree,1,4096\nfree,2\n";
        let t = Trace::from_csv(text.as_bytes()).unwrap();
        assert_eq!(t.format, Format::Csv);
        assert_eq!(t.counts(), (2, 2));
        assert_eq!(t.unmatched_frees, 1);
        assert_eq!(t.peak_live_bytes(), 4196);
        assert_eq!(
            t.ops[0],
            Op::Alloc {
                id: 1,
                bytes: 4096,
                stream: 0
            }
        );
    }

    #[test]
    fn csv_errors_name_the_line() {
        for (text, line) in [
            ("alloc,1\n", 1),
            ("alloc,1,5\nmalloc,2,5\n", 2),
            ("alloc,x,5\n", 1),
            ("alloc,1,5\nalloc,1,6\n", 2),
            ("alloc,1,-5\n", 1),
        ] {
            match Trace::from_csv(text.as_bytes()) {
                Err(TraceError::Csv { line: l, .. }) => assert_eq!(l, line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn chrome_trace_keeps_the_busiest_device_type_in_time_order() {
        let json = r#"{"traceEvents": [
            {"name": "aten::add", "ts": 1, "args": {}},
            {"name": "[memory]", "ts": 30, "args": {"Addr": 16, "Bytes": -512, "Device Type": 1}},
            {"name": "[memory]", "ts": 10, "args": {"Addr": 16, "Bytes": 512, "Device Type": 1}},
            {"name": "[memory]", "ts": 20, "args": {"Addr": 16, "Bytes": 8, "Device Type": 0}},
            {"name": "[memory]", "ts": 40, "args": {"Addr": 16, "Bytes": 256, "Device Type": 1}},
            {"name": "[memory]", "ts": 50, "args": {"Addr": 99, "Bytes": -4, "Device Type": 1}}
        ]}"#;
        let t = Trace::from_chrome(json.as_bytes(), None).unwrap();
        assert_eq!(t.format, Format::ChromeTrace);
        assert_eq!(
            t.ops,
            vec![
                Op::Alloc {
                    id: 0,
                    bytes: 512,
                    stream: 0
                },
                Op::Free { id: 0 },
                Op::Alloc {
                    id: 1,
                    bytes: 256,
                    stream: 0
                },
            ]
        );
        assert_eq!(t.unmatched_frees, 1);
        let cpu = Trace::from_chrome(json.as_bytes(), Some(0)).unwrap();
        assert_eq!(cpu.counts(), (1, 0));
        assert!(Trace::from_chrome(&b"{\"traceEvents\": 5}"[..], None).is_err());
    }

    #[test]
    fn snapshot_pickle_frees_on_completion() {
        use serde_pickle::{HashableValue as K, Value as V};
        let entry = |action: &str, addr: i64, size: i64| {
            let mut d = std::collections::BTreeMap::new();
            d.insert(K::String("action".into()), V::String(action.into()));
            d.insert(K::String("addr".into()), V::I64(addr));
            d.insert(K::String("size".into()), V::I64(size));
            d.insert(K::String("stream".into()), V::I64(0));
            d.insert(K::String("frames".into()), V::List(vec![]));
            V::Dict(d)
        };
        let device = V::List(vec![
            entry("segment_alloc", 0, 2 << 20),
            entry("alloc", 64, 1000),
            entry("alloc", 4096, 3000),
            entry("free_requested", 64, 1000),
            entry("free_completed", 64, 1000),
            entry("free_requested", 4096, 3000),
        ]);
        let mut top = std::collections::BTreeMap::new();
        top.insert(K::String("segments".into()), V::List(vec![]));
        top.insert(
            K::String("device_traces".into()),
            V::List(vec![V::List(vec![]), device]),
        );
        let bytes = serde_pickle::value_to_vec(&V::Dict(top), Default::default()).unwrap();
        let t = Trace::from_snapshot(&bytes[..], None).unwrap();
        assert_eq!(t.format, Format::Snapshot);
        assert_eq!(t.counts(), (2, 1)); // the second free was requested, never completed
        assert_eq!(t.ops[2], Op::Free { id: 0 });
        assert!(Trace::from_snapshot(&bytes[..], Some(5)).is_err());
        assert_eq!(
            Trace::from_snapshot(&bytes[..], Some(0)).unwrap().ops.len(),
            0
        );
        assert!(Trace::from_snapshot(&b"\x80\x04garbage"[..], None).is_err());
    }
}
