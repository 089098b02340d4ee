//! Pie (seed 004): performance-transparent layer swapping, as pure logic.
//!
//! - [`MappingTable`]: logical layer → GPU slot / CPU slot, with two-phase updates (§3.2):
//!   phase one records the destination and marks the layer in transit; only when the copy is
//!   confirmed does phase two make the destination the layer's home and free the source.
//! - [`FifoSwapper`]: the swapping protocol of §3.3. When layer `k` begins computing: if the
//!   previous swap-in finished (and a GPU slot is free), swap in the hottest CPU layer (the one
//!   accessed soonest); if the previous swap-out finished, swap out the coldest GPU layer (the
//!   last one computed, i.e. accessed furthest in the future), unless every CPU layer is
//!   colder than it. The result is a FIFO queue of layers.
//! - [`AdaptiveExpansion`]: §3.4.2: raise the number of CPU-resident layers `m` while no step
//!   waits on a swap and throughput keeps rising; lower it when computation waits.
//!
//! Layers are `0..n`, computed cyclically (layer 0 of the next token follows layer n−1).

/// Where a layer's data is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Gpu,
    Cpu,
    /// Phase one of a swap-in: a GPU slot is reserved, the data is not there yet.
    SwappingIn,
    /// Phase one of a swap-out: a CPU slot is reserved; the GPU copy is still valid.
    SwappingOut,
}

/// One row of the mapping table (Pie Fig. 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub state: State,
    pub gpu_slot: Option<u32>,
    pub cpu_slot: Option<u32>,
    /// Time (any unit) of the last update.
    pub stamp: u64,
}

/// The layer mapping table.
#[derive(Clone, Debug)]
pub struct MappingTable {
    entries: Vec<Entry>,
    free_gpu: Vec<u32>,
    free_cpu: Vec<u32>,
}

/// A table operation that does not fit the layer's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadTransition {
    pub layer: usize,
    pub state: State,
}

impl MappingTable {
    /// `n` layers; the last `on_cpu` start on the CPU. `gpu_slots` and `cpu_slots` physical
    /// per-layer caches exist on each side.
    pub fn new(n: usize, on_cpu: usize, gpu_slots: usize, cpu_slots: usize) -> Self {
        assert!(on_cpu <= n && n - on_cpu <= gpu_slots && on_cpu <= cpu_slots);
        let mut free_gpu: Vec<u32> = (0..gpu_slots as u32).rev().collect();
        let mut free_cpu: Vec<u32> = (0..cpu_slots as u32).rev().collect();
        let entries = (0..n)
            .map(|l| {
                if l >= n - on_cpu {
                    Entry {
                        state: State::Cpu,
                        gpu_slot: None,
                        cpu_slot: free_cpu.pop(),
                        stamp: 0,
                    }
                } else {
                    Entry {
                        state: State::Gpu,
                        gpu_slot: free_gpu.pop(),
                        cpu_slot: None,
                        stamp: 0,
                    }
                }
            })
            .collect();
        MappingTable {
            entries,
            free_gpu,
            free_cpu,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn entry(&self, layer: usize) -> Entry {
        self.entries[layer]
    }

    /// The layer's data is physically on the GPU (compute may use it).
    pub fn on_gpu(&self, layer: usize) -> bool {
        matches!(self.entries[layer].state, State::Gpu | State::SwappingOut)
    }

    pub fn free_gpu_slots(&self) -> usize {
        self.free_gpu.len()
    }

    pub fn free_cpu_slots(&self) -> usize {
        self.free_cpu.len()
    }

    /// Adds (`delta > 0`) or retires free GPU slots (as many free ones as exist).
    pub fn resize_gpu(&mut self, total: usize) {
        let used = self.entries.iter().filter(|e| e.gpu_slot.is_some()).count();
        let mut all: Vec<u32> = self.entries.iter().filter_map(|e| e.gpu_slot).collect();
        all.sort_unstable();
        let want_free = total.saturating_sub(used);
        let mut next = 0u32;
        self.free_gpu.clear();
        while self.free_gpu.len() < want_free {
            if all.binary_search(&next).is_err() {
                self.free_gpu.push(next);
            }
            next += 1;
        }
        self.free_gpu.reverse();
    }

    fn bad(&self, layer: usize) -> BadTransition {
        BadTransition {
            layer,
            state: self.entries[layer].state,
        }
    }

    /// Phase one of a swap-out: reserve a CPU slot. `None` if no CPU slot is free.
    pub fn begin_swap_out(&mut self, layer: usize, now: u64) -> Result<Option<u32>, BadTransition> {
        if self.entries[layer].state != State::Gpu {
            return Err(self.bad(layer));
        }
        let Some(slot) = self.free_cpu.pop() else {
            return Ok(None);
        };
        let e = &mut self.entries[layer];
        e.cpu_slot = Some(slot);
        e.state = State::SwappingOut;
        e.stamp = now;
        Ok(Some(slot))
    }

    /// Phase two of a swap-out: the copy is confirmed; the GPU slot is freed.
    pub fn complete_swap_out(&mut self, layer: usize, now: u64) -> Result<(), BadTransition> {
        if self.entries[layer].state != State::SwappingOut {
            return Err(self.bad(layer));
        }
        let e = &mut self.entries[layer];
        let g = e.gpu_slot.take();
        e.state = State::Cpu;
        e.stamp = now;
        self.free_gpu.extend(g);
        Ok(())
    }

    /// Phase one of a swap-in: reserve a GPU slot. `None` if no GPU slot is free.
    pub fn begin_swap_in(&mut self, layer: usize, now: u64) -> Result<Option<u32>, BadTransition> {
        if self.entries[layer].state != State::Cpu {
            return Err(self.bad(layer));
        }
        let Some(slot) = self.free_gpu.pop() else {
            return Ok(None);
        };
        let e = &mut self.entries[layer];
        e.gpu_slot = Some(slot);
        e.state = State::SwappingIn;
        e.stamp = now;
        Ok(Some(slot))
    }

    /// Phase two of a swap-in: the data arrived; the CPU slot is freed.
    pub fn complete_swap_in(&mut self, layer: usize, now: u64) -> Result<(), BadTransition> {
        if self.entries[layer].state != State::SwappingIn {
            return Err(self.bad(layer));
        }
        let e = &mut self.entries[layer];
        let c = e.cpu_slot.take();
        e.state = State::Gpu;
        e.stamp = now;
        self.free_cpu.extend(c);
        Ok(())
    }
}

/// What the protocol decided at the start of a layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub swap_in: Option<usize>,
    pub swap_out: Option<usize>,
}

/// The FIFO swapping protocol over a mapping table.
#[derive(Clone, Debug)]
pub struct FifoSwapper {
    pub table: MappingTable,
    swapping_in: Option<usize>,
    swapping_out: Option<usize>,
    /// GPU slots the layers may hold (n − m); lowering it forces swap-outs.
    gpu_budget: usize,
}

impl FifoSwapper {
    /// `n` layers with `m` on the CPU, `buffers` extra slots on each side.
    pub fn new(n: usize, m: usize, buffers: usize) -> Self {
        FifoSwapper {
            table: MappingTable::new(n, m, n, n),
            swapping_in: None,
            swapping_out: None,
            gpu_budget: (n - m + buffers).min(n),
        }
        .with_budget()
    }

    fn with_budget(mut self) -> Self {
        let b = self.gpu_budget;
        self.table.resize_gpu(b);
        self
    }

    /// Steps until `layer` is computed again when `current` is computing (0 for `current`).
    pub fn distance(&self, current: usize, layer: usize) -> usize {
        let n = self.table.len();
        (layer + n - current) % n
    }

    pub fn swapping_in(&self) -> Option<usize> {
        self.swapping_in
    }

    pub fn swapping_out(&self) -> Option<usize> {
        self.swapping_out
    }

    /// Layers whose data lives only on the CPU or is on its way back.
    pub fn cpu_layers(&self) -> usize {
        (0..self.table.len())
            .filter(|&l| matches!(self.table.entry(l).state, State::Cpu | State::SwappingIn))
            .count()
    }

    /// Changes the number of CPU-resident layers to `m` (adaptive expansion).
    pub fn set_cpu_layers(&mut self, m: usize, buffers: usize) {
        let n = self.table.len();
        self.gpu_budget = (n - m.min(n - 1) + buffers).min(n);
        let b = self.gpu_budget;
        self.table.resize_gpu(b);
    }

    fn gpu_held(&self) -> usize {
        (0..self.table.len())
            .filter(|&l| self.table.entry(l).gpu_slot.is_some())
            .count()
    }

    /// The swap-out finished (phase two).
    pub fn swap_out_done(&mut self, now: u64) {
        if let Some(l) = self.swapping_out.take() {
            self.table
                .complete_swap_out(l, now)
                .expect("the swap in flight is in SwappingOut");
        }
    }

    /// The swap-in finished (phase two).
    pub fn swap_in_done(&mut self, now: u64) {
        if let Some(l) = self.swapping_in.take() {
            self.table
                .complete_swap_in(l, now)
                .expect("the swap in flight is in SwappingIn");
        }
    }

    /// Layer `k` begins computing: the protocol of §3.3.
    pub fn on_layer_start(&mut self, k: usize, now: u64) -> Decision {
        let n = self.table.len();
        let mut d = Decision::default();
        // Swap-in: the hottest CPU layer, if the previous swap-in finished and a slot is free.
        if self.swapping_in.is_none() && self.gpu_held() < self.gpu_budget {
            let hottest = (0..n)
                .filter(|&l| self.table.entry(l).state == State::Cpu)
                .min_by_key(|&l| self.distance(k, l));
            if let Some(h) = hottest {
                if self.table.begin_swap_in(h, now).ok().flatten().is_some() {
                    self.swapping_in = Some(h);
                    d.swap_in = Some(h);
                }
            }
        }
        // Swap-out: the coldest GPU layer, unless every CPU layer is colder (or, after the budget
        // grew, the GPU still has room: then only swap-ins run until it is full).
        if self.swapping_out.is_none() {
            let coldest = (0..n)
                .filter(|&l| l != k && self.table.entry(l).state == State::Gpu)
                .max_by_key(|&l| self.distance(k, l));
            if let Some(c) = coldest {
                let dc = self.distance(k, c);
                let cpu: Vec<usize> = (0..n)
                    .filter(|&l| self.table.entry(l).state == State::Cpu)
                    .collect();
                let all_colder = !cpu.is_empty() && cpu.iter().all(|&l| self.distance(k, l) > dc);
                let held = self.gpu_held();
                let over_budget = held > self.gpu_budget;
                if (over_budget || (!all_colder && held >= self.gpu_budget))
                    && (over_budget || !cpu.is_empty() || self.swapping_in.is_some())
                    && self.table.begin_swap_out(c, now).ok().flatten().is_some()
                {
                    self.swapping_out = Some(c);
                    d.swap_out = Some(c);
                }
            }
        }
        d
    }

    /// Layer `k` is needed now but is only on the CPU and nothing brings it: a demand swap-in
    /// (the caller waits for it). False if no GPU slot is free or a swap-in is in flight.
    pub fn demand(&mut self, k: usize, now: u64) -> bool {
        if self.swapping_in.is_some() || self.table.entry(k).state != State::Cpu {
            return false;
        }
        if self.table.begin_swap_in(k, now).ok().flatten().is_some() {
            self.swapping_in = Some(k);
            true
        } else {
            false
        }
    }
}

/// Adaptive expansion (§3.4.2) over the number of CPU-resident layers.
#[derive(Clone, Debug)]
pub struct AdaptiveExpansion {
    m: usize,
    max_m: usize,
    /// The smallest m seen to make computation wait.
    ceiling: usize,
    records: Vec<Option<f64>>,
    /// The interval right after a change is transitional (layers are still moving to match
    /// the new m) and is not judged.
    settling: bool,
    /// Relative throughput drop tolerated before the climb stops: 0 means "keeps rising" is
    /// read as "does not fall" (a one-layer step may add no whole request to the batch).
    pub tolerance: f64,
}

impl AdaptiveExpansion {
    /// Starts with every layer on the GPU (m = 0), as Pie does.
    pub fn new(max_m: usize) -> Self {
        AdaptiveExpansion {
            m: 0,
            max_m,
            ceiling: max_m + 1,
            records: vec![None; max_m + 1],
            settling: false,
            tolerance: 0.0,
        }
    }

    pub fn m(&self) -> usize {
        self.m
    }

    /// One measurement interval at the current m ended: `waited` if any layer's computation
    /// waited on a swap; `throughput` over the interval. Returns the next m.
    pub fn observe(&mut self, waited: bool, throughput: f64) -> usize {
        if std::mem::take(&mut self.settling) {
            return self.m;
        }
        self.records[self.m] = Some(throughput);
        let before = self.m;
        self.decide(waited, throughput);
        self.settling = self.m != before;
        self.m
    }

    fn decide(&mut self, waited: bool, throughput: f64) {
        if waited {
            self.ceiling = self.ceiling.min(self.m);
            self.m = self.m.saturating_sub(1);
            return;
        }
        let rising = match self.m.checked_sub(1).and_then(|p| self.records[p]) {
            Some(prev) => throughput >= prev * (1.0 - self.tolerance),
            None => true,
        };
        if rising && self.m + 1 < self.ceiling && self.m < self.max_m {
            self.m += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_phase_updates() {
        let mut t = MappingTable::new(3, 1, 3, 3);
        assert!(t.on_gpu(0) && !t.on_gpu(2));
        assert_eq!(t.free_gpu_slots(), 1);
        t.begin_swap_out(0, 1).unwrap().unwrap();
        // Still usable while the copy runs; its GPU slot is not free yet.
        assert!(t.on_gpu(0));
        assert_eq!(t.free_gpu_slots(), 1);
        t.begin_swap_in(2, 1).unwrap().unwrap();
        assert!(!t.on_gpu(2), "not usable before the copy is confirmed");
        assert_eq!(t.free_gpu_slots(), 0);
        t.complete_swap_in(2, 2).unwrap();
        t.complete_swap_out(0, 3).unwrap();
        assert!(t.on_gpu(2) && !t.on_gpu(0));
        assert_eq!(t.free_gpu_slots(), 1);
        assert!(t.complete_swap_in(2, 4).is_err());
        assert!(t.begin_swap_in(1, 4).is_err());
    }

    #[test]
    fn figure4_walkthrough() {
        // Nine layers, two on the CPU (layers 8 and 9 in the paper's 1-based numbering),
        // swapping takes two layer computations. No spare buffers beyond n − m.
        let mut s = FifoSwapper::new(9, 2, 0);
        // Layer 1: CPU layers 8 and 9 are colder than every GPU layer: no swap-out; no free
        // slot for a swap-in.
        assert_eq!(s.on_layer_start(0, 0), Decision::default());
        // Layer 2: layer 1 is the coldest: swapped out; still no room to swap in.
        assert_eq!(
            s.on_layer_start(1, 1),
            Decision {
                swap_in: None,
                swap_out: Some(0)
            }
        );
        // Layer 3: the swap-out is in progress: nothing.
        assert_eq!(s.on_layer_start(2, 2), Decision::default());
        // Layer 4: layer 1's swap-out finished: swap out layer 3, swap in layer 8.
        s.swap_out_done(3);
        assert_eq!(
            s.on_layer_start(3, 3),
            Decision {
                swap_in: Some(7),
                swap_out: Some(2)
            }
        );
    }

    #[test]
    fn adaptive_expansion_climbs_then_backs_off() {
        let mut a = AdaptiveExpansion::new(10);
        // Each change is followed by one settling interval that is not judged.
        assert_eq!(a.observe(false, 100.0), 1);
        assert_eq!(a.observe(true, 0.0), 1);
        assert_eq!(a.observe(false, 120.0), 2);
        assert_eq!(a.observe(false, 0.0), 2);
        assert_eq!(a.observe(false, 140.0), 3);
        assert_eq!(a.observe(false, 0.0), 3);
        // m = 3 waits: back to 2, and never above 2 again.
        assert_eq!(a.observe(true, 130.0), 2);
        assert_eq!(a.observe(true, 0.0), 2);
        assert_eq!(a.observe(false, 140.0), 2);
        assert_eq!(a.observe(false, 140.0), 2);
        // Throughput that falls stops the climb.
        let mut b = AdaptiveExpansion::new(10);
        b.observe(false, 100.0);
        b.observe(false, 0.0);
        assert_eq!(b.observe(false, 99.0), 1);
    }
}
