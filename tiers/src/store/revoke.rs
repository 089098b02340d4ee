//! Revocation of HBM pages, in Harvest's order.

use std::collections::HashSet;
use std::sync::Arc;

use strata_allocator::MappedPage;
use strata_vmm::{Error, Event, Result};

use super::{Revocation, TierStore};
use crate::object::{Notice, ObjectId};

impl TierStore {
    /// Takes HBM pages back (their indices in `0..page_count()`), in Harvest's order: no new
    /// copy starts on them (their slots are retired under the store's lock) → operations at
    /// work on their objects finish, and in-flight copies touching them drain (events, waited
    /// for outside the lock while those objects stay pinned) → residency is invalidated
    /// (objects with a copy in host memory or on disk fall back to it; lossy objects with none
    /// are lost, exactly once) → the owner's callback runs for each → the pages are unmapped
    /// and returned.
    pub fn revoke_pages(&self, pages: &[u32]) -> Result<Revocation> {
        let mut op = self.op();
        let mut set: Vec<u32> = pages.to_vec();
        set.sort_unstable();
        set.dedup();
        let spp = self.slots_per_page;
        for &p in &set {
            let held = op.st.pages.get(p as usize).is_some_and(|x| x.is_some());
            if !held || op.st.hbm.retired[(p * spp) as usize] {
                return Err(Error::InvalidArgument(format!(
                    "HBM page {p} is not held by the store (revoked already, or out of range)"
                )));
            }
        }
        let slots: Vec<u32> = set.iter().flat_map(|&p| p * spp..(p + 1) * spp).collect();
        // 1. No new copies onto them.
        for &s in &slots {
            op.st.hbm.retired[s as usize] = true;
        }
        let retired: HashSet<u32> = slots.iter().copied().collect();
        op.st.hbm.free.retain(|s| !retired.contains(s));
        // 2. Operations on their objects finish; then in-flight copies drain.
        let owners = loop {
            let st = &*op.st;
            let owners: Vec<u32> = slots
                .iter()
                .filter_map(|&s| st.hbm.owner[s as usize])
                .collect();
            if owners
                .iter()
                .all(|&i| st.objs[i as usize].pinned_by.is_none())
            {
                break owners;
            }
            op.wait();
        };
        op.pin(&owners);
        let mut drain: Vec<Arc<Event>> = Vec::new();
        for &s in &slots {
            drain.extend(op.st.hbm.fence[s as usize].clone());
        }
        for &i in &owners {
            drain.extend(op.st.objs[i as usize].hbm_ready.clone());
        }
        op.unlocked(|| drain.iter().try_for_each(|ev| ev.synchronize()))?;
        // 3. Invalidate residency.
        let mut notices = Vec::new();
        let mut out = Revocation::default();
        let st = &mut *op.st;
        for &s in &slots {
            let Some(i) = st.hbm.owner[s as usize].take() else {
                continue;
            };
            st.hbm.fence[s as usize] = None;
            let key = st.key(i);
            st.hbm_policy.remove(key);
            let id = ObjectId::from_key(key);
            let o = &mut st.objs[i as usize];
            o.res.hbm = None;
            o.hbm_ready = None;
            if o.res.host.is_some() || o.res.disk.is_some() {
                notices.push(Notice::FellBack { id, owner: o.owner });
                out.fell_back.push(id);
                st.fell_back += 1;
            } else {
                o.lost = true;
                notices.push(Notice::Lost { id, owner: o.owner });
                out.lost.push(id);
                st.lost += 1;
            }
        }
        let taken: Vec<MappedPage> = set
            .iter()
            .filter_map(|&p| st.pages[p as usize].take())
            .collect();
        st.pages_revoked += taken.len() as u64;
        drop(op);
        // 4. Callbacks (outside the lock: they may call back into the store).
        let cb = self.callback.lock().clone();
        if let Some(cb) = cb {
            for n in notices {
                cb(n);
            }
        }
        // 5. Return the pages (those whose unmap failed are quarantined, never handed on).
        out.pages = super::unmap_or_record(&self.pool, taken);
        Ok(out)
    }
}
