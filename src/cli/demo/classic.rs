//! The demo workload (`strata demo`): a KV-serving run through [`KvSpace`] and the
//! [`CachingAllocator`] on any backend.
//!
//! Requests arrive (Poisson), are admitted into KV slots (prefill grows the slot by the prompt),
//! grow token by token while decoding, and finish (the slot is freed, its pages kept for the next
//! request by deferred reclamation). Each step also allocates and frees activations of mixed
//! sizes through the caching allocator, and the model's weights live under their own tag, put to
//! sleep (with a host copy) and woken once mid-run. Every byte written is a fill pattern that is
//! read back and checked: KV of two tensors per request, per 16-token block, on finish; request
//! state buffers; the weights after wake. All bytes move through backend copies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::Rng;
use strata::allocator::{
    AllocatorStats, CachingAllocator, CachingConfig, Kind, KvConfig, KvSpace, KvStats, PagePool,
    PoolConfig, SlotId, TagId,
};
use strata::vmm::{Backend, DevicePtr, Error, Result, StreamHandle};

use super::workload::{pattern_bytes, tensor_seed, Checks, Workload};

/// KV block size (tokens) used for content checks, as engines page KV.
const BLOCK_TOKENS: u32 = 16;
const WEIGHTS: TagId = 1;
const ACTIVATIONS: TagId = 2;
const S: StreamHandle = StreamHandle::DEFAULT;

/// Shape of a demo run.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    pub workload: Workload,
    /// Mean arrivals per decode step.
    pub arrival_rate: f64,
    pub max_slots: u32,
    pub max_tokens: u32,
    /// Bytes of model weights (under their own tag; slept and woken mid-run).
    pub weight_bytes: u64,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            workload: Workload {
                device: 0,
                seed: 42,
                requests: 600,
                prompt: (32, 1536),
                output: (16, 384),
                layers: 16,
                bytes_per_token: 2048, // 8 KV heads × 128 dims × bf16
            },
            arrival_rate: 1.5,
            max_slots: 64,
            max_tokens: 4096,
            weight_bytes: 256 << 20,
        }
    }
}

/// Progress as the run goes.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub step: u64,
    pub finished: u32,
    pub active: u32,
    pub waiting: u32,
}

/// What a run did and found.
#[derive(Clone, Debug)]
pub struct DemoReport {
    pub backend: String,
    pub requests: u32,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub decoded_tokens: u64,
    /// Steps at which a waiting request could not be admitted (no slot or no memory).
    pub admission_stalls: u64,
    /// Requests admitted into a slot whose pages were still mapped (deferred reclamation).
    pub slots_reused: u64,
    /// Requests sent back to the queue (to be recomputed) because no active request could grow.
    pub preemptions: u64,
    pub kv: KvStats,
    pub peak_kv_pages: u64,
    pub page_size: u64,
    pub allocator: AllocatorStats,
    /// Most device memory in use (total − free) seen at a step boundary.
    pub peak_device_used: u64,
    pub device_total: u64,
    /// Checked units: 16-token KV blocks, request buffers, weight tensors.
    pub verified_blocks: u64,
    pub mismatches: u64,
    pub sleep_wake_cycles: u32,
    pub elapsed: Duration,
}

struct Request {
    id: u64,
    /// The seed of its fill patterns.
    seed: u64,
    prompt: u32,
    output: u32,
}

struct Active {
    request: Request,
    slot: SlotId,
    tokens: u32,
    state: DevicePtr,
    state_len: u64,
}

/// Runs the demo on `backend`, calling `progress` after each step.
pub fn run(
    backend: Arc<dyn Backend>,
    config: &DemoConfig,
    mut progress: impl FnMut(Progress),
) -> Result<DemoReport> {
    validate(config)?;
    let start = Instant::now();
    let w = &config.workload;
    let device = w.device;
    let pool = PagePool::new(
        Arc::clone(&backend),
        device,
        PoolConfig {
            low_watermark: 8,
            high_watermark: 64,
            ..PoolConfig::default()
        },
    )?;
    let page_size = pool.page_size();
    let alloc = CachingAllocator::new(Arc::clone(&pool), CachingConfig::default())?;
    let mut kv = KvSpace::new(
        Arc::clone(&pool),
        KvConfig {
            layers: w.layers,
            max_slots: config.max_slots,
            max_tokens: config.max_tokens,
            bytes_per_token: w.bytes_per_token,
            zero_page: false,
        },
    )?;
    let mut rng = w.rng();
    let mut checks = Checks::default();

    let weights = load_weights(&alloc, w, config.weight_bytes)?;
    let device_total = backend.mem_info(device)?.total;

    let mut next_id = 0u64;
    let mut waiting: std::collections::VecDeque<Request> = Default::default();
    let mut active: Vec<Active> = Vec::new();
    let (mut finished, mut step) = (0u32, 0u64);
    let (mut prompt_tokens, mut decoded_tokens, mut stalls, mut reused) = (0u64, 0u64, 0u64, 0u64);
    let (mut peak_kv_pages, mut peak_used, mut preemptions) = (0u64, 0u64, 0u64);
    let mut sleep_wake_cycles = 0u32;

    while finished < w.requests {
        step += 1;
        // Arrivals.
        let arrivals = poisson(&mut rng, config.arrival_rate);
        for _ in 0..arrivals {
            if next_id < u64::from(w.requests) {
                let (prompt, output) = w.lengths(&mut rng);
                waiting.push_back(Request {
                    id: next_id,
                    seed: w.request_seed(next_id),
                    prompt,
                    output,
                });
                next_id += 1;
            }
        }
        if next_id < u64::from(w.requests) && waiting.is_empty() && active.is_empty() {
            continue; // idle step: nothing arrived yet
        }

        // Admission and prefill, in arrival order.
        while let Some(request) = waiting.pop_front() {
            match admit(&backend, &mut kv, &alloc, config, request, &mut rng)? {
                Admitted::Yes(a, was_reused) => {
                    prompt_tokens += a.tokens as u64;
                    reused += was_reused as u64;
                    active.push(a);
                }
                Admitted::No(request) if active.is_empty() => {
                    return Err(Error::InvalidArgument(format!(
                        "demo: request {} ({} + {} tokens) does not fit on device {device} even alone",
                        request.id, request.prompt, request.output
                    )));
                }
                Admitted::No(request) => {
                    waiting.push_front(request);
                    stalls += 1;
                    break;
                }
            }
        }

        // One decode step: every active request grows by a token.
        let activations = step_activations(&alloc, active.len() as u64, &mut rng)?;
        let mut grew = 0;
        for a in active.iter_mut() {
            match kv.grow(a.slot, a.tokens + 1) {
                Ok(()) => {
                    write_tokens(backend.as_ref(), &kv, config, a, a.tokens, 1)?;
                    a.tokens += 1;
                    grew += 1;
                }
                Err(e) if e.is_out_of_memory() => stalls += 1, // this request waits a step
                Err(e) => return Err(e),
            }
        }
        decoded_tokens += grew;
        if grew == 0 && !active.is_empty() {
            // Nobody could grow: preempt the youngest request; it is recomputed when readmitted.
            if let Some(victim) = active.pop() {
                alloc.deallocate(victim.state, S)?;
                kv.free(victim.slot)?;
                kv.reclaim_deferred();
                waiting.push_front(victim.request);
                preemptions += 1;
            }
        }
        check_activations(backend.as_ref(), &alloc, activations, &mut checks)?;

        // Finished requests: check everything they wrote, then free.
        let mut i = 0;
        while i < active.len() {
            if active[i].tokens >= active[i].request.prompt + active[i].request.output {
                let done = active.swap_remove(i);
                verify_request(backend.as_ref(), &kv, config, &done, &mut checks)?;
                alloc.deallocate(done.state, S)?;
                kv.free(done.slot)?;
                finished += 1;
            } else {
                i += 1;
            }
        }

        peak_kv_pages = peak_kv_pages.max(kv.stats().pages_mapped);
        let mem = backend.mem_info(device)?;
        peak_used = peak_used.max(mem.total - mem.free);

        // Halfway: the weights sleep (host copy) and wake, as between engine phases.
        if sleep_wake_cycles == 0 && finished >= w.requests / 2 {
            alloc.sleep(WEIGHTS, true)?;
            // KV may take the memory meanwhile: on out-of-memory, give back what is
            // reclaimable, then preempt requests, until the weights fit again.
            while let Err(e) = alloc.wake(WEIGHTS) {
                if !e.is_out_of_memory() {
                    return Err(e);
                }
                if kv.reclaim_deferred() == 0 && pool.trim(0) == 0 {
                    let Some(victim) = active.pop() else {
                        return Err(e);
                    };
                    alloc.deallocate(victim.state, S)?;
                    kv.free(victim.slot)?;
                    waiting.push_front(victim.request);
                    preemptions += 1;
                }
            }
            verify_weights(backend.as_ref(), &weights, &mut checks)?;
            sleep_wake_cycles += 1;
        }
        progress(Progress {
            step,
            finished,
            active: active.len() as u32,
            waiting: waiting.len() as u32,
        });
    }
    verify_weights(backend.as_ref(), &weights, &mut checks)?;
    for (ptr, _, _) in &weights {
        alloc.deallocate(*ptr, S)?;
    }
    alloc.check_invariants().map_err(Error::InvalidState)?;
    kv.check_layout().map_err(Error::InvalidState)?; // the pool is shared with the allocator
    Ok(DemoReport {
        backend: backend.kind().to_string(),
        requests: finished,
        steps: step,
        prompt_tokens,
        decoded_tokens,
        admission_stalls: stalls,
        slots_reused: reused,
        preemptions,
        kv: kv.stats(),
        peak_kv_pages,
        page_size,
        allocator: alloc.stats(),
        peak_device_used: peak_used,
        device_total,
        verified_blocks: checks.verified,
        mismatches: checks.mismatches,
        sleep_wake_cycles,
        elapsed: start.elapsed(),
    })
}

fn validate(config: &DemoConfig) -> Result<()> {
    let w = &config.workload;
    w.validate()?;
    let bad = |why: &str| Err(Error::InvalidArgument(format!("demo: {why}")));
    if u64::from(w.prompt.1) + u64::from(w.output.1) > u64::from(config.max_tokens) {
        return bad("the longest prompt plus output must fit max_tokens");
    }
    if !(config.arrival_rate > 0.0 && config.arrival_rate.is_finite()) {
        return bad("the arrival rate must be positive");
    }
    Ok(())
}

enum Admitted {
    Yes(Active, bool),
    No(Request),
}

fn admit(
    backend: &Arc<dyn Backend>,
    kv: &mut KvSpace,
    alloc: &CachingAllocator,
    config: &DemoConfig,
    request: Request,
    rng: &mut SmallRng,
) -> Result<Admitted> {
    let deferred_before = kv.stats().slots_deferred;
    let slot = match kv.admit() {
        Ok(slot) => slot,
        Err(Error::InvalidState(_)) => return Ok(Admitted::No(request)), // every slot busy
        Err(e) => return Err(e),
    };
    let was_reused = kv.stats().slots_deferred < deferred_before;
    if let Err(e) = kv.grow(slot, request.prompt) {
        kv.free(slot)?;
        return if e.is_out_of_memory() {
            Ok(Admitted::No(request))
        } else {
            Err(e)
        };
    }
    let state_len = rng.random_range(1024..=64 << 10);
    let state = match alloc.allocate(state_len, S) {
        Ok(p) => p,
        Err(e) if e.is_out_of_memory() => {
            kv.free(slot)?;
            return Ok(Admitted::No(request));
        }
        Err(e) => return Err(e),
    };
    backend.write(
        state,
        &pattern_bytes(tensor_seed(request.seed, STATE), 0, state_len),
    )?;
    let mut a = Active {
        slot,
        tokens: 0,
        state,
        state_len,
        request,
    };
    write_tokens(backend.as_ref(), kv, config, &a, 0, a.request.prompt)?;
    a.tokens = a.request.prompt;
    Ok(Admitted::Yes(a, was_reused))
}

/// The two tensors whose contents are written and checked: first layer's K, last layer's V.
fn checked_tensors(config: &DemoConfig) -> [(u32, Kind); 2] {
    [(0, Kind::K), (config.workload.layers - 1, Kind::V)]
}

/// The tensor number of a request's state buffer in [`tensor_seed`] (after its two KV tensors).
const STATE: u64 = 2;

fn write_tokens(
    backend: &dyn Backend,
    kv: &KvSpace,
    config: &DemoConfig,
    a: &Active,
    from: u32,
    count: u32,
) -> Result<()> {
    let bpt = config.workload.bytes_per_token;
    for (t, (layer, kind)) in (0..).zip(checked_tensors(config)) {
        let base = kv.slot_ptr(a.slot, layer, kind)?;
        let offset = u64::from(from) * bpt;
        let bytes = pattern_bytes(
            tensor_seed(a.request.seed, t),
            offset,
            u64::from(count) * bpt,
        );
        backend.write(base + offset, &bytes)?;
    }
    Ok(())
}

fn verify_request(
    backend: &dyn Backend,
    kv: &KvSpace,
    config: &DemoConfig,
    a: &Active,
    checks: &mut Checks,
) -> Result<()> {
    let bpt = config.workload.bytes_per_token;
    let block = u64::from(BLOCK_TOKENS) * bpt;
    let total = u64::from(a.tokens) * bpt;
    let mut buf = vec![0u8; total as usize];
    for (t, (layer, kind)) in (0..).zip(checked_tensors(config)) {
        backend.read(kv.slot_ptr(a.slot, layer, kind)?, &mut buf)?;
        for (b, chunk) in (0..).zip(buf.chunks(block as usize)) {
            checks.check(chunk, tensor_seed(a.request.seed, t), b * block);
        }
    }
    let mut state = vec![0u8; a.state_len as usize];
    backend.read(a.state, &mut state)?;
    checks.check(&state, tensor_seed(a.request.seed, STATE), 0);
    Ok(())
}

/// Weight tensors: (ptr, len, seed).
type Weights = Vec<(DevicePtr, u64, u64)>;

fn load_weights(alloc: &CachingAllocator, w: &Workload, total: u64) -> Result<Weights> {
    // Mixed tensor sizes, as a model's: a few large matrices, some small norms and biases.
    const SIZES: [u64; 8] = [
        64 << 20,
        48 << 20,
        24 << 20,
        8 << 20,
        3 << 20,
        256 << 10,
        16 << 10,
        4 << 10,
    ];
    let backend = Arc::clone(alloc.pool().backend());
    let mut weights = Vec::new();
    let mut left = total;
    // Seeded as the tensors of one more request after the last one.
    let model = w.request_seed(u64::from(w.requests));
    for (t, size) in (0u64..).zip(SIZES.iter().cycle()) {
        if left == 0 {
            break;
        }
        let len = (*size).min(left);
        let ptr = alloc.allocate_tagged(len, S, WEIGHTS)?;
        let seed = tensor_seed(model, t);
        backend.write(ptr, &pattern_bytes(seed, 0, len))?;
        weights.push((ptr, len, seed));
        left -= len;
    }
    Ok(weights)
}

fn verify_weights(backend: &dyn Backend, weights: &Weights, checks: &mut Checks) -> Result<()> {
    for &(ptr, len, seed) in weights {
        let mut buf = vec![0u8; len as usize];
        backend.read(ptr, &mut buf)?;
        checks.check(&buf, seed, 0);
    }
    Ok(())
}

/// Per-step activations: logits for the batch, a workspace, and small temporaries.
fn step_activations(
    alloc: &CachingAllocator,
    batch: u64,
    rng: &mut SmallRng,
) -> Result<Vec<(DevicePtr, u64, u64)>> {
    let mut sizes = vec![
        batch.max(1) * 32_000 * 2,
        rng.random_range(256u64 << 10..=8 << 20),
    ];
    sizes.extend((0..batch.min(16)).map(|_| rng.random_range(512u64..=16 << 10)));
    let mut out = Vec::with_capacity(sizes.len());
    for size in sizes {
        match alloc.allocate_tagged(size, S, ACTIVATIONS) {
            Ok(ptr) => out.push((ptr, size, rng.random())),
            Err(e) if e.is_out_of_memory() => break, // fewer activations this step
            Err(e) => {
                for (ptr, _, _) in out {
                    alloc.deallocate(ptr, S)?;
                }
                return Err(e);
            }
        }
    }
    let backend = alloc.pool().backend();
    for &(ptr, size, seed) in &out {
        backend.write(ptr, &pattern_bytes(seed, 0, size.min(4096)))?;
    }
    Ok(out)
}

fn check_activations(
    backend: &dyn Backend,
    alloc: &CachingAllocator,
    activations: Vec<(DevicePtr, u64, u64)>,
    checks: &mut Checks,
) -> Result<()> {
    for (ptr, size, seed) in activations {
        let mut head = vec![0u8; size.min(4096) as usize];
        backend.read(ptr, &mut head)?;
        checks.check(&head, seed, 0);
        alloc.deallocate(ptr, S)?;
    }
    Ok(())
}

/// Knuth's Poisson sampler (small means).
fn poisson(rng: &mut SmallRng, mean: f64) -> u32 {
    let limit = (-mean).exp();
    let mut product = rng.random::<f64>();
    let mut k = 0;
    while product > limit && k < 1000 {
        product *= rng.random::<f64>();
        k += 1;
    }
    k
}
