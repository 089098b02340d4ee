//! The parameter registry: each model's layers as strata pages, and the remap itself.
//!
//! A model gets one [`Reservation`] of `(n + 2) × layer_bytes`: layer `l` lives at
//! `base + l × layer_bytes`, and the two slot ranges after the last layer hold streamed layers.
//! A resident layer has its own pool pages mapped at its VA; its authoritative copy is a
//! [`HostBuffer`] filled at registration. [`ParamRegistry::apply`] moves a model to a
//! [`LayerPlan`]: the pages of newly streamed layers are unmapped from the parameter VA; `β` of
//! them back the slots and the rest leave this pool's accounting and are adopted by the KV pool as
//! `PageSource::Reclaimed { owner }` (the same physical pages: no copy); layers that stop
//! streaming take pages (from the freed ones, else from the KV pool), are mapped back at their
//! parameter VA and reloaded from the host copy.
//!
//! Streamed layers run from a slot (`slots.rs`): [`ParamRegistry::prepare_layer`] queues the host →
//! slot copy on the transfer engine's host→device stream after the slot's previous occupant
//! reported its compute done ([`ParamRegistry::layer_done`]), and returns the event the compute
//! stream waits on before the layer's kernels; [`ParamRegistry::prepare_next`] queues the next
//! streamed layer's copy ahead, while the current one computes; [`ParamRegistry::layer_ptr`] says
//! where the layer's parameters are.

mod slots;

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_allocator::{MappedRun, Page, PageLease, PagePool, PageSource};
use strata_vmm::{
    Access, Backend, CopyScope, DevicePtr, Error, Event, HostBuffer, Location, PhysHandle,
    Reservation, Result,
};

use super::controller::ModelId;
use super::plan::LayerPlan;
use crate::transfer::{Direction, Submission, TransferEngine};
use slots::Slot;
pub use slots::StreamStats;

/// Pool pages mapped back to back at one VA range; unmapped and given back on drop.
type Backing = MappedRun;

struct Layer {
    va: DevicePtr,
    /// `None`: streamed through the slots.
    backing: Option<Backing>,
    host: HostBuffer,
}

struct ModelParams {
    reservation: Arc<Reservation>,
    layer_bytes: u64,
    layers: Vec<Layer>,
    slots: Vec<Slot>,
    plan: LayerPlan,
    stats: StreamStats,
}

/// What [`ParamRegistry::apply`] moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Pages handed to the KV pool (reclaimed).
    pub to_kv: usize,
    /// Pages taken back from the KV pool (reversion).
    pub from_kv: usize,
    /// Layers reloaded from host to their parameter VA.
    pub reloaded: usize,
}

/// Model parameters by model and layer, on pages of one device's [`PagePool`].
pub struct ParamRegistry {
    backend: Arc<dyn Backend>,
    pool: Arc<PagePool>,
    page: u64,
    /// By [`ModelId`]; `None` once unregistered (ids are never reused).
    models: Vec<Option<ModelParams>>,
    tick: u64,
}

impl std::fmt::Debug for ParamRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamRegistry")
            .field("models", &self.models.len())
            .finish_non_exhaustive()
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

impl ParamRegistry {
    /// A registry whose parameter pages come from `pool`.
    pub fn new(pool: Arc<PagePool>) -> Self {
        ParamRegistry {
            backend: Arc::clone(pool.backend()),
            page: pool.page_size(),
            pool,
            models: Vec::new(),
            tick: 0,
        }
    }

    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    fn grants(&self) -> [(Location, Access); 1] {
        [(Location::Device(self.pool.device()), Access::ReadWrite)]
    }

    /// Pages one layer of `model` occupies.
    pub fn pages_per_layer(&self, model: ModelId) -> Result<usize> {
        Ok((self.get(model)?.layer_bytes / self.page) as usize)
    }

    fn get(&self, model: ModelId) -> Result<&ModelParams> {
        self.models
            .get(model.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| invalid(format!("unknown model {}", model.0)))
    }

    fn get_mut(&mut self, model: ModelId) -> Result<&mut ModelParams> {
        self.models
            .get_mut(model.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| invalid(format!("unknown model {}", model.0)))
    }

    /// Maps `pages` (counted in use by this registry's pool) at `va`, read-write for the
    /// device; on an error they are unmapped and given back to the pool.
    fn map_backing(
        &self,
        reservation: &Arc<Reservation>,
        va: DevicePtr,
        pages: Vec<Page>,
    ) -> Result<Backing> {
        let lease = PageLease::from_pages(&self.pool, pages);
        MappedRun::map(lease, reservation, va, &self.grants())
    }

    /// Registers a model of `layers` layers of `layer_bytes` each (rounded up to pages):
    /// `fill(layer, bytes)` writes each layer's authoritative host copy, which is then loaded into
    /// pool pages mapped at the layer's VA with the transfer engine. Returns the model and the
    /// mean measured host → device time of one layer (`T_T`).
    pub fn register(
        &mut self,
        engine: &TransferEngine,
        layers: u32,
        layer_bytes: u64,
        mut fill: impl FnMut(u32, &mut [u8]),
    ) -> Result<(ModelId, Duration)> {
        if layers == 0 || layer_bytes == 0 {
            return Err(invalid("a model needs layers of non-zero size".into()));
        }
        let layer_bytes =
            strata_vmm::round_up(layer_bytes, self.page).ok_or(Error::Overflow("layer size"))?;
        let total = layer_bytes
            .checked_mul(u64::from(layers) + 2)
            .ok_or(Error::Overflow("model reservation"))?;
        let reservation = Arc::new(Reservation::new(&self.backend, total, 0)?);
        let base = reservation.ptr();
        let ppl = (layer_bytes / self.page) as usize;
        let mut out = Vec::with_capacity(layers as usize);
        let mut spent = Duration::ZERO;
        let mut scratch = strata_vmm::try_host_vec(layer_bytes)?;
        for l in 0..layers {
            let host = HostBuffer::new(&self.backend, layer_bytes)?;
            scratch.fill(0);
            fill(l, &mut scratch);
            host.write_at(0, &scratch)?;
            let va = base + u64::from(l) * layer_bytes;
            let backing = MappedRun::take(&self.pool, &reservation, va, ppl, &self.grants())?;
            let start = Instant::now();
            let ev = Self::load(engine, &reservation, &host, va, layer_bytes)?;
            ev.synchronize()?;
            spent += start.elapsed();
            out.push(Layer {
                va,
                backing: Some(backing),
                host,
            });
        }
        let id = ModelId(self.models.len() as u32);
        self.models.push(Some(ModelParams {
            reservation,
            layer_bytes,
            layers: out,
            slots: Vec::new(),
            plan: LayerPlan::resident(layers),
            stats: StreamStats::default(),
        }));
        Ok((id, spent / layers))
    }

    fn load(
        engine: &TransferEngine,
        reservation: &Reservation,
        host: &HostBuffer,
        dst: DevicePtr,
        len: u64,
    ) -> Result<Arc<Event>> {
        engine.submit(
            Direction::HostToDevice,
            &[(host.ptr(), dst)],
            len,
            Submission::Coalesced,
            CopyScope {
                buffers: &[host],
                reservations: &[reservation],
            },
        )
    }

    /// Times one host → device reload of `layer` of `model` (to the layer's own VA when resident,
    /// else to the slot it occupies; the bytes written are the ones already there). Returns `T_T`
    /// as measured now.
    pub fn measure_transfer(
        &self,
        engine: &TransferEngine,
        model: ModelId,
        layer: u32,
    ) -> Result<Duration> {
        let mp = self.get(model)?;
        let l = mp
            .layers
            .get(layer as usize)
            .ok_or_else(|| invalid(format!("no layer {layer}")))?;
        let dst = if l.backing.is_some() {
            l.va
        } else if let Some(s) = mp.slots.iter().find(|s| s.occupant == Some(layer)) {
            s.va
        } else {
            return Err(Error::InvalidState(format!(
                "layer {layer} of model {} is streamed and in no slot",
                model.0
            )));
        };
        let start = Instant::now();
        Self::load(engine, &mp.reservation, &l.host, dst, mp.layer_bytes)?.synchronize()?;
        Ok(start.elapsed())
    }

    /// The plan the registry has applied to `model`.
    pub fn plan(&self, model: ModelId) -> Result<&LayerPlan> {
        Ok(&self.get(model)?.plan)
    }

    /// The reservation holding `model`'s layers and slots (for copy scopes of the caller's kernels).
    pub fn reservation(&self, model: ModelId) -> Result<&Arc<Reservation>> {
        Ok(&self.get(model)?.reservation)
    }

    /// Layers of `model`.
    pub fn layers(&self, model: ModelId) -> Result<u32> {
        Ok(self.get(model)?.layers.len() as u32)
    }

    /// Bytes of one layer (a multiple of the page size).
    pub fn layer_bytes(&self, model: ModelId) -> Result<u64> {
        Ok(self.get(model)?.layer_bytes)
    }

    /// Pages `model` holds on the GPU (resident layers and slots): `(n − α) × pages_per_layer`.
    pub fn gpu_pages(&self, model: ModelId) -> Result<usize> {
        let mp = self.get(model)?;
        let layers: usize = mp
            .layers
            .iter()
            .filter_map(|l| l.backing.as_ref())
            .map(|b| b.len())
            .sum();
        let slots: usize = mp.slots.iter().map(|s| s.backing.len()).sum();
        Ok(layers + slots)
    }

    /// Physical handles behind a resident layer (empty when streamed).
    pub fn layer_handles(&self, model: ModelId, layer: u32) -> Result<Vec<PhysHandle>> {
        let mp = self.get(model)?;
        let l = mp
            .layers
            .get(layer as usize)
            .ok_or_else(|| invalid(format!("no layer {layer}")))?;
        Ok(l.backing
            .as_ref()
            .map(|b| b.pages().iter().map(|p| p.phys().handle()).collect())
            .unwrap_or_default())
    }

    /// Where `layer`'s parameters are now: its own VA when resident, its slot when streamed and
    /// prepared (valid once the prepare event completed); an error when streamed and not loaded.
    pub fn layer_ptr(&self, model: ModelId, layer: u32) -> Result<DevicePtr> {
        let mp = self.get(model)?;
        let l = mp
            .layers
            .get(layer as usize)
            .ok_or_else(|| invalid(format!("no layer {layer}")))?;
        if l.backing.is_some() {
            return Ok(l.va);
        }
        mp.slots
            .iter()
            .find(|s| s.occupant == Some(layer))
            .map(|s| s.va)
            .ok_or_else(|| {
                Error::InvalidState(format!(
                    "layer {layer} of model {} is remapped and not prepared",
                    model.0
                ))
            })
    }

    /// Unregisters `model`: its loads drain, the compute its slots' occupants reported done
    /// completes, then every page it holds (resident layers and slots) is unmapped and given
    /// back to the pool, and its host copies and address range are freed. Pages it gave the KV
    /// pool stay there. Refused with [`Error::InvalidState`], changing nothing, while a slot
    /// holds a layer not reported done ([`layer_done`](Self::layer_done)): kernels may still
    /// read it. The caller has synchronized the compute that reads its resident layers. Returns
    /// the pages given back; the model's id is never valid again, even on an unmap error (the
    /// page concerned is quarantined: never given back as free, never released).
    pub fn unregister(&mut self, engine: &TransferEngine, model: ModelId) -> Result<usize> {
        let mp = self.get(model)?;
        if let Some((i, layer)) = mp.slots.iter().enumerate().find_map(|(i, s)| {
            s.occupant
                .filter(|_| s.claimed && s.done.is_none())
                .map(|l| (i, l))
        }) {
            return Err(Error::InvalidState(format!(
                "model {}: slot {i} holds layer {layer}, not reported done (layer_done)",
                model.0
            )));
        }
        engine.synchronize()?;
        for ev in mp.slots.iter().filter_map(|s| s.done.as_ref()) {
            ev.synchronize()?;
        }
        let Some(mp) = self.models[model.0 as usize].take() else {
            return Err(invalid(format!("unknown model {}", model.0)));
        };
        let backings = mp
            .layers
            .into_iter()
            .filter_map(|l| l.backing)
            .chain(mp.slots.into_iter().map(|s| s.backing));
        let mut pages = Vec::new();
        let mut first_err = None;
        for backing in backings {
            match backing.unmap() {
                Ok(p) => pages.extend(p),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let given = pages.len();
        self.pool.give(pages);
        match first_err {
            Some(e) => Err(e),
            None => Ok(given),
        }
    }

    /// Moves `model` to `plan` (see the module documentation). The caller has synchronized the
    /// compute that may read the model's parameters; in-flight slot loads are drained here.
    /// Pages are taken from `kv_pool` before anything changes (out of memory: nothing changed).
    /// An error after that (a failed map or reload) leaves every layer either resident and
    /// mapped or streamed, hands unused pages to the KV pool, and keeps the previous
    /// [`plan`](Self::plan) on record. Pages taken back keep their source, except that
    /// `Reclaimed` becomes `Fresh` again; a `Borrowed` (peer) page taken back now backs
    /// parameters, so a lender's revocation must go through the KV pool before it reaches them
    /// (not handled here yet).
    pub fn apply(
        &mut self,
        engine: &TransferEngine,
        model: ModelId,
        plan: &LayerPlan,
        kv_pool: &PagePool,
    ) -> Result<Applied> {
        let page = self.page;
        let mp = self.get(model)?;
        let n = mp.layers.len() as u32;
        let ppl = (mp.layer_bytes / page) as usize;
        if plan.layers != n
            || plan.streamed.len() as u32 != plan.m()
            || plan.streamed.windows(2).any(|w| w[0] >= w[1])
            || plan.streamed.iter().any(|&l| l >= n)
        {
            return Err(invalid(format!(
                "plan {plan:?} does not fit model {} of {n} layers",
                model.0
            )));
        }
        if kv_pool.page_size() != page {
            return Err(invalid("kv pool page size differs".into()));
        }
        let to_stream: Vec<u32> = plan
            .streamed
            .iter()
            .copied()
            .filter(|&l| mp.layers[l as usize].backing.is_some())
            .collect();
        let to_resident: Vec<u32> = (0..n)
            .filter(|&l| mp.layers[l as usize].backing.is_none() && !plan.is_streamed(l))
            .collect();
        let beta = plan.beta() as usize;
        let need = (to_resident.len() + beta) * ppl;
        let freeable = (to_stream.len() + mp.slots.len()) * ppl;
        let mut applied = Applied::default();
        let mut spare: Vec<Page> = Vec::new();
        if need > freeable {
            let taken = kv_pool.take(need - freeable)?;
            applied.from_kv = taken.len();
            for p in taken {
                let (phys, source) = kv_pool.detach(p);
                let source = match source {
                    PageSource::Reclaimed { .. } => PageSource::Fresh,
                    other => other,
                };
                spare.push(self.pool.adopt(phys, source)?);
            }
        }
        engine.synchronize()?;
        let result = self.apply_inner(engine, model, plan, &to_stream, &to_resident, &mut spare);
        // Surplus (or, after an error, whatever is left) leaves for the KV pool.
        let owner = model.0;
        let mut given = Vec::with_capacity(spare.len());
        for p in spare {
            let (phys, _) = self.pool.detach(p);
            given.push(kv_pool.adopt(phys, PageSource::Reclaimed { owner })?);
        }
        applied.to_kv = given.len();
        kv_pool.give(given);
        applied.reloaded = result?;
        self.get_mut(model)?.plan = plan.clone();
        Ok(applied)
    }

    fn apply_inner(
        &mut self,
        engine: &TransferEngine,
        model: ModelId,
        plan: &LayerPlan,
        to_stream: &[u32],
        to_resident: &[u32],
        spare: &mut Vec<Page>,
    ) -> Result<usize> {
        let page = self.page;
        // Free: every slot (contents are reloaded on the next prepare) and newly streamed layers.
        let slots = std::mem::take(&mut self.get_mut(model)?.slots);
        for s in slots {
            spare.extend(s.backing.unmap()?);
        }
        for &l in to_stream {
            if let Some(b) = self.get_mut(model)?.layers[l as usize].backing.take() {
                spare.extend(b.unmap()?);
            }
        }
        let reservation = Arc::clone(&self.get(model)?.reservation);
        let layer_bytes = self.get(model)?.layer_bytes;
        let ppl = (layer_bytes / page) as usize;
        let mut events = Vec::new();
        for &l in to_resident {
            let at = spare.len() - ppl;
            let pages = spare.split_off(at);
            let va = self.get(model)?.layers[l as usize].va;
            let backing = self.map_backing(&reservation, va, pages)?;
            let layer = &mut self.get_mut(model)?.layers[l as usize];
            layer.backing = Some(backing);
            events.push(Self::load(
                engine,
                &reservation,
                &layer.host,
                va,
                layer_bytes,
            )?);
        }
        let n = self.get(model)?.layers.len() as u64;
        for s in 0..plan.beta() as u64 {
            let at = spare.len() - ppl;
            let pages = spare.split_off(at);
            let va = reservation.ptr() + (n + s) * layer_bytes;
            let backing = self.map_backing(&reservation, va, pages)?;
            self.get_mut(model)?.slots.push(Slot::empty(va, backing));
        }
        for ev in &events {
            ev.synchronize()?;
        }
        Ok(to_resident.len())
    }
}
