//! The tiered demo workload (`strata demo`, the default): KV demand several times the HBM of the
//! device, served through the [`KvBlockManager`]: each request is a slot of a `KvSpace` (K and V
//! tensors per layer at fixed addresses) whose blocks spill to a [`TierStore`]'s host memory and
//! disk and come back at the same addresses.
//!
//! Requests are prefilled, then decode in round-robin batches; the scheduler's next batches are
//! hinted (lookahead: the request that runs furthest away spills first, and spilled blocks that
//! fit the compute window are prefetched, TierKV Eq. 1), each batch is made resident (an event)
//! and every block that came back from host memory or disk is checked byte for byte, in every
//! tensor, against the pattern it was written with. Idle requests spill to host memory, some
//! paused ones to disk. Out of memory is a normal outcome here, as in a scheduler: a batch that
//! does not fit HBM runs shorter that step, a prompt that does not fit waits for a later step,
//! and a token whose new block finds no page waits too.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata::allocator::{Kind, PagePool, PoolConfig};
use strata::tiers::policy::Links;
use strata::tiers::{
    DiskConfig, KvBlockManager, KvBlocksConfig, KvBlocksStats, PolicyKind, RequestId, StoreConfig,
    StoreStats, Tier, TierSpec, TierStore,
};
use strata::vmm::{Backend, Error, Result};

use super::workload::{matches, pattern_bytes, tensor_seed, Checks, Workload};
use crate::cli::chart::{write_chart, Series};

/// Shape of a tiered run.
#[derive(Clone, Debug)]
pub struct TieredConfig {
    /// The requests; `bytes_per_token` must divide the page size.
    pub workload: Workload,
    /// Requests decoding in one step.
    pub batch: u32,
    /// Lookahead window K (steps hinted ahead).
    pub lookahead: u32,
    /// The store's copy unit (divides the page size).
    pub chunk_bytes: u64,
    /// HBM the KV space may take from the pool (None: the device's whole memory).
    pub hbm_bytes: Option<u64>,
    pub host_bytes: u64,
    pub disk_bytes: u64,
    pub disk_dir: PathBuf,
    /// Requests idle this many steps spill to host memory.
    pub idle_steps: u64,
}

impl Default for TieredConfig {
    fn default() -> Self {
        TieredConfig {
            workload: Workload {
                device: 0,
                seed: 42,
                requests: 80,
                prompt: (128, 1280),
                output: (8, 32),
                layers: 2,
                bytes_per_token: 2048,
            },
            batch: 8,
            lookahead: 1,
            chunk_bytes: 256 << 10,
            hbm_bytes: None,
            host_bytes: 128 << 20,
            disk_bytes: 1 << 30,
            disk_dir: std::env::temp_dir(),
            idle_steps: 4,
        }
    }
}

/// One occupancy sample (bytes per tier) at a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    pub step: u64,
    pub hbm: u64,
    pub host: u64,
    pub disk: u64,
}

/// What a tiered run did and found.
#[derive(Clone, Debug)]
pub struct TieredReport {
    pub backend: String,
    pub hbm_bytes: u64,
    /// Peak KV demand: the pages every live request's blocks need, wherever they are.
    pub peak_kv_bytes: u64,
    pub steps: u64,
    pub requests: u32,
    /// Blocks (every tensor of one page index of a request) checked after coming back.
    pub verified_blocks: u64,
    pub mismatches: u64,
    pub store: StoreStats,
    pub kv: KvBlocksStats,
    pub samples: Vec<Sample>,
    pub disk_direct: bool,
    pub elapsed: Duration,
}

struct Live {
    id: RequestId,
    seed: u64,
    target: u32,
    /// Blocks seen spilled since they were last checked.
    went_down: BTreeSet<u32>,
}

/// Notes the blocks of `l` that are not resident now.
fn observe(kv: &KvBlockManager, l: &mut Live) -> Result<()> {
    for (b, tier) in kv.blocks(l.id)?.into_iter().enumerate() {
        if tier != Some(Tier::Hbm) {
            l.went_down.insert(b as u32);
        }
    }
    Ok(())
}

/// Every tensor: its number (for [`tensor_seed`]), layer and kind.
fn tensors(layers: u32) -> impl Iterator<Item = (u64, u32, Kind)> {
    (0..)
        .zip((0..layers).flat_map(|l| [(l, Kind::K), (l, Kind::V)]))
        .map(|(t, (l, k))| (t, l, k))
}

/// Appends `n` tokens to `r` and writes them in every tensor, as the engine's kernels would.
fn decode(kv: &KvBlockManager, l: &Live, n: u32, w: &Workload) -> Result<()> {
    let have = kv.tokens(l.id)?;
    kv.append(l.id, n)?;
    let bpt = w.bytes_per_token;
    for (t, layer, kind) in tensors(w.layers) {
        let data = pattern_bytes(
            tensor_seed(l.seed, t),
            u64::from(have) * bpt,
            u64::from(n) * bpt,
        );
        kv.write_kv(l.id, layer, kind, have, &data)?;
    }
    Ok(())
}

/// Runs the tiered workload on `backend`, calling `progress(step, finished)` after each step.
pub fn run(
    backend: Arc<dyn Backend>,
    config: &TieredConfig,
    mut progress: impl FnMut(u64, u32),
) -> Result<TieredReport> {
    let start = Instant::now();
    let w = &config.workload;
    w.validate()?;
    if config.batch == 0 {
        return Err(Error::InvalidArgument(
            "tiered demo: the batch must be positive".into(),
        ));
    }
    let page = backend.granularity(strata::vmm::Location::Device(w.device))?;
    let hbm_bytes = match config.hbm_bytes {
        Some(b) => b,
        // The KV space's zero page lives outside the pool.
        None => backend.mem_info(w.device)?.total.saturating_sub(page),
    } / page
        * page;
    let pool = PagePool::new(
        Arc::clone(&backend),
        w.device,
        PoolConfig {
            background: false,
            limit: Some(hbm_bytes),
            ..PoolConfig::default()
        },
    )?;
    let mut sc = StoreConfig::new(config.chunk_bytes, 0, config.host_bytes);
    sc.device = w.device;
    sc.hbm_policy = PolicyKind::Lookahead;
    sc.staging_blocks = 32;
    sc.disk = Some(DiskConfig {
        dir: config.disk_dir.clone(),
        spec: TierSpec {
            capacity: config.disk_bytes,
            bandwidth: 7e9,
            latency: Duration::from_micros(80),
        },
        io_threads: 2,
        direct: true,
    });
    let store = Arc::new(TierStore::new(pool, sc)?);
    let kv = KvBlockManager::new(
        Arc::clone(&store),
        KvBlocksConfig {
            layers: w.layers,
            max_requests: w.requests,
            max_tokens: w.prompt.1 + w.output.1,
            bytes_per_token: w.bytes_per_token,
            t_iter: Duration::from_millis(20),
            delta_sched: Duration::from_micros(100),
            links: Links {
                host_to_hbm: (Duration::from_micros(5), 50e9),
                disk_to_host: (Duration::from_micros(80), 7e9),
            },
            zero_page: true,
        },
    )?;
    let bpt = w.bytes_per_token;
    let mut rng = w.rng();
    let mut live: Vec<Live> = Vec::new();
    let mut admitted = 0u32;
    let mut finished = 0u32;
    let mut checks = Checks::default();
    let mut samples = Vec::new();
    let mut peak_kv = 0u64;
    let mut step = 0u64;
    let mut cursor = 0usize;
    // The next request's (prompt, output) lengths, drawn once even if its admission waits.
    let mut pending: Option<(u32, u32)> = None;
    let tpb = kv.tokens_per_block();
    let mut buf = Vec::new();
    while finished < w.requests {
        step += 1;
        kv.advance(step);
        // Admission: prefill up to half a batch of new requests per step (they are used in
        // this step, so they stay resident next to the decoding batch).
        let mut prefilled = 0;
        for _ in 0..config.batch.div_ceil(2) {
            if admitted == w.requests {
                break;
            }
            let (prompt, output) = *pending.get_or_insert_with(|| w.lengths(&mut rng));
            let l = Live {
                id: kv.admit()?,
                seed: w.request_seed(u64::from(admitted)),
                target: prompt + output,
                went_down: BTreeSet::new(),
            };
            match decode(&kv, &l, prompt, w) {
                Ok(()) => {}
                // HBM is full of this step's requests: the prompt waits for a later step (it
                // can never fit when nothing else is live).
                Err(e) if e.is_out_of_memory() && !live.is_empty() => {
                    kv.release(l.id)?;
                    break;
                }
                Err(e) => return Err(e),
            }
            pending = None;
            live.push(l);
            admitted += 1;
            prefilled += 1;
        }
        if live.is_empty() {
            continue;
        }
        // The scheduler's next batches (round robin) and the lookahead hint.
        let n = live.len();
        let batch_of = |k: usize| -> Vec<usize> {
            (0..(config.batch as usize).min(n))
                .map(|j| (cursor + k * config.batch as usize + j) % n)
                .collect()
        };
        let mut now: Vec<usize> = batch_of(0);
        let ahead: Vec<Vec<RequestId>> = (1..=config.lookahead as usize)
            .map(|k| batch_of(k).into_iter().map(|i| live[i].id).collect())
            .collect();
        // Beyond the window, the rest of the round robin in the order it runs: eviction takes
        // the request that runs last, never the next one (which plain LRU would pick).
        let mut seen: BTreeSet<usize> = now.iter().copied().collect();
        let rest: Vec<RequestId> = (config.lookahead as usize + 1
            ..=n.div_ceil(config.batch as usize))
            .flat_map(batch_of)
            .filter(|&i| seen.insert(i))
            .map(|i| live[i].id)
            .collect();
        kv.queue(&rest)?;
        cursor = (cursor + config.batch as usize) % n;
        let mut batch: Vec<RequestId> = now.iter().map(|&i| live[i].id).collect();
        for &i in &now {
            observe(&kv, &mut live[i])?;
        }
        // A batch that does not fit HBM runs shorter this step, as a scheduler would; when not
        // one request fits beside this step's prompts (which stay resident), the step was
        // theirs alone and the batch waits for the next.
        loop {
            match kv.make_resident(&batch) {
                Ok(ev) => break ev.synchronize()?,
                Err(e) if e.is_out_of_memory() && batch.len() > 1 => {
                    batch.pop();
                    now.pop();
                }
                Err(e) if e.is_out_of_memory() && prefilled > 0 => {
                    batch.clear();
                    now.clear();
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        // Every block of the batch that went down since its last check is checked once back.
        let mut returning = Vec::new();
        for &i in &now {
            returning.extend(
                std::mem::take(&mut live[i].went_down)
                    .into_iter()
                    .map(|b| (i, b)),
            );
        }
        let mut hint_schedule = vec![batch.clone()];
        hint_schedule.extend(ahead);
        // Prefetches overlap the "compute" of this step; the next step's make_resident finds
        // them resident (its event covers their copies).
        kv.hint(&hint_schedule)?;
        for (i, b) in returning {
            let l = &live[i];
            let total = kv.tokens(l.id)?;
            let first = b * tpb;
            let n = (total - first).min(tpb);
            let mut good = true;
            for (t, layer, kind) in tensors(w.layers) {
                buf.resize((u64::from(n) * bpt) as usize, 0);
                let tier = kv.read_kv(l.id, layer, kind, first, &mut buf)?;
                good &= tier == Tier::Hbm
                    && matches(&buf, tensor_seed(l.seed, t), u64::from(first) * bpt);
            }
            checks.record(good);
        }
        // Decode one token for each request of the batch; finished ones leave.
        let mut done = Vec::new();
        let mut progressed = false;
        for &i in &now {
            let l = &live[i];
            match decode(&kv, l, 1, w) {
                Ok(()) => progressed = true,
                // No page for a new block while this step's requests fill HBM: this token
                // waits for a later step.
                Err(e) if e.is_out_of_memory() => continue,
                Err(e) => return Err(e),
            }
            if kv.tokens(l.id)? >= l.target {
                done.push(i);
            }
        }
        if !progressed && prefilled == 0 {
            return Err(Error::InvalidArgument(format!(
                "tiered demo: {} MiB of HBM cannot hold one request's next block; use a smaller \
                 prompt or a bigger device",
                hbm_bytes >> 20
            )));
        }
        done.sort_unstable_by(|a, b| b.cmp(a));
        for i in done {
            let l = live.swap_remove(i);
            kv.release(l.id)?;
            finished += 1;
        }
        // Idle requests spill to host memory; every 8th step the least urgent one goes to disk.
        kv.spill_idle(config.idle_steps, Tier::Host)?;
        if step % 8 == 0 && !live.is_empty() {
            let far = live[(cursor + live.len() / 2) % live.len()].id;
            match kv.pause(far, Tier::Disk) {
                Ok(()) => {}
                Err(e) if e.is_out_of_memory() => {}
                Err(e) => return Err(e),
            }
        }
        for l in &mut live {
            observe(&kv, l)?;
        }
        let st = store.stats();
        let ks = kv.stats();
        peak_kv = peak_kv.max(ks.blocks * kv.block_bytes());
        samples.push(Sample {
            step,
            hbm: ks.blocks_resident * kv.block_bytes(),
            host: st.host_used * st.block_size,
            disk: st.disk_used * st.block_size,
        });
        progress(step, finished);
    }
    store.synchronize()?;
    kv.check_invariants()?;
    let st = store.stats();
    Ok(TieredReport {
        backend: backend.kind().to_string(),
        hbm_bytes,
        peak_kv_bytes: peak_kv,
        steps: step,
        requests: finished,
        verified_blocks: checks.verified,
        mismatches: checks.mismatches,
        disk_direct: st.disk_direct,
        store: st,
        kv: kv.stats(),
        samples,
        elapsed: start.elapsed(),
    })
}

/// Writes tier occupancy over time (MiB per tier against the step) as an SVG line chart.
pub fn write_svg(path: &std::path::Path, samples: &[Sample]) -> Result<()> {
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    let line = |f: fn(&Sample) -> u64| {
        samples
            .iter()
            .map(|s| (s.step as f64, mib(f(s))))
            .collect::<Vec<_>>()
    };
    write_chart(
        path,
        "strata demo: tier occupancy over time",
        "step",
        "MiB",
        &[
            Series {
                name: "HBM",
                color: "#d62728",
                points: line(|s| s.hbm),
            },
            Series {
                name: "host",
                color: "#1f77b4",
                points: line(|s| s.host),
            },
            Series {
                name: "disk",
                color: "#2ca02c",
                points: line(|s| s.disk),
            },
        ],
    )
}
