//! The Remapping Controller (§5, Algorithm 1), pure: no VMM, no clock. The caller (the runtime in
//! [`super::Mirage`], or a discrete-event simulator with a virtual clock) reports model activity,
//! priorities, `T_T` and `T_c`, and each scheduler step's KV pressure; [`RemapController::step`]
//! answers with the new [`LayerPlan`] of every model whose remapping changes.
//!
//! - **When** (§5.1): remap when the KV cache runs out (`pages_short > 0`); revert (dynamic
//!   reversion, §7.6.1) while the pages the KV pool could hand out (free, or still creatable on
//!   the device) cover a whole remapped layer.
//! - **Which model** (§5.2): inactive models first, lowest scheduler priority first; with no
//!   priorities, the most recently activated (MRU) first; each up to its cap; then active models in
//!   the same order. Reversion goes the other way (active models first, highest priority first).
//! - **How many** (§5.3): `α ≤ cap` and `T_T · α ≤ T_compute`, where `T_compute` is the model's
//!   per-token compute `n · T_c` when active and its prefill time (when reported) when inactive.
//! - **Which layers and how many slots** (§5.4): [`plan_for`] (uniform intervals; Eq. 4 / Eq. 5).

use std::time::Duration;

use super::plan::{max_layers_for, plan_for, LayerPlan};

/// A model, as the registry and the controller number it (also the `owner` of
/// `PageSource::Reclaimed` pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(pub u32);

/// What the controller needs to know about a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// `n`: hidden layers.
    pub layers: u32,
    /// Pool pages one layer's parameters occupy.
    pub pages_per_layer: usize,
    /// Most layers that may be remapped (§5.2's threshold against starving the model).
    pub cap: u32,
}

/// KV pressure at one scheduler step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvPressure {
    /// Pages the KV cache needed and could not get (0: not out of KV blocks).
    pub pages_short: usize,
    /// Pages the KV pool could hand out now (candidates for dynamic reversion): free ones, and
    /// the ones its limit and the device's free memory still allow creating
    /// ([`Mirage::available_pages`](super::Mirage::available_pages)).
    pub available_pages: usize,
}

/// One decision: move `model` to `plan` (its `α` went up by remapping or down by reversion).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub model: ModelId,
    /// `α` before.
    pub from_alpha: u32,
    pub plan: LayerPlan,
}

impl Decision {
    /// True when parameter memory goes to the KV cache (α grew).
    pub fn is_remap(&self) -> bool {
        self.plan.alpha > self.from_alpha
    }
}

#[derive(Clone, Debug)]
struct Model {
    spec: ModelSpec,
    active: bool,
    priority: Option<i64>,
    /// Logical time of the last activation (MRU order).
    activated_at: u64,
    t_c: Option<Duration>,
    prefill: Option<Duration>,
    plan: LayerPlan,
    /// Unregistered: never decided on again (ids are not reused).
    removed: bool,
}

/// The controller's state: models, `T_T`, and each model's current [`LayerPlan`].
#[derive(Clone, Debug, Default)]
pub struct RemapController {
    models: Vec<Model>,
    t_t: Option<Duration>,
    tick: u64,
}

impl RemapController {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a model (inactive, no priority, nothing remapped).
    pub fn add_model(&mut self, spec: ModelSpec) -> ModelId {
        let id = ModelId(self.models.len() as u32);
        self.models.push(Model {
            spec,
            active: false,
            priority: None,
            activated_at: 0,
            t_c: None,
            prefill: None,
            plan: LayerPlan::resident(spec.layers),
            removed: false,
        });
        id
    }

    /// Forgets a model (unregistered): it takes part in no decision again, and its id is never
    /// handed out again.
    pub fn remove_model(&mut self, id: ModelId) {
        if let Some(m) = self.model_mut(id) {
            m.removed = true;
            m.active = false;
            m.plan = LayerPlan::resident(m.spec.layers);
        }
    }

    /// Whether `id` is registered and serving.
    pub fn is_active(&self, id: ModelId) -> bool {
        self.model(id).is_some_and(|m| m.active)
    }

    fn model(&self, id: ModelId) -> Option<&Model> {
        self.models.get(id.0 as usize).filter(|m| !m.removed)
    }

    fn model_mut(&mut self, id: ModelId) -> Option<&mut Model> {
        self.models.get_mut(id.0 as usize).filter(|m| !m.removed)
    }

    /// The scheduler (de)activates a model; activation makes it the most recently used.
    pub fn set_active(&mut self, id: ModelId, active: bool) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(m) = self.model_mut(id) {
            if active && !m.active {
                m.activated_at = tick;
            }
            m.active = active;
        }
    }

    /// The scheduler's priority of a model (higher = more important; `None`: unspecified).
    pub fn set_priority(&mut self, id: ModelId, priority: Option<i64>) {
        if let Some(m) = self.model_mut(id) {
            m.priority = priority;
        }
    }

    /// `T_T`: measured time to load one layer host → GPU.
    pub fn set_transfer_time(&mut self, t_t: Duration) {
        self.t_t = Some(t_t);
    }

    pub fn transfer_time(&self) -> Option<Duration> {
        self.t_t
    }

    /// `T_c`: observed compute time of one layer of `id`.
    pub fn report_compute(&mut self, id: ModelId, per_layer: Duration) {
        if let Some(m) = self.model_mut(id) {
            m.t_c = Some(per_layer);
        }
    }

    /// Observed prefill time of `id` (its `T_compute` while inactive, §5.3).
    pub fn report_prefill(&mut self, id: ModelId, prefill: Duration) {
        if let Some(m) = self.model_mut(id) {
            m.prefill = Some(prefill);
        }
    }

    /// The current plan of a model.
    pub fn plan(&self, id: ModelId) -> Option<&LayerPlan> {
        self.model(id).map(|m| &m.plan)
    }

    /// `T_compute` of a model (§5.3), if known.
    pub fn t_compute(&self, id: ModelId) -> Option<Duration> {
        let m = self.model(id)?;
        let token = m.t_c.map(|t| t * m.spec.layers);
        if m.active {
            token
        } else {
            m.prefill.or(token)
        }
    }

    /// Most layers `id` may have remapped now: `min(cap, N)` with `T_T · N ≤ T_compute`
    /// (0 while `T_T` or `T_c` is unknown).
    pub fn limit(&self, id: ModelId) -> u32 {
        let (Some(m), Some(t_t), Some(t_compute)) = (self.model(id), self.t_t, self.t_compute(id))
        else {
            return 0;
        };
        m.spec
            .cap
            .min(max_layers_for(t_t, t_compute))
            .min(m.spec.layers.saturating_sub(1))
    }

    /// Remapping order (§5.2): inactive before active; lower priority first; no priority after
    /// prioritized ones; among equals the most recently activated first (MRU).
    pub fn remap_order(&self) -> Vec<ModelId> {
        let mut ids: Vec<ModelId> = (0..self.models.len() as u32)
            .map(ModelId)
            .filter(|&id| self.model(id).is_some())
            .collect();
        ids.sort_by_key(|&id| {
            let m = &self.models[id.0 as usize];
            (
                m.active,
                m.priority.is_none(),
                m.priority.unwrap_or(0),
                std::cmp::Reverse(m.activated_at),
                id,
            )
        });
        ids
    }

    /// The plan one more remapped layer would give `id`, if allowed (cap, §5.3, Eq. 4/5).
    fn grow_plan(&self, id: ModelId) -> Option<LayerPlan> {
        let m = self.model(id)?;
        let alpha = m.plan.alpha + 1;
        if alpha > self.limit(id) {
            return None;
        }
        plan_for(m.spec.layers, alpha, self.t_t?, m.t_c?, &m.plan.streamed)
    }

    /// Algorithm 1's `Remapping()`: the next model to give up one layer, and its new plan.
    pub fn next_remap(&self) -> Option<(ModelId, LayerPlan)> {
        self.remap_order()
            .into_iter()
            .find_map(|id| self.grow_plan(id).map(|p| (id, p)))
    }

    /// One scheduler step (Algorithm 1): while the KV cache is short, remap one layer at a time
    /// from [`next_remap`](Self::next_remap) until the shortage is covered or nothing is left;
    /// otherwise revert remapped layers while the KV pool's available pages cover them. Returns the changes, one
    /// per model touched, in order; the caller applies them (the runtime maps pages, a simulator
    /// charges time) — the controller already counts them as done.
    pub fn step(&mut self, kv: KvPressure) -> Vec<Decision> {
        let mut decisions: Vec<Decision> = Vec::new();
        let record = |decisions: &mut Vec<Decision>, id: ModelId, from: u32, plan: LayerPlan| {
            if let Some(d) = decisions.iter_mut().find(|d| d.model == id) {
                d.plan = plan;
            } else {
                decisions.push(Decision {
                    model: id,
                    from_alpha: from,
                    plan,
                });
            }
        };
        if kv.pages_short > 0 {
            let mut freed = 0;
            while freed < kv.pages_short {
                let Some((id, plan)) = self.next_remap() else {
                    break;
                };
                let m = &mut self.models[id.0 as usize];
                freed += m.spec.pages_per_layer;
                let from = m.plan.alpha;
                m.plan = plan.clone();
                record(&mut decisions, id, from, plan);
            }
        } else {
            let mut free = kv.available_pages;
            let mut order = self.remap_order();
            order.reverse();
            for id in order {
                while let Some(plan) = self.shrink_plan(id) {
                    let m = &mut self.models[id.0 as usize];
                    // Usually one layer; a full reversion (unknown times) needs all α of them.
                    let need = (m.plan.alpha - plan.alpha) as usize * m.spec.pages_per_layer;
                    if need > free {
                        break;
                    }
                    free -= need;
                    let from = m.plan.alpha;
                    m.plan = plan.clone();
                    record(&mut decisions, id, from, plan);
                }
            }
        }
        decisions
    }

    /// One layer fewer remapped. Fewer layers always fit the budget that held for more, except
    /// that Eq. 4 may now pick `β = 1` where `β = 2` was needed; when `T_T`/`T_c` are unknown the
    /// model reverts fully (the safe direction).
    fn shrink_plan(&self, id: ModelId) -> Option<LayerPlan> {
        let m = self.model(id)?;
        if m.plan.alpha == 0 {
            return None;
        }
        let alpha = m.plan.alpha - 1;
        match (self.t_t, m.t_c) {
            (Some(t_t), Some(t_c)) => plan_for(m.spec.layers, alpha, t_t, t_c, &m.plan.streamed)
                .or(Some(LayerPlan::resident(m.spec.layers))),
            _ => Some(LayerPlan::resident(m.spec.layers)),
        }
    }

    /// Reverts every model at once (Algorithm 1 line 12: all added KV tensors empty).
    pub fn revert_all(&mut self) -> Vec<Decision> {
        let mut out = Vec::new();
        for (i, m) in self.models.iter_mut().enumerate() {
            if m.plan.alpha > 0 {
                let from = m.plan.alpha;
                m.plan = LayerPlan::resident(m.spec.layers);
                out.push(Decision {
                    model: ModelId(i as u32),
                    from_alpha: from,
                    plan: m.plan.clone(),
                });
            }
        }
        out
    }

    /// Undoes a decision the runtime could not apply (the model keeps `plan`).
    pub fn set_plan(&mut self, id: ModelId, plan: LayerPlan) {
        if let Some(m) = self.model_mut(id) {
            m.plan = plan;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    fn spec(layers: u32, cap: u32) -> ModelSpec {
        ModelSpec {
            layers,
            pages_per_layer: 1,
            cap,
        }
    }

    fn controller(n_models: u32, layers: u32, cap: u32) -> (RemapController, Vec<ModelId>) {
        let mut c = RemapController::new();
        let ids: Vec<_> = (0..n_models)
            .map(|_| c.add_model(spec(layers, cap)))
            .collect();
        c.set_transfer_time(ms(1));
        for &id in &ids {
            c.report_compute(id, ms(1));
        }
        (c, ids)
    }

    fn short(pages: usize) -> KvPressure {
        KvPressure {
            pages_short: pages,
            available_pages: 0,
        }
    }

    #[test]
    fn inactive_lowest_priority_first_then_next_then_active() {
        // Figure 7, phase 2: A active, B and C inactive, C lowest priority.
        let (mut c, ids) = controller(3, 8, 2);
        let (a, b, cc) = (ids[0], ids[1], ids[2]);
        c.set_active(a, true);
        c.set_priority(a, Some(10));
        c.set_priority(b, Some(5));
        c.set_priority(cc, Some(1));
        let mut order = Vec::new();
        for _ in 0..6 {
            let d = c.step(short(1));
            assert_eq!(d.len(), 1);
            assert!(d[0].is_remap());
            order.push(d[0].model);
        }
        assert_eq!(order, vec![cc, cc, b, b, a, a]);
        // Every cap reached: nothing more.
        assert!(c.step(short(1)).is_empty());
        for id in ids {
            assert_eq!(c.plan(id).unwrap().alpha, 2);
        }
    }

    #[test]
    fn without_priorities_the_most_recently_activated_goes_first() {
        let (mut c, ids) = controller(3, 8, 1);
        for &id in &[ids[1], ids[0], ids[2]] {
            c.set_active(id, true);
        }
        for &id in &ids {
            c.set_active(id, false);
        }
        // Activated last: ids[2], then ids[0], then ids[1].
        let order: Vec<_> = (0..3).map(|_| c.step(short(1))[0].model).collect();
        assert_eq!(order, vec![ids[2], ids[0], ids[1]]);
    }

    #[test]
    fn transfer_budget_limits_alpha() {
        // T_T = 3 ms, T_c = 1 ms, n = 8 active: T_compute = 8 ms → N ≤ 2.
        let mut c = RemapController::new();
        let id = c.add_model(spec(8, 8));
        c.set_active(id, true);
        c.set_transfer_time(ms(3));
        c.report_compute(id, ms(1));
        assert_eq!(c.limit(id), 2);
        let d = c.step(short(10));
        assert_eq!(d.len(), 1);
        let alpha = d[0].plan.alpha;
        assert!(alpha <= 2);
        let t_t = c.transfer_time().unwrap();
        assert!(t_t * alpha <= c.t_compute(id).unwrap(), "T_T·N ≤ T_compute");
        // Eq. 4 for α = 1: 3×2 = 6 ≤ 1×6 → single slot; α = 2: 9 > 5, Eq. 5: 12 > 8 → no plan:
        // the budget and Eq. 4/5 together stop at α = 1.
        assert_eq!(alpha, 1);
        // A longer prefill lets an inactive model give more (§5.3).
        c.set_active(id, false);
        c.report_prefill(id, ms(30));
        assert_eq!(c.limit(id), 7);
    }

    #[test]
    fn unknown_times_mean_no_remapping() {
        let mut c = RemapController::new();
        let id = c.add_model(spec(8, 4));
        assert!(c.step(short(1)).is_empty());
        c.set_transfer_time(ms(1));
        assert!(c.step(short(1)).is_empty());
        c.report_compute(id, ms(1));
        assert_eq!(c.step(short(1)).len(), 1);
    }

    #[test]
    fn reversion_restores_active_models_first_and_stops_with_available_pages() {
        let (mut c, ids) = controller(2, 8, 2);
        c.set_active(ids[0], true);
        let d = c.step(short(4));
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].model, ids[1], "inactive first");
        // One free page: one layer comes back, from the active model.
        let r = c.step(KvPressure {
            pages_short: 0,
            available_pages: 1,
        });
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].model, ids[0]);
        assert!(!r[0].is_remap());
        assert_eq!(c.plan(ids[0]).unwrap().alpha, 1);
        // Plenty free: everything reverts.
        let r = c.step(KvPressure {
            pages_short: 0,
            available_pages: 100,
        });
        assert_eq!(r.len(), 2);
        assert!(ids.iter().all(|&id| c.plan(id).unwrap().alpha == 0));
        assert!(c.step(KvPressure::default()).is_empty());
    }

    #[test]
    fn every_plan_respects_the_budget_and_eq4_or_eq5() {
        // A grid of T_T, T_c, n, caps and activity: after remapping as far as allowed, each
        // model's α satisfies T_T·α ≤ T_compute and α ≤ cap, its β is the one Eq. 4/5 pick, and
        // its m streamed layers are evenly spaced.
        for t_t_us in [100u64, 700, 1500, 3100, 9000] {
            for t_c_us in [200u64, 1000, 2500] {
                for n in [2u32, 5, 8, 40] {
                    let mut c = RemapController::new();
                    let a = c.add_model(spec(n, n));
                    let b = c.add_model(spec(n, n / 2));
                    c.set_active(a, true);
                    c.set_transfer_time(Duration::from_micros(t_t_us));
                    for id in [a, b] {
                        c.report_compute(id, Duration::from_micros(t_c_us));
                    }
                    c.step(short(usize::MAX));
                    for id in [a, b] {
                        let p = c.plan(id).unwrap().clone();
                        let t_t = Duration::from_micros(t_t_us);
                        let t_c = Duration::from_micros(t_c_us);
                        assert!(t_t * p.alpha <= c.t_compute(id).unwrap(), "{p:?}");
                        assert!(p.alpha <= c.models[id.0 as usize].spec.cap);
                        assert_eq!(
                            p.buffering,
                            super::super::plan::choose_buffering(n, p.alpha, t_t, t_c)
                        );
                        assert_eq!(p.streamed.len() as u32, p.m());
                        if p.m() > 0 {
                            let g = super::super::plan::ring_gaps(n, &p.streamed);
                            assert!(g.iter().max().unwrap() - g.iter().min().unwrap() <= 1);
                        }
                        // Maximal: one more layer is not allowed.
                        assert!(c.grow_plan(id).is_none());
                    }
                }
            }
        }
    }

    #[test]
    fn a_full_reversion_waits_for_all_its_pages() {
        let (mut c, ids) = controller(1, 8, 3);
        c.step(short(3));
        assert_eq!(c.plan(ids[0]).unwrap().alpha, 3);
        // Timings forgotten (a new controller state would have none): shrinking one layer is
        // no longer plannable, so the model reverts fully, which needs all three layers' pages.
        c.t_t = None;
        let free = |available_pages| KvPressure {
            pages_short: 0,
            available_pages,
        };
        assert!(c.step(free(2)).is_empty());
        let r = c.step(free(3));
        assert_eq!((r[0].from_alpha, r[0].plan.alpha), (3, 0));
    }

    #[test]
    fn plans_switch_to_double_buffering_as_alpha_grows() {
        let mut c = RemapController::new();
        let id = c.add_model(spec(40, 39));
        c.set_transfer_time(Duration::from_micros(3100));
        c.report_compute(id, ms(1));
        c.report_prefill(id, ms(1000));
        let mut last = None;
        for _ in 0..9 {
            last = c.step(short(1)).pop();
        }
        let p = last.unwrap().plan;
        assert_eq!(
            (p.alpha, p.m()),
            (9, 11),
            "Eq. 4 fails at α = 9, Eq. 5 holds"
        );
        let gaps = super::super::plan::ring_gaps(40, &p.streamed);
        assert!(gaps.iter().max().unwrap() - gaps.iter().min().unwrap() <= 1);
    }
}
