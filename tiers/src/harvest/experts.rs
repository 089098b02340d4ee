//! The expert residency map (Harvest §4.3): for each MoE expert, whether it lives in local
//! HBM, in peer HBM (a harvested placement), or only in (pinned) host memory. Host memory holds
//! every expert (the authoritative copy), so peer placements are `Backed`: a revocation
//! invalidates the entry and later misses fall back to host memory.

use std::sync::Arc;

use parking_lot::Mutex;
use strata_allocator::{MappedRun, Return};
use strata_vmm::{
    copy_async_in, Access, CopyDesc, CopyKind, CopyScope, DevicePtr, Error, HostBuffer, Location,
    Reservation, Result,
};

use super::config::HarvestHints;
use super::controller::{Endpoint, HarvestController, HarvestHandle};
use crate::object::Durability;

/// Where an expert is served from, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertTier {
    Local,
    Peer,
    Host,
}

#[derive(Clone, Copy, Debug)]
enum Place {
    Local(DevicePtr),
    Peer(HarvestHandle),
    Host,
}

/// Expert residency for one compute device.
pub struct ExpertResidency {
    controller: Arc<HarvestController>,
    device: u32,
    expert_size: u64,
    host: HostBuffer,
    local: Option<Arc<Reservation>>,
    /// The local experts' pool pages, mapped in `local` (released when the map drops).
    _local_run: Option<MappedRun>,
    places: Arc<Mutex<Vec<Place>>>,
    served: Mutex<[u64; 3]>,
}

impl ExpertResidency {
    /// `weights` holds every expert back to back (`expert_size` bytes each, the authoritative
    /// copy); the first `local` experts are copied into local HBM on `device`.
    pub fn new(
        controller: Arc<HarvestController>,
        device: u32,
        expert_size: u64,
        weights: HostBuffer,
        local: usize,
    ) -> Result<Self> {
        if expert_size == 0 || weights.size() % expert_size != 0 {
            return Err(Error::InvalidArgument(format!(
                "{} bytes of weights are not whole {expert_size}-byte experts",
                weights.size()
            )));
        }
        let count = (weights.size() / expert_size) as usize;
        if local > count {
            return Err(Error::InvalidArgument(format!(
                "{local} local of {count} experts"
            )));
        }
        let backend = Arc::clone(controller.backend());
        let page = controller.page_size();
        let mut places = vec![Place::Host; count];
        let (reservation, run) = if local > 0 {
            let bytes = strata_vmm::round_up(local as u64 * expert_size, page)
                .ok_or(Error::Overflow("local experts"))?;
            let reservation = Arc::new(Reservation::new(&backend, bytes, 0)?);
            // On any error below the run drops: unmapped, its pages back with their counters.
            let run = MappedRun::take(
                controller.pool(device)?,
                &reservation,
                reservation.ptr(),
                (bytes / page) as usize,
                &[(Location::Device(device), Access::ReadWrite)],
            )?
            .returning(Return::Release);
            let desc = CopyDesc {
                dst: reservation.ptr(),
                src: weights.ptr(),
                len: local as u64 * expert_size,
            };
            copy_async_in(
                &backend,
                controller.stream(device)?,
                CopyKind::Batch(&[desc]),
                CopyScope {
                    buffers: &[&weights],
                    reservations: &[&reservation],
                },
            )?
            .synchronize()?;
            for (e, place) in places.iter_mut().enumerate().take(local) {
                *place = Place::Local(reservation.ptr() + e as u64 * expert_size);
            }
            (Some(reservation), Some(run))
        } else {
            (None, None)
        };
        Ok(ExpertResidency {
            controller,
            device,
            expert_size,
            host: weights,
            local: reservation,
            _local_run: run,
            places: Arc::new(Mutex::new(places)),
            served: Mutex::new([0; 3]),
        })
    }

    pub fn len(&self) -> usize {
        self.places.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where expert `e` is now.
    pub fn tier(&self, e: usize) -> Option<ExpertTier> {
        self.places.lock().get(e).map(|p| match p {
            Place::Local(_) => ExpertTier::Local,
            Place::Peer(_) => ExpertTier::Peer,
            Place::Host => ExpertTier::Host,
        })
    }

    /// Misses served from local, peer and host memory so far.
    pub fn served(&self) -> [u64; 3] {
        *self.served.lock()
    }

    /// The rebalancer: moves up to `max` host-only experts into harvested peer memory while
    /// peers have room. Returns how many moved. A revocation turns the entry back to `Host`.
    pub fn rebalance(&self, max: usize) -> Result<usize> {
        let host_only: Vec<usize> = self
            .places
            .lock()
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Place::Host))
            .map(|(e, _)| e)
            .take(max)
            .collect();
        let hints = HarvestHints::new(self.device, Durability::Backed);
        let mut moved = 0;
        for e in host_only {
            let handle = match self.controller.harvest_alloc(self.expert_size, &hints) {
                Ok(h) => h,
                Err(err) if err.is_out_of_memory() => break,
                Err(err) => return Err(err),
            };
            let copied = self
                .controller
                .copy_in(
                    &handle,
                    0,
                    Endpoint::Host {
                        buffer: &self.host,
                        offset: e as u64 * self.expert_size,
                    },
                    self.expert_size,
                )
                .and_then(|ev| ev.synchronize());
            if let Err(err) = copied {
                let _ = self.controller.harvest_free(&handle);
                if matches!(err, Error::StaleId { .. }) {
                    continue; // revoked while filling: it stays in host memory
                }
                return Err(err);
            }
            let places = Arc::clone(&self.places);
            // Registered before publishing: a revocation from here on invalidates the entry.
            if self
                .controller
                .harvest_on_revoke(
                    &handle,
                    Box::new(move |r| {
                        let mut places = places.lock();
                        if matches!(places[e], Place::Peer(h) if h == r.handle) {
                            places[e] = Place::Host;
                        }
                    }),
                )
                .is_err()
            {
                continue; // revoked already
            }
            self.places.lock()[e] = Place::Peer(handle);
            if !self.controller.is_live(&handle) {
                self.places.lock()[e] = Place::Host;
                continue;
            }
            moved += 1;
        }
        Ok(moved)
    }

    /// Serves a miss: copies expert `e` to `va` (inside `dst`, mapped for the compute device)
    /// from the fastest tier holding it, and waits. A peer copy refused by a revocation falls
    /// back to host memory. Returns the tier it came from.
    pub fn fetch(&self, e: usize, dst: &Reservation, va: DevicePtr) -> Result<ExpertTier> {
        let place = *self
            .places
            .lock()
            .get(e)
            .ok_or_else(|| Error::InvalidArgument(format!("no expert {e}")))?;
        let backend = self.controller.backend();
        let stream = self.controller.stream(self.device)?;
        let tier = match place {
            Place::Local(src) => {
                let local = self
                    .local
                    .as_deref()
                    .ok_or(Error::InvalidState("no local".into()))?;
                copy_async_in(
                    backend,
                    stream,
                    CopyKind::Batch(&[CopyDesc {
                        dst: va,
                        src,
                        len: self.expert_size,
                    }]),
                    CopyScope {
                        buffers: &[],
                        reservations: &[local, dst],
                    },
                )?
                .synchronize()?;
                ExpertTier::Local
            }
            Place::Peer(h) => {
                let to = Endpoint::Device {
                    reservation: dst,
                    va,
                };
                match self
                    .controller
                    .copy_out(&h, 0, to, self.expert_size)
                    .and_then(|ev| ev.synchronize())
                {
                    Ok(()) => ExpertTier::Peer,
                    Err(Error::StaleId { .. }) => self.serve_from_host(e, dst, va)?,
                    Err(err) => return Err(err),
                }
            }
            Place::Host => self.serve_from_host(e, dst, va)?,
        };
        self.served.lock()[tier as usize] += 1;
        Ok(tier)
    }

    fn serve_from_host(&self, e: usize, dst: &Reservation, va: DevicePtr) -> Result<ExpertTier> {
        copy_async_in(
            self.controller.backend(),
            self.controller.stream(self.device)?,
            CopyKind::Batch(&[CopyDesc {
                dst: va,
                src: self.host.ptr() + e as u64 * self.expert_size,
                len: self.expert_size,
            }]),
            CopyScope {
                buffers: &[&self.host],
                reservations: &[dst],
            },
        )?
        .synchronize()?;
        Ok(ExpertTier::Host)
    }
}

impl Drop for ExpertResidency {
    fn drop(&mut self) {
        let peers: Vec<HarvestHandle> = self
            .places
            .lock()
            .iter()
            .filter_map(|p| match p {
                Place::Peer(h) => Some(*h),
                _ => None,
            })
            .collect();
        for h in peers {
            // Revoked meanwhile: the revocation returned it already.
            let _ = self.controller.harvest_free(&h);
        }
    }
}
