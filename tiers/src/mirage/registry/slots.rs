//! Streamed layers run from `β` slots: [`ParamRegistry::prepare_layer`] (the layer about to run:
//! its event is what the compute waits on), [`ParamRegistry::prepare_next`] (the Async Transfer
//! Engine's look-ahead: the next streamed layer loads while the current one computes) and
//! [`ParamRegistry::layer_done`] (the compute-done event a slot's next load is queued behind).

use std::sync::Arc;

use strata_vmm::{DevicePtr, Error, Event, Result};

use super::{invalid, Backing, ModelParams, ParamRegistry};
use crate::mirage::controller::ModelId;
use crate::transfer::{Direction, TransferEngine};

pub(super) struct Slot {
    pub(super) va: DevicePtr,
    pub(super) backing: Backing,
    /// Layer whose parameters are (being) loaded here.
    pub(super) occupant: Option<u32>,
    /// Completes when the occupant's bytes are in the slot.
    pub(super) loaded: Option<Arc<Event>>,
    /// Recorded after the occupant's kernels (from [`ParamRegistry::layer_done`]).
    pub(super) done: Option<Arc<Event>>,
    /// The occupant was asked for by [`ParamRegistry::prepare_layer`] (kernels may read it until
    /// `done`); false while it was only loaded ahead, when no kernel reads it.
    pub(super) claimed: bool,
    pub(super) last_used: u64,
}

impl Slot {
    pub(super) fn empty(va: DevicePtr, backing: Backing) -> Self {
        Slot {
            va,
            backing,
            occupant: None,
            loaded: None,
            done: None,
            claimed: false,
            last_used: 0,
        }
    }

    /// No kernel can read the occupant any more once `done` (if any) completes.
    fn reusable(&self, ahead: bool) -> bool {
        self.occupant.is_none() || self.done.is_some() || (!ahead && !self.claimed)
    }
}

/// What a model's slots did since registration (see [`ParamRegistry::stream_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// [`prepare_layer`](ParamRegistry::prepare_layer) calls for streamed layers (runs of them).
    pub streamed_runs: u64,
    /// Host → slot loads queued, by either call.
    pub slot_loads: u64,
    /// Of `slot_loads`, queued ahead by [`prepare_next`](ParamRegistry::prepare_next).
    pub loads_ahead: u64,
    /// Runs whose layer a look-ahead had already loaded (or was loading) into a slot.
    pub found_prepared: u64,
    /// Runs whose load had not completed when asked for: the compute waits on a transfer.
    pub load_waits: u64,
}

impl ParamRegistry {
    /// Makes `layer` of `model` ready to run and returns the event its kernels wait on
    /// (`stream_wait_event` on the compute stream). Resident layers: an already complete event.
    /// Streamed layers: the slot already holding it (loaded ahead by
    /// [`prepare_next`](Self::prepare_next), or still there), else a free slot or the least
    /// recently used one whose occupant reported done or was only loaded ahead; the host → slot
    /// copy is queued on the engine's host→device stream behind the previous occupant's
    /// compute-done event, so it never overwrites parameters a kernel still reads. The layer
    /// then counts as running until its [`layer_done`](Self::layer_done). No slot free of
    /// running layers is an [`Error::InvalidState`].
    pub fn prepare_layer(
        &mut self,
        engine: &TransferEngine,
        model: ModelId,
        layer: u32,
    ) -> Result<Arc<Event>> {
        self.tick += 1;
        let tick = self.tick;
        let backend = Arc::clone(&self.backend);
        let mp = self.get_mut(model)?;
        let l = mp
            .layers
            .get(layer as usize)
            .ok_or_else(|| invalid(format!("no layer {layer}")))?;
        if l.backing.is_some() {
            // Never recorded: reports complete.
            return Ok(Arc::new(Event::new(&backend)?));
        }
        mp.stats.streamed_runs += 1;
        let held = mp.slots.iter_mut().find_map(|s| match &s.loaded {
            Some(ev) if s.occupant == Some(layer) => {
                let ev = Arc::clone(ev);
                Some((s, ev))
            }
            _ => None,
        });
        let ev = match held {
            Some((slot, ev)) => {
                if !slot.claimed {
                    mp.stats.found_prepared += 1;
                }
                slot.claimed = true;
                slot.done = None;
                slot.last_used = tick;
                ev
            }
            None => {
                let Some(index) = reusable_slot(&mp.slots, false) else {
                    return Err(Error::InvalidState(format!(
                        "layer {layer} of model {} is streamed but no slot is free: {}",
                        model.0,
                        if mp.slots.is_empty() {
                            "the model has no slot".to_string()
                        } else {
                            "every slot holds a layer not reported done".to_string()
                        }
                    )));
                };
                load_slot(engine, mp, index, layer, tick, true)?
            }
        };
        if !ev.query()? {
            mp.stats.load_waits += 1;
        }
        Ok(ev)
    }

    /// The first streamed layer after `after` in ring order (wrapping to the next token), if any.
    pub fn next_streamed(&self, model: ModelId, after: u32) -> Result<Option<u32>> {
        let plan = &self.get(model)?.plan;
        Ok(plan
            .streamed
            .iter()
            .copied()
            .find(|&l| l > after)
            .or_else(|| plan.streamed.first().copied()))
    }

    /// The Async Transfer Engine's look-ahead: the next streamed layer after `after` (ring
    /// order) with the event of its load, queued now into a slot that is free or whose occupant
    /// reported done (behind that compute), or already in a slot. Nothing waits on the event
    /// until [`prepare_layer`](Self::prepare_layer) asks for the layer. `None` when nothing
    /// streams or no slot can take it yet (with one slot, Eq. 4's case, until the running layer
    /// reports done). Call it again with the layer returned to fill further slots.
    pub fn prepare_next(
        &mut self,
        engine: &TransferEngine,
        model: ModelId,
        after: u32,
    ) -> Result<Option<(u32, Arc<Event>)>> {
        let Some(next) = self.next_streamed(model, after)? else {
            return Ok(None);
        };
        self.tick += 1;
        let tick = self.tick;
        let mp = self.get_mut(model)?;
        if let Some(s) = mp.slots.iter().find(|s| s.occupant == Some(next)) {
            return Ok(s.loaded.clone().map(|ev| (next, ev)));
        }
        let Some(index) = reusable_slot(&mp.slots, true) else {
            return Ok(None);
        };
        mp.stats.loads_ahead += 1;
        load_slot(engine, mp, index, next, tick, false).map(|ev| Some((next, ev)))
    }

    /// The layer's kernels were queued; `done` is recorded after them on the compute stream. Its
    /// slot may be reloaded once `done` completes (a no-op for resident layers). A layer the
    /// model does not have is [`Error::InvalidArgument`].
    pub fn layer_done(&mut self, model: ModelId, layer: u32, done: Arc<Event>) -> Result<()> {
        let mp = self.get_mut(model)?;
        if layer as usize >= mp.layers.len() {
            return Err(invalid(format!(
                "no layer {layer} (the model has {})",
                mp.layers.len()
            )));
        }
        if let Some(s) = mp.slots.iter_mut().find(|s| s.occupant == Some(layer)) {
            s.done = Some(done);
        }
        Ok(())
    }

    /// What `model`'s slots did since registration.
    pub fn stream_stats(&self, model: ModelId) -> Result<StreamStats> {
        Ok(self.get(model)?.stats)
    }
}

/// The slot a load may use: free first, else the least recently used one whose occupant no
/// kernel will read (reported done, or — for a layer about to run, `ahead` false — only
/// loaded ahead: a look-ahead never evicts a layer loaded ahead, which is needed sooner).
fn reusable_slot(slots: &[Slot], ahead: bool) -> Option<usize> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.reusable(ahead))
        .min_by_key(|(_, s)| (s.occupant.is_some(), s.last_used))
        .map(|(i, _)| i)
}

/// Queues the host → slot copy of `layer` into slot `index`, behind its occupant's compute.
fn load_slot(
    engine: &TransferEngine,
    mp: &mut ModelParams,
    index: usize,
    layer: u32,
    tick: u64,
    claimed: bool,
) -> Result<Arc<Event>> {
    let slot = &mp.slots[index];
    if let Some(done) = &slot.done {
        engine.wait(Direction::HostToDevice, done)?;
    }
    let host = &mp.layers[layer as usize].host;
    let ev = ParamRegistry::load(engine, &mp.reservation, host, slot.va, mp.layer_bytes)?;
    mp.stats.slot_loads += 1;
    let slot = &mut mp.slots[index];
    slot.occupant = Some(layer);
    slot.loaded = Some(Arc::clone(&ev));
    slot.done = None;
    slot.claimed = claimed;
    slot.last_used = tick;
    Ok(ev)
}
