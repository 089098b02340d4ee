//! What the classic and the tiered workload share: the shape of the request stream, its seeding,
//! and the fill-pattern checks every byte read back goes through.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata::{Error, Result};
use strata_kernels::pattern;

/// The requests a workload serves and the KV they write.
#[derive(Clone, Debug)]
pub struct Workload {
    pub device: u32,
    /// Seeds the request stream (arrivals, lengths) and every fill pattern.
    pub seed: u64,
    pub requests: u32,
    /// Prompt length range (tokens, inclusive).
    pub prompt: (u32, u32),
    /// Output length range (tokens, inclusive).
    pub output: (u32, u32),
    /// Layers of the KV space (each with a K and a V tensor).
    pub layers: u32,
    /// Bytes of one token in one layer's K (or V).
    pub bytes_per_token: u64,
}

impl Workload {
    /// Rejects empty ranges and zero counts (the workloads would divide by them or draw from
    /// an empty range).
    pub fn validate(&self) -> Result<()> {
        let bad = |why: &str| Err(Error::InvalidArgument(format!("demo: {why}")));
        if self.prompt.0 == 0
            || self.prompt.0 > self.prompt.1
            || self.output.0 == 0
            || self.output.0 > self.output.1
        {
            return bad("prompt and output ranges must be non-empty and start above zero");
        }
        if self.layers == 0 || self.requests == 0 || self.bytes_per_token == 0 {
            return bad("layers, requests and bytes per token must be positive");
        }
        Ok(())
    }

    /// The random stream of a run.
    pub fn rng(&self) -> SmallRng {
        SmallRng::seed_from_u64(self.seed)
    }

    /// Draws the next request's `(prompt, output)` lengths.
    pub fn lengths(&self, rng: &mut SmallRng) -> (u32, u32) {
        (
            rng.random_range(self.prompt.0..=self.prompt.1),
            rng.random_range(self.output.0..=self.output.1),
        )
    }

    /// The pattern seed of request `id` (the `id`-th admitted).
    pub fn request_seed(&self, id: u64) -> u64 {
        self.seed.wrapping_mul(1_000_003).wrapping_add(id)
    }
}

/// The pattern seed of tensor `tensor` of the request seeded `request_seed`.
pub fn tensor_seed(request_seed: u64, tensor: u64) -> u64 {
    request_seed.wrapping_mul(64).wrapping_add(tensor)
}

/// `len` bytes of the pattern of `seed`, starting at pattern offset `offset`.
pub fn pattern_bytes(seed: u64, offset: u64, len: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len as usize];
    pattern::fill(&mut bytes, seed, offset);
    bytes
}

/// Content checks: units checked, and how many differed from their pattern.
#[derive(Clone, Copy, Debug, Default)]
pub struct Checks {
    pub verified: u64,
    pub mismatches: u64,
}

impl Checks {
    /// Counts one checked unit.
    pub fn record(&mut self, ok: bool) {
        self.verified += 1;
        self.mismatches += u64::from(!ok);
    }

    /// Compares `bytes` with the pattern of `seed` at `offset` and counts the unit.
    pub fn check(&mut self, bytes: &[u8], seed: u64, offset: u64) {
        self.record(matches(bytes, seed, offset));
    }
}

/// True when `bytes` are the pattern of `seed` at `offset`.
pub fn matches(bytes: &[u8], seed: u64, offset: u64) -> bool {
    pattern::first_mismatch(bytes, seed, offset).is_none()
}
