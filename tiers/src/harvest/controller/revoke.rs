//! Revocation in Harvest's order — no new copies → in-flight copies drain → the handle goes
//! stale → callbacks → the pages return — for one placement (policy), for an owner reclaiming
//! bytes, under memory pressure, and when a peer's limits are lowered.

use super::*;

impl HarvestController {
    /// Revokes one placement (a policy eviction), in Harvest's order.
    pub fn revoke(&self, handle: &HarvestHandle) -> Result<()> {
        {
            let mut st = self.state.lock();
            let live = Self::live_mut(&mut st, handle)?;
            if live.revoking {
                return Ok(()); // someone else is revoking it
            }
        }
        self.revoke_all(vec![*handle], RevokeReason::Policy);
        Ok(())
    }

    /// The owner of `peer` wants at least `bytes` back: revokes placements there (best fit:
    /// the smallest one that covers what is still wanted, else the largest) until enough
    /// returned or none is left.
    pub fn reclaim(&self, peer: u32, bytes: u64) -> Result<ReclaimReport> {
        self.reclaim_for(peer, bytes, RevokeReason::Reclaim)
    }

    fn reclaim_for(&self, peer: u32, bytes: u64, reason: RevokeReason) -> Result<ReclaimReport> {
        if peer >= self.backend.device_count() {
            return Err(Error::NoDevice(peer.into()));
        }
        let victims = {
            let st = self.state.lock();
            let mut on_peer: Vec<HarvestHandle> = st
                .slots
                .iter()
                .filter_map(|s| s.live.as_ref())
                .filter(|l| l.handle.device == peer && !l.revoking)
                .map(|l| l.handle)
                .collect();
            let mut victims = Vec::new();
            let mut want = bytes;
            while want > 0 && !on_peer.is_empty() {
                let pick = on_peer
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| h.size >= want)
                    .min_by_key(|(_, h)| h.size)
                    .or_else(|| on_peer.iter().enumerate().max_by_key(|(_, h)| h.size))
                    .map(|(i, _)| i);
                let Some(i) = pick else { break };
                let h = on_peer.swap_remove(i);
                want = want.saturating_sub(h.size);
                victims.push(h);
            }
            victims
        };
        let revoked = self.revoke_all(victims, reason);
        let bytes = revoked.iter().map(|h| h.size).sum();
        Ok(ReclaimReport { revoked, bytes })
    }

    /// Revokes placements on every peer whose free memory fell below its owner's reserve.
    pub fn check_pressure(&self) -> Result<ReclaimReport> {
        let mut report = ReclaimReport::default();
        for d in 0..self.backend.device_count() {
            let (lent, reserve) = {
                let st = self.state.lock();
                (st.lent[d as usize], st.config.limits_of(d).reserve)
            };
            if lent == 0 {
                continue;
            }
            let free = self.device_free(d)?;
            if free < reserve {
                let r = self.reclaim_for(d, reserve - free, RevokeReason::Pressure)?;
                report.revoked.extend(r.revoked);
                report.bytes += r.bytes;
            }
        }
        Ok(report)
    }

    /// Changes what `device`'s owner keeps and lends; lent bytes above the new quota are
    /// reclaimed at once.
    pub fn set_limits(&self, device: u32, limits: PeerLimits) -> Result<ReclaimReport> {
        let over = {
            let mut st = self.state.lock();
            let lent = *st
                .lent
                .get(device as usize)
                .ok_or(Error::NoDevice(device.into()))?;
            let n = st.lent.len();
            if st.config.limits.len() < n {
                st.config.limits.resize(n, PeerLimits::default());
            }
            st.config.limits[device as usize] = limits;
            lent.saturating_sub(limits.quota)
        };
        if over == 0 {
            return Ok(ReclaimReport::default());
        }
        self.reclaim(device, over)
    }

    /// Harvest's order for each victim: stop new copies → drain in-flight copies → invalidate
    /// the placement → callbacks → return the pages. Returns the handles revoked here.
    fn revoke_all(&self, victims: Vec<HarvestHandle>, reason: RevokeReason) -> Vec<HarvestHandle> {
        // 1. Stop new copies (copy_in/copy_out refuse a revoking placement).
        let mut claimed = Vec::new();
        {
            let mut st = self.state.lock();
            for h in victims {
                if let Ok(live) = Self::live_mut(&mut st, &h) {
                    if !live.revoking {
                        live.revoking = true;
                        claimed.push((h, std::mem::take(&mut live.inflight)));
                    }
                }
            }
        }
        let mut done = Vec::new();
        for (h, events) in claimed {
            // 2. Drain: every copy that touched the range completes (a failed copy cannot
            //    touch it any more either; its error is recorded for the next fallible call).
            if let Err(e) = drain(&events) {
                strata_vmm::record_deferred(e);
            }
            // 3. Invalidate: the handle is stale from here on.
            let Some(mut live) = self.invalidate(&h) else {
                continue;
            };
            let notice = Revoked {
                handle: h,
                durability: live.durability,
                reason,
                drained: events.len(),
            };
            {
                let mut st = self.state.lock();
                match live.durability {
                    Durability::Backed => st.stats.revoked_backed += 1,
                    Durability::Lossy => st.stats.revoked_lossy += 1,
                }
            }
            // 4. Call back, no lock held.
            for cb in std::mem::take(&mut live.callbacks) {
                cb(&notice);
            }
            // 5. Return the pages.
            self.give_back(live);
            done.push(h);
        }
        done
    }

    /// Removes a placement from the table (its id goes stale) and uncharges its peer.
    pub(super) fn invalidate(&self, handle: &HarvestHandle) -> Option<Live> {
        let mut st = self.state.lock();
        let index = handle.index();
        let slot = st.slots.get_mut(index as usize)?;
        if slot.generation != handle.generation() {
            return None;
        }
        let live = slot.live.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        st.free_slots.push(index);
        st.lent[live.handle.device as usize] -= live.handle.size;
        st.stats.live -= 1;
        Some(live)
    }

    /// Unmaps a placement and returns its pages (memory goes back to the peer).
    pub(super) fn give_back(&self, live: Live) {
        drop(live.placement);
    }
}
