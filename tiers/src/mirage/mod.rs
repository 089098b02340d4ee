//! MIRAGE (Li et al., 2025): KV cache capacity from parameter remapping.
//!
//! - [`plan`]: the equations, pure — `T_T · N ≤ T_compute` (§5.3), uniform-interval layer
//!   selection over the layer ring (§5.4, Eq. 1–3), `m = α + 1` (Eq. 4) or `m = α + 2` (Eq. 5).
//! - [`controller`]: the Remapping Controller (§5, Algorithm 1), pure: which model (inactive,
//!   lowest priority, MRU by default, up to a cap), when to remap and when to revert. A
//!   discrete-event simulator drives it with a virtual clock.
//! - [`registry`]: parameters by model and layer on strata pages (a reservation per model, pool
//!   pages mapped per layer, host copies); the remap as VMM operations (unmap from the parameter
//!   VA, adopt into the KV pool as `PageSource::Reclaimed`); slots and `prepare_layer` events.
//! - [`Mirage`]: the three together with the transfer engine and the KV pool.

pub mod controller;
pub mod plan;
pub mod registry;

use std::sync::Arc;
use std::time::Duration;

use strata_allocator::PagePool;
use strata_vmm::{DevicePtr, Event, Location, Result};

pub use controller::{Decision, KvPressure, ModelId, ModelSpec, RemapController};
pub use plan::{Buffering, LayerPlan};
pub use registry::{Applied, ParamRegistry, StreamStats};

use crate::transfer::TransferEngine;

/// The Remapping Controller, the parameter registry and the Async Transfer Engine of one device.
pub struct Mirage {
    controller: RemapController,
    registry: ParamRegistry,
    engine: TransferEngine,
    kv_pool: Arc<PagePool>,
}

impl std::fmt::Debug for Mirage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirage")
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl Mirage {
    /// Parameters on `param_pool`'s pages; reclaimed pages go to `kv_pool` (the pool a `KvSpace`
    /// grows from). Both pools are on one device (they may be the same pool).
    pub fn new(param_pool: Arc<PagePool>, kv_pool: Arc<PagePool>) -> Result<Self> {
        if param_pool.device() != kv_pool.device()
            || !Arc::ptr_eq(param_pool.backend(), kv_pool.backend())
            || param_pool.page_size() != kv_pool.page_size()
        {
            return Err(strata_vmm::Error::InvalidArgument(format!(
                "parameter pool (device {}) and KV pool (device {}) must share a device, \
                 backend and page size",
                param_pool.device(),
                kv_pool.device()
            )));
        }
        let engine = TransferEngine::new(param_pool.backend(), param_pool.device())?;
        Ok(Mirage {
            controller: RemapController::new(),
            registry: ParamRegistry::new(param_pool),
            engine,
            kv_pool,
        })
    }

    /// Registers a model (see [`ParamRegistry::register`]) with a remapping `cap`; the measured
    /// reload time of its layers becomes the controller's `T_T` (the largest seen so far).
    pub fn register_model(
        &mut self,
        layers: u32,
        layer_bytes: u64,
        cap: u32,
        fill: impl FnMut(u32, &mut [u8]),
    ) -> Result<ModelId> {
        let (id, t_t) = self
            .registry
            .register(&self.engine, layers, layer_bytes, fill)?;
        let pages_per_layer = self.registry.pages_per_layer(id)?;
        let cid = self.controller.add_model(ModelSpec {
            layers,
            pages_per_layer,
            cap,
        });
        debug_assert_eq!(cid, id);
        let t_t = self.controller.transfer_time().map_or(t_t, |t| t.max(t_t));
        self.controller.set_transfer_time(t_t);
        Ok(id)
    }

    /// Unregisters a model (see [`ParamRegistry::unregister`]); refused with
    /// [`Error::InvalidState`](strata_vmm::Error::InvalidState), changing nothing, while it is
    /// active (serving) or a slot holds a layer not reported done. Returns the pages given back
    /// to the parameter pool.
    pub fn unregister_model(&mut self, model: ModelId) -> Result<usize> {
        self.registry.layers(model)?;
        if self.controller.is_active(model) {
            return Err(strata_vmm::Error::InvalidState(format!(
                "model {} is active (serving): mark it idle before unregistering it",
                model.0
            )));
        }
        let given = self.registry.unregister(&self.engine, model);
        if self.registry.layers(model).is_err() {
            self.controller.remove_model(model);
        }
        given
    }

    pub fn controller(&self) -> &RemapController {
        &self.controller
    }

    /// For the scheduler's reports: activity, priorities, `T_c`, prefill times, `T_T` overrides.
    pub fn controller_mut(&mut self) -> &mut RemapController {
        &mut self.controller
    }

    pub fn registry(&self) -> &ParamRegistry {
        &self.registry
    }

    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    pub fn kv_pool(&self) -> &Arc<PagePool> {
        &self.kv_pool
    }

    /// KV pressure as the pool sees it, with `pages_short` pages the KV cache could not get:
    /// the pages it could hand out count its free list and what the device still has room for,
    /// since the pool trims free pages above its high watermark back to the driver (counting
    /// the free list alone, a reversion could wait forever for pages that were released).
    pub fn pressure(&self, pages_short: usize) -> KvPressure {
        KvPressure {
            pages_short,
            available_pages: self.available_pages(),
        }
    }

    /// Pages the KV pool could hand out now: its free pages plus what its limit and the
    /// device's free memory still allow creating (an estimate: other users of the device may
    /// take that memory first, and pages being created are not counted against the limit).
    pub fn available_pages(&self) -> usize {
        let s = self.kv_pool.stats();
        let under_limit = s
            .limit
            .map(|l| l.saturating_sub(s.held_bytes()) / s.page_size);
        let on_device = match self.kv_pool.location() {
            Location::Device(d) => self
                .engine
                .backend()
                .mem_info(d)
                .ok()
                .map(|m| m.free / s.page_size),
            Location::Host => None,
        };
        let creatable = match (under_limit, on_device) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(u64::MAX),
        };
        s.free
            .saturating_add(usize::try_from(creatable).unwrap_or(usize::MAX))
    }

    /// Re-measures `T_T` by reloading `layer` of `model` and hands it to the controller.
    pub fn measure_transfer(&mut self, model: ModelId, layer: u32) -> Result<Duration> {
        let t = self.registry.measure_transfer(&self.engine, model, layer)?;
        self.controller.set_transfer_time(t);
        Ok(t)
    }

    /// One scheduler step: the controller decides, the registry applies each decision (pages to
    /// or from the KV pool). The caller synchronized the compute that reads the models' streamed
    /// layers. A decision that fails to apply is rolled back in the controller and its error
    /// returned after the decisions before it took effect.
    pub fn step(&mut self, kv: KvPressure) -> Result<Vec<Decision>> {
        let decisions = self.controller.step(kv);
        self.apply(decisions)
    }

    /// Dynamic reversion of everything (Algorithm 1 line 12).
    pub fn revert_all(&mut self) -> Result<Vec<Decision>> {
        let decisions = self.controller.revert_all();
        self.apply(decisions)
    }

    fn apply(&mut self, decisions: Vec<Decision>) -> Result<Vec<Decision>> {
        for (i, d) in decisions.iter().enumerate() {
            if let Err(e) = self
                .registry
                .apply(&self.engine, d.model, &d.plan, &self.kv_pool)
            {
                for later in &decisions[i..] {
                    let actual = self.registry.plan(later.model)?.clone();
                    self.controller.set_plan(later.model, actual);
                }
                return Err(e);
            }
        }
        Ok(decisions)
    }

    /// See [`ParamRegistry::prepare_layer`].
    pub fn prepare_layer(&mut self, model: ModelId, layer: u32) -> Result<Arc<Event>> {
        self.registry.prepare_layer(&self.engine, model, layer)
    }

    /// See [`ParamRegistry::prepare_next`].
    pub fn prepare_next(
        &mut self,
        model: ModelId,
        after: u32,
    ) -> Result<Option<(u32, Arc<Event>)>> {
        self.registry.prepare_next(&self.engine, model, after)
    }

    /// See [`ParamRegistry::stream_stats`].
    pub fn stream_stats(&self, model: ModelId) -> Result<StreamStats> {
        self.registry.stream_stats(model)
    }

    /// See [`ParamRegistry::layer_done`].
    pub fn layer_done(&mut self, model: ModelId, layer: u32, done: Arc<Event>) -> Result<()> {
        self.registry.layer_done(model, layer, done)
    }

    /// See [`ParamRegistry::layer_ptr`].
    pub fn layer_ptr(&self, model: ModelId, layer: u32) -> Result<DevicePtr> {
        self.registry.layer_ptr(model, layer)
    }
}
