#![deny(unsafe_code)]
//! Replaying recorded allocation traces through the caching allocator: peak allocated, peak
//! reserved, their ratio (the allocator's overhead on a real workload) and the time per
//! operation. `strata bench replay` and `cargo bench --bench replay` drive it.

pub mod trace;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use strata_allocator::CachingAllocator;
use strata_vmm::{DevicePtr, Result, StreamHandle};

pub use trace::{Format, Op, Trace, TraceError};

/// The recorded traces the replay benchmarks run by default, in `benches/traces/` of the
/// repository at `repo` (re-recorded with `benches/traces/llama_workload.py`).
pub fn standard_traces(repo: &std::path::Path) -> Vec<std::path::PathBuf> {
    let dir = repo.join("benches/traces");
    [
        "llama-train.csv.gz",
        "llama-generate.csv.gz",
        "llama-mix.csv.gz",
        "mixtral-moe-generate.csv.gz",
    ]
    .iter()
    .map(|f| dir.join(f))
    .collect()
}

/// What a replay bench was asked to run: `--ops N` keeps the first N operations of each trace;
/// other `--` flags are the harness's (`--bench` from cargo, `--quick` from `.ci/gpu-run`: the
/// committed traces replay in about a second, so quick runs them whole) and are ignored; the
/// remaining arguments are trace files, none meaning [`standard_traces`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BenchArgs {
    pub files: Vec<std::path::PathBuf>,
    pub max_ops: Option<usize>,
}

impl BenchArgs {
    /// Parses the arguments after the program name.
    pub fn parse(args: impl IntoIterator<Item = String>) -> std::result::Result<Self, String> {
        let mut parsed = BenchArgs::default();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            if arg == "--ops" {
                let n = args.next().ok_or("--ops needs a count")?;
                let n = n
                    .parse()
                    .map_err(|_| format!("--ops {n:?}: expected a count of operations"))?;
                parsed.max_ops = Some(n);
            } else if !arg.starts_with("--") {
                parsed.files.push(arg.into());
            }
        }
        Ok(parsed)
    }

    /// The trace files to replay: those given, else the standard traces of the repository at
    /// `repo`.
    pub fn files_or_standard(&self, repo: &std::path::Path) -> Vec<std::path::PathBuf> {
        if self.files.is_empty() {
            standard_traces(repo)
        } else {
            self.files.clone()
        }
    }

    /// `trace` cut to `--ops` operations, if given.
    pub fn cut(&self, mut trace: Trace) -> Trace {
        if let Some(n) = self.max_ops {
            trace.ops.truncate(n);
        }
        trace
    }
}

/// The allocator's figures at one point of a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Operations replayed so far.
    pub op: u64,
    pub allocated: u64,
    pub reserved: u64,
}

/// What one replay measured.
#[derive(Clone, Debug)]
pub struct ReplayReport {
    pub ops: u64,
    /// Allocations refused (out of memory or over a limit); their frees are skipped.
    pub failed: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// Time spent in allocate and free calls (the whole loop).
    pub elapsed: Duration,
    /// Pages mapped during the replay (fresh or recycled).
    pub map_calls: u64,
    pub samples: Vec<Sample>,
}

impl ReplayReport {
    /// Peak reserved ÷ peak allocated (1.0 for an empty trace).
    pub fn ratio(&self) -> f64 {
        if self.peak_allocated == 0 {
            1.0
        } else {
            self.peak_reserved as f64 / self.peak_allocated as f64
        }
    }

    /// Mean time per operation.
    pub fn ns_per_op(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.ops.max(1) as f64
    }
}

/// A trace as dense slots, so that the timed loop does no hashing.
enum Step {
    Alloc { slot: usize, bytes: u64 },
    Free { slot: usize },
}

fn steps(trace: &Trace) -> (Vec<Step>, usize) {
    let mut slots: HashMap<u64, usize> = HashMap::new();
    let mut free_slots: Vec<usize> = Vec::new();
    let mut count = 0usize;
    let mut out = Vec::with_capacity(trace.ops.len());
    for op in &trace.ops {
        match *op {
            Op::Alloc { id, bytes, .. } => {
                let slot = free_slots.pop().unwrap_or_else(|| {
                    count += 1;
                    count - 1
                });
                slots.insert(id, slot);
                out.push(Step::Alloc { slot, bytes });
            }
            Op::Free { id } => {
                if let Some(slot) = slots.remove(&id) {
                    free_slots.push(slot);
                    out.push(Step::Free { slot });
                }
            }
        }
    }
    (out, count)
}

/// Replays `trace` on `stream` through `alloc` (a fresh allocator gives comparable peaks).
/// With `sample_every`, the allocator's figures are sampled every that many operations (the
/// stats calls then count in the elapsed time: time a replay without sampling). Allocations
/// still live at the end are freed (untimed). Errors other than out-of-memory end the replay.
pub fn replay(
    alloc: &CachingAllocator,
    trace: &Trace,
    stream: StreamHandle,
    sample_every: Option<u64>,
) -> Result<ReplayReport> {
    let (steps, slots) = steps(trace);
    let mut ptrs: Vec<Option<DevicePtr>> = vec![None; slots];
    let mut samples = Vec::new();
    let every = sample_every.unwrap_or(0);
    let mut failed = 0u64;
    let sample = |op: u64, samples: &mut Vec<Sample>| {
        let s = alloc.stats();
        samples.push(Sample {
            op,
            allocated: s.allocated_bytes,
            reserved: s.reserved_bytes,
        });
    };
    if every > 0 {
        sample(0, &mut samples);
    }
    let start = Instant::now();
    for (i, step) in steps.iter().enumerate() {
        match *step {
            Step::Alloc { slot, bytes } => match alloc.allocate(bytes, stream) {
                Ok(p) => ptrs[slot] = Some(p),
                Err(e) if e.is_out_of_memory() => {
                    failed += 1;
                    ptrs[slot] = None;
                }
                Err(e) => return Err(e),
            },
            Step::Free { slot } => {
                if let Some(p) = ptrs[slot].take() {
                    alloc.deallocate(p, stream)?;
                }
            }
        }
        if every > 0 && (i as u64 + 1) % every == 0 {
            sample(i as u64 + 1, &mut samples);
        }
    }
    let elapsed = start.elapsed();
    let stats = alloc.stats();
    for p in ptrs.into_iter().flatten() {
        alloc.deallocate(p, stream)?;
    }
    Ok(ReplayReport {
        ops: steps.len() as u64,
        failed,
        peak_allocated: stats.peak_allocated_bytes,
        peak_reserved: stats.peak_reserved_bytes,
        elapsed,
        map_calls: stats.counts.map_calls,
        samples,
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use strata_allocator::{CachingConfig, PagePool, PoolConfig};
    use strata_vmm::host::{self, HostConfig};

    use super::*;

    fn traces() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../benches/traces")
    }

    fn replay_fresh(trace: &Trace) -> ReplayReport {
        let backend = host::open(HostConfig {
            devices: vec![4 << 30],
            granularity: 2 << 20,
            strict: true,
            link: None,
        })
        .expect("host backend");
        let pool = PagePool::new(backend, 0, PoolConfig::default()).expect("pool");
        let alloc = CachingAllocator::new(pool, CachingConfig::default()).expect("allocator");
        let report = replay(&alloc, trace, StreamHandle::DEFAULT, Some(1000)).expect("replay");
        alloc.check_invariants().expect("invariants");
        report
    }

    fn args(list: &[&str]) -> std::result::Result<BenchArgs, String> {
        BenchArgs::parse(list.iter().map(|a| a.to_string()))
    }

    #[test]
    fn bench_arguments_take_a_count_after_ops_and_ignore_harness_flags() {
        // `.ci/gpu-run --quick` passes these: "5000" is --ops's count, not a trace file.
        let quick = args(&["--bench", "--quick", "--ops", "5000"]).unwrap();
        assert_eq!(quick.files, Vec::<PathBuf>::new());
        assert_eq!(quick.max_ops, Some(5000));
        let repo = traces().join("../..");
        assert_eq!(quick.files_or_standard(&repo), standard_traces(&repo));
        let trace = Trace::load(&traces().join("llama-train.csv.gz"), None).unwrap();
        assert!(trace.ops.len() > 5000);
        assert_eq!(quick.cut(trace).ops.len(), 5000);

        let given = args(&["a.csv", "--bench", "b.json"]).unwrap();
        assert_eq!(
            given.files,
            [PathBuf::from("a.csv"), PathBuf::from("b.json")]
        );
        assert_eq!(given.max_ops, None);
        assert!(args(&["--ops"]).unwrap_err().contains("--ops"));
        assert!(args(&["--ops", "many"]).unwrap_err().contains("many"));
    }

    #[test]
    fn a_python_pickled_snapshot_reads_like_its_csv() {
        // The snapshot is the training trace written in `_dump_snapshot`'s format by Python's
        // pickle (alloc, free_requested, free_completed; no GPU was at hand to record one).
        let csv = Trace::load(&traces().join("llama-train.csv.gz"), None).unwrap();
        let snap = Trace::load(&traces().join("llama-train-as-snapshot.pickle.gz"), None).unwrap();
        assert_eq!((csv.format, snap.format), (Format::Csv, Format::Snapshot));
        assert_eq!(csv.ops, snap.ops);
        assert_eq!(snap.unmatched_frees, 0);
    }

    #[test]
    fn committed_traces_reserve_at_most_five_percent_over_their_peak() {
        for name in [
            "llama-train.csv.gz",
            "llama-mix.csv.gz",
            "llama-generate.csv.gz",
            "mixtral-moe-generate.csv.gz",
        ] {
            let trace = Trace::load(&traces().join(name), None).unwrap();
            let report = replay_fresh(&trace);
            assert_eq!(report.failed, 0);
            assert_eq!(report.peak_allocated, trace.peak_live_bytes(), "{name}");
            assert!(report.ratio() <= 1.05, "{name}: {:.3}", report.ratio());
            assert!(report.samples.len() as u64 > report.ops / 1000);
            assert!(report
                .samples
                .iter()
                .all(|s| s.allocated <= s.reserved && s.reserved <= report.peak_reserved));
        }
    }
}
