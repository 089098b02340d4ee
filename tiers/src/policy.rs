//! Eviction and prefetch policies: pure strategies (keys in, decisions out), chosen per tier.
//!
//! A key is an object's packed id (`ObjectId::key`); an owner is whoever the engine schedules
//! (a request). Policies see no pointers and call no backend.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::time::Duration;

/// An eviction policy for one tier.
pub trait EvictionPolicy: Send {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// `key` (owned by `owner`) was placed in the tier or accessed at step `now`.
    fn touch(&mut self, key: u64, owner: u64, now: u64);
    /// `key` left the tier.
    fn remove(&mut self, key: u64);
    /// The key to evict among those `evictable` accepts, or `None`.
    fn victim(&mut self, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64>;
    /// Steps until `owner` runs as far as the policy knows (`usize::MAX`: not known to run; a
    /// policy without a schedule knows of none).
    fn distance(&self, _owner: u64) -> usize {
        usize::MAX
    }
    /// As [`victim`](Self::victim), among keys whose owner runs no sooner than `distance` steps
    /// from now: a tier making room for an owner at that distance never displaces a block
    /// needed before it (TierKV §3.4). Without a schedule every owner qualifies.
    fn victim_running_after(
        &mut self,
        distance: usize,
        evictable: &mut dyn FnMut(u64) -> bool,
    ) -> Option<u64> {
        let _ = distance;
        self.victim(evictable)
    }
    /// Scheduler lookahead: the owners that run in each of the next K steps (index 0: next).
    fn schedule(&mut self, _next_steps: &[Vec<u64>]) {}
    /// Scheduler queue: owners waiting to be admitted, in admission order. They run after the
    /// [`schedule`](Self::schedule) window, the first one first.
    fn queue(&mut self, _waiting: &[u64]) {}
    /// The engine moved to step `step`.
    fn advance(&mut self, _step: u64) {}
}

/// Which policy a tier uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    Lru,
    Frequency,
    Lookahead,
    /// Full future knowledge: the sequence of `(step, key)` accesses (simulator only).
    Oracle(Vec<(u64, u64)>),
}

impl PolicyKind {
    pub fn build(&self) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Frequency => Box::new(Frequency::default()),
            PolicyKind::Lookahead => Box::new(Lookahead::default()),
            PolicyKind::Oracle(future) => Box::new(Oracle::new(future)),
        }
    }
}

/// Least recently used.
#[derive(Default, Debug)]
pub struct Lru {
    order: BTreeSet<(u64, u64)>,
    last: HashMap<u64, u64>,
    clock: u64,
}

impl Lru {
    fn stamp(&mut self, now: u64) -> u64 {
        // A tie-breaking clock inside a step keeps the order total and deterministic.
        self.clock = self
            .clock
            .max(now.saturating_mul(1 << 20))
            .saturating_add(1);
        self.clock
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn touch(&mut self, key: u64, _owner: u64, now: u64) {
        let t = self.stamp(now);
        if let Some(old) = self.last.insert(key, t) {
            self.order.remove(&(old, key));
        }
        self.order.insert((t, key));
    }
    fn remove(&mut self, key: u64) {
        if let Some(old) = self.last.remove(&key) {
            self.order.remove(&(old, key));
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.order.iter().map(|&(_, k)| k).find(|&k| evictable(k))
    }
}

/// Least frequently used (ties: least recently used).
#[derive(Default, Debug)]
pub struct Frequency {
    order: BTreeSet<(u64, u64, u64)>,
    meta: HashMap<u64, (u64, u64)>,
    clock: u64,
}

impl EvictionPolicy for Frequency {
    fn name(&self) -> &'static str {
        "frequency"
    }
    fn touch(&mut self, key: u64, _owner: u64, now: u64) {
        self.clock = self
            .clock
            .max(now.saturating_mul(1 << 20))
            .saturating_add(1);
        let (count, _) = match self.meta.get(&key) {
            Some(&(c, t)) => {
                self.order.remove(&(c, t, key));
                (c + 1, t)
            }
            None => (1, 0),
        };
        self.meta.insert(key, (count, self.clock));
        self.order.insert((count, self.clock, key));
    }
    fn remove(&mut self, key: u64) {
        if let Some((c, t)) = self.meta.remove(&key) {
            self.order.remove(&(c, t, key));
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.order
            .iter()
            .map(|&(_, _, k)| k)
            .find(|&k| evictable(k))
    }
}

/// Scheduler lookahead (TierKV §3.4): evict the block whose owner has the longest time until
/// its next execution. The scheduler tells the policy which owners run in each of the next K
/// steps ([`EvictionPolicy::schedule`]) and, beyond that window, the order in which waiting
/// owners will be admitted ([`EvictionPolicy::queue`]: FCFS, so the queue's tail runs last).
/// Owners in neither run "never" (furthest). Ties go to the least recently used block.
///
/// Blocks are grouped by owner, so a victim costs O(owners · log owners) plus the blocks
/// `evictable` rejects, not a scan of every block.
#[derive(Default, Debug)]
pub struct Lookahead {
    stamps: Lru,
    owner: HashMap<u64, u64>,
    /// Per owner, its blocks in LRU order: `(stamp, key)`.
    blocks: HashMap<u64, BTreeSet<(u64, u64)>>,
    next_run: HashMap<u64, usize>,
    window: usize,
    queue_rank: HashMap<u64, usize>,
}

impl Lookahead {
    /// Steps until `owner` runs: its step within the window; `K + position` for a waiting
    /// owner; `usize::MAX` for an owner the scheduler did not mention.
    pub fn distance(&self, owner: u64) -> usize {
        if let Some(&d) = self.next_run.get(&owner) {
            return d;
        }
        self.queue_rank
            .get(&owner)
            .map_or(usize::MAX, |&p| self.window.saturating_add(p))
    }

    fn forget(&mut self, key: u64) {
        let Some(o) = self.owner.remove(&key) else {
            return;
        };
        let stamp = self.stamps.last.get(&key).copied();
        if let (Some(set), Some(t)) = (self.blocks.get_mut(&o), stamp) {
            set.remove(&(t, key));
            if set.is_empty() {
                self.blocks.remove(&o);
            }
        }
    }
}

impl EvictionPolicy for Lookahead {
    fn name(&self) -> &'static str {
        "lookahead"
    }
    fn touch(&mut self, key: u64, owner: u64, now: u64) {
        self.forget(key);
        self.stamps.touch(key, owner, now);
        let t = self.stamps.last[&key];
        self.owner.insert(key, owner);
        self.blocks.entry(owner).or_default().insert((t, key));
    }
    fn remove(&mut self, key: u64) {
        self.forget(key);
        self.stamps.remove(key);
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.victim_running_after(0, evictable)
    }
    fn distance(&self, owner: u64) -> usize {
        Lookahead::distance(self, owner)
    }
    fn victim_running_after(
        &mut self,
        distance: usize,
        evictable: &mut dyn FnMut(u64) -> bool,
    ) -> Option<u64> {
        let mut owners: Vec<(usize, u64)> = self
            .blocks
            .keys()
            .map(|&o| (Lookahead::distance(self, o), o))
            .filter(|&(d, _)| d >= distance)
            .collect();
        owners.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for group in owners.chunk_by(|a, b| a.0 == b.0) {
            // Owners at the same distance: their blocks merged in LRU order.
            let mut heads = BinaryHeap::new();
            let mut iters: Vec<_> = group.iter().map(|(_, o)| self.blocks[o].iter()).collect();
            for (i, it) in iters.iter_mut().enumerate() {
                if let Some(&(t, k)) = it.next() {
                    heads.push(Reverse((t, k, i)));
                }
            }
            while let Some(Reverse((_, k, i))) = heads.pop() {
                if evictable(k) {
                    return Some(k);
                }
                if let Some(&(t, k)) = iters[i].next() {
                    heads.push(Reverse((t, k, i)));
                }
            }
        }
        None
    }
    fn schedule(&mut self, next_steps: &[Vec<u64>]) {
        self.next_run.clear();
        self.window = next_steps.len();
        for (i, owners) in next_steps.iter().enumerate() {
            for &o in owners {
                self.next_run.entry(o).or_insert(i);
            }
        }
    }
    fn queue(&mut self, waiting: &[u64]) {
        self.queue_rank.clear();
        for (p, &o) in waiting.iter().enumerate() {
            self.queue_rank.entry(o).or_insert(p);
        }
    }
}

/// Belady's optimal policy for the simulator: knows every future access; evicts the key whose
/// next access is furthest (never accessed again first; ties: the smallest key).
///
/// Present keys are kept ordered by their next use, so a victim costs O(log n) plus the keys
/// `evictable` rejects. A stored next use goes stale once the clock passes it; stale entries
/// (the smallest ones) are refreshed before each decision, once per access at most.
#[derive(Debug, Default)]
pub struct Oracle {
    uses: HashMap<u64, Vec<u64>>,
    now: u64,
    /// `(Reverse(next use as stored), key)`: the furthest next use first.
    order: BTreeSet<(Reverse<u64>, u64)>,
    stored: HashMap<u64, u64>,
}

impl Oracle {
    /// `future`: every `(step, key)` access of the run.
    pub fn new(future: &[(u64, u64)]) -> Self {
        let mut uses: HashMap<u64, Vec<u64>> = HashMap::new();
        for &(step, key) in future {
            uses.entry(key).or_default().push(step);
        }
        for v in uses.values_mut() {
            v.sort_unstable();
            v.dedup();
        }
        Oracle {
            uses,
            ..Oracle::default()
        }
    }

    /// Step of the next access of `key` at or after now (`u64::MAX`: none).
    pub fn next_use(&self, key: u64) -> u64 {
        self.uses
            .get(&key)
            .and_then(|v| v.get(v.partition_point(|&s| s < self.now)).copied())
            .unwrap_or(u64::MAX)
    }

    fn place(&mut self, key: u64) {
        if let Some(old) = self.stored.remove(&key) {
            self.order.remove(&(Reverse(old), key));
        }
        let n = self.next_use(key);
        self.stored.insert(key, n);
        self.order.insert((Reverse(n), key));
    }

    fn refresh(&mut self) {
        while let Some(&(Reverse(n), key)) = self.order.last() {
            if n >= self.now {
                break;
            }
            self.place(key);
        }
    }
}

impl EvictionPolicy for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn touch(&mut self, key: u64, _owner: u64, now: u64) {
        self.now = self.now.max(now);
        self.place(key);
    }
    fn remove(&mut self, key: u64) {
        if let Some(old) = self.stored.remove(&key) {
            self.order.remove(&(Reverse(old), key));
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(u64) -> bool) -> Option<u64> {
        self.refresh();
        self.order.iter().map(|&(_, k)| k).find(|&k| evictable(k))
    }
    fn advance(&mut self, step: u64) {
        self.now = self.now.max(step);
        self.refresh();
    }
}

/// Eq. 2 of TierKV: `T_transfer(T_i → T_j) = ℓ_ij + n_blocks · S_block / BW_ij`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransferTerms {
    /// ℓ_ij: access latency of the link from tier i to tier j.
    pub latency: Duration,
    /// n_blocks: blocks moved together.
    pub n_blocks: u64,
    /// S_block: bytes per block.
    pub block_bytes: u64,
    /// BW_ij: bandwidth available on the link, bytes per second.
    pub bandwidth: f64,
}

impl TransferTerms {
    /// `T_transfer` (Eq. 2). A non-positive bandwidth never completes (`Duration::MAX`).
    pub fn t_transfer(&self) -> Duration {
        if !(self.bandwidth.is_finite() && self.bandwidth > 0.0) {
            return Duration::MAX;
        }
        let secs = (self.n_blocks as f64 * self.block_bytes as f64) / self.bandwidth;
        self.latency
            .saturating_add(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
    }
}

/// Eq. 1 of TierKV: a prefetch succeeds when
/// `T_transfer(T_i → T_0) ≤ Σ_{k=1..K} T_iter^(k) + δ_sched`.
///
/// `t_iter[k-1]` is `T_iter^(k)`, the compute time of the k-th future iteration (so `K =
/// t_iter.len()`, the lookahead window) and `delta_sched` is δ_sched, the scheduling overhead.
pub fn prefetch_fits(t_transfer: Duration, t_iter: &[Duration], delta_sched: Duration) -> bool {
    let window = t_iter
        .iter()
        .fold(Duration::ZERO, |a, &t| a.saturating_add(t))
        .saturating_add(delta_sched);
    t_transfer <= window
}

/// Where a block lives, for the prefetch decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// T0.
    Hbm,
    /// T1.
    Host,
    /// T2.
    Disk,
}

/// A DMA route chosen by [`plan_prefetch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// T1 → T0.
    HostToHbm,
    /// T2 → T1 → T0 (two hops, pipelined through host memory).
    DiskToHostToHbm,
}

/// Link terms of the two links a prefetch uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Links {
    /// T1 → T0: ℓ and BW.
    pub host_to_hbm: (Duration, f64),
    /// T2 → T1: ℓ and BW.
    pub disk_to_host: (Duration, f64),
}

/// Algorithm 1 of TierKV, for one iteration: for each block (of the requests that run in the
/// next K iterations) not in T0, the transfer time of that block (Eq. 2, `n_blocks = 1`; for T2
/// both hops in sequence) is checked against the window (Eq. 1); blocks that fit get a route.
pub fn plan_prefetch(
    blocks: &[(u64, Tier)],
    block_bytes: u64,
    links: Links,
    t_iter: &[Duration],
    delta_sched: Duration,
) -> Vec<(u64, Route)> {
    let hop = |(latency, bandwidth): (Duration, f64)| TransferTerms {
        latency,
        n_blocks: 1,
        block_bytes,
        bandwidth,
    };
    let mut out = Vec::new();
    for &(key, tier) in blocks {
        let (t_xf, route) = match tier {
            Tier::Hbm => continue,
            Tier::Host => (hop(links.host_to_hbm).t_transfer(), Route::HostToHbm),
            Tier::Disk => (
                hop(links.disk_to_host)
                    .t_transfer()
                    .saturating_add(hop(links.host_to_hbm).t_transfer()),
                Route::DiskToHostToHbm,
            ),
        };
        if prefetch_fits(t_xf, t_iter, delta_sched) {
            out.push((key, route));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(_: u64) -> bool {
        true
    }

    #[test]
    fn lru_evicts_the_oldest_evictable() {
        let mut p = Lru::default();
        for k in 1..=3 {
            p.touch(k, 0, k);
        }
        p.touch(1, 0, 4);
        assert_eq!(p.victim(&mut all), Some(2));
        assert_eq!(p.victim(&mut |k| k != 2), Some(3));
        p.remove(2);
        p.remove(3);
        assert_eq!(p.victim(&mut all), Some(1));
    }

    #[test]
    fn frequency_evicts_the_least_used() {
        let mut p = Frequency::default();
        p.touch(1, 0, 0);
        p.touch(1, 0, 1);
        p.touch(2, 0, 2);
        assert_eq!(p.victim(&mut all), Some(2));
        p.touch(2, 0, 3);
        p.touch(2, 0, 4);
        assert_eq!(p.victim(&mut all), Some(1));
    }

    #[test]
    fn lookahead_evicts_the_owner_running_furthest() {
        let mut p = Lookahead::default();
        p.touch(10, 1, 0); // owner 1
        p.touch(20, 2, 1); // owner 2
        p.touch(30, 3, 2); // owner 3
        p.schedule(&[vec![1], vec![3], vec![2]]);
        assert_eq!(p.victim(&mut all), Some(20));
        p.schedule(&[vec![1, 2]]);
        // Owner 3 is not in the window: furthest.
        // Owners 1 and 2 both run next: the least recently used of them goes.
        assert_eq!(p.victim(&mut all), Some(30));
        assert_eq!(p.victim(&mut |k| k != 30), Some(10));
    }

    #[test]
    fn lookahead_evicts_the_queue_tail_before_the_queue_head() {
        let mut p = Lookahead::default();
        p.touch(10, 1, 0); // owner 1 runs next
        p.touch(20, 2, 1); // owner 2: head of the waiting queue
        p.touch(30, 3, 2); // owner 3: behind owner 2
        p.touch(40, 4, 3); // owner 4: unknown to the scheduler
        p.schedule(&[vec![1]]);
        p.queue(&[2, 3]);
        assert_eq!(p.distance(1), 0);
        assert_eq!(p.distance(2), 1);
        assert_eq!(p.distance(3), 2);
        assert_eq!(p.victim(&mut all), Some(40));
        assert_eq!(p.victim(&mut |k| k != 40), Some(30));
        assert_eq!(p.victim(&mut |k| k != 40 && k != 30), Some(20));
        // Plain LRU would have evicted the queue's head (the oldest waiting block) first.
        p.remove(40);
        p.remove(30);
        assert_eq!(p.victim(&mut all), Some(20));
        p.remove(20);
        assert_eq!(p.victim(&mut all), Some(10));
        p.remove(10);
        assert_eq!(p.victim(&mut all), None);
    }

    #[test]
    fn lookahead_makes_room_only_from_owners_that_run_no_sooner() {
        let mut p = Lookahead::default();
        p.touch(10, 1, 0);
        p.touch(20, 2, 1);
        p.touch(30, 3, 2);
        // Unknown owners: every one qualifies, least recently used first.
        assert_eq!(p.victim_running_after(usize::MAX, &mut all), Some(10));
        p.queue(&[1, 2, 3]);
        assert_eq!(EvictionPolicy::distance(&p, 2), 1);
        assert_eq!(p.victim_running_after(1, &mut all), Some(30));
        assert_eq!(p.victim_running_after(1, &mut |k| k != 30), Some(20));
        assert_eq!(p.victim_running_after(3, &mut all), None);
        // An LRU knows no schedule: anything goes.
        let mut lru = Lru::default();
        lru.touch(10, 1, 0);
        assert_eq!(EvictionPolicy::distance(&lru, 1), usize::MAX);
        assert_eq!(lru.victim_running_after(5, &mut all), Some(10));
    }

    #[test]
    fn oracle_is_belady() {
        let future = [(1, 1), (2, 2), (3, 3), (4, 1), (9, 2)];
        let mut p = Oracle::new(&future);
        for k in 1..=3 {
            p.touch(k, 0, k);
        }
        p.advance(4);
        // Next uses: 1 → 4, 2 → 9, 3 → never.
        assert_eq!(p.victim(&mut all), Some(3));
        p.remove(3);
        assert_eq!(p.victim(&mut all), Some(2));
    }

    #[test]
    fn oracle_matches_a_brute_force_belady() {
        // Random accesses; after each step, the victim is the present key with the furthest
        // next use (smallest key on ties), recomputed from scratch.
        let mut x = 12345u64;
        let mut rnd = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let future: Vec<(u64, u64)> = (0..400).map(|i| (i / 4, rnd(30))).collect();
        let mut p = Oracle::new(&future);
        let mut present = BTreeSet::new();
        for &(step, key) in &future {
            p.advance(step);
            p.touch(key, 0, step);
            present.insert(key);
            if present.len() > 10 {
                let brute = present
                    .iter()
                    .copied()
                    .max_by_key(|&k| {
                        let n = future
                            .iter()
                            .filter(|&&(s, kk)| kk == k && s >= step)
                            .map(|&(s, _)| s)
                            .min()
                            .unwrap_or(u64::MAX);
                        (n, Reverse(k))
                    })
                    .unwrap();
                assert_eq!(p.victim(&mut all), Some(brute), "step {step}");
                p.remove(brute);
                present.remove(&brute);
            }
        }
    }

    #[test]
    fn eq1_and_eq2() {
        // 16 blocks of 32 KiB at 50 GB/s with 5 µs latency: 5 µs + 524288 / 50e9 s ≈ 15.5 µs.
        let t = TransferTerms {
            latency: Duration::from_micros(5),
            n_blocks: 16,
            block_bytes: 32 << 10,
            bandwidth: 50e9,
        }
        .t_transfer();
        assert!(t > Duration::from_micros(15) && t < Duration::from_micros(16));
        assert!(prefetch_fits(
            t,
            &[Duration::from_micros(10)],
            Duration::from_micros(6)
        ));
        assert!(!prefetch_fits(
            t,
            &[Duration::from_micros(10)],
            Duration::ZERO
        ));
        assert!(prefetch_fits(
            t,
            &[Duration::from_micros(8); 2],
            Duration::ZERO
        ));
    }

    #[test]
    fn algorithm1_routes_disk_blocks_through_host_when_the_window_allows() {
        let links = Links {
            host_to_hbm: (Duration::from_micros(1), 64e9),
            disk_to_host: (Duration::from_micros(10), 7e9),
        };
        let blocks = [(1, Tier::Hbm), (2, Tier::Host), (3, Tier::Disk)];
        // 2 MiB: host hop ≈ 33.8 µs, disk hop ≈ 309.6 µs.
        let short = plan_prefetch(
            &blocks,
            2 << 20,
            links,
            &[Duration::from_micros(100)],
            Duration::ZERO,
        );
        assert_eq!(short, vec![(2, Route::HostToHbm)]);
        let long = plan_prefetch(
            &blocks,
            2 << 20,
            links,
            &[Duration::from_micros(400)],
            Duration::ZERO,
        );
        assert_eq!(
            long,
            vec![(2, Route::HostToHbm), (3, Route::DiskToHostToHbm)]
        );
    }
}
