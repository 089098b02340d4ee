//! The invariant checker (residency table against slot tables), run after every step in tests.

use std::collections::HashSet;

use strata_vmm::{Error, Result};

use super::demote::SlotOf;
use super::slots::Slots;
use super::TierStore;
use crate::object::{Durability, Residency};

impl TierStore {
    /// Checks the residency table against the slot tables; run after every step in tests.
    /// With operations in flight (inside their unlocked sections), the objects they pin and the
    /// slots those own are between two states and are passed over; everything else is checked.
    pub fn check_invariants(&self) -> Result<()> {
        let st = self.lock();
        let busy = |i: u32| st.ops_in_flight > 0 && st.objs[i as usize].pinned_by.is_some();
        let bad = |m: String| Err(Error::InvalidState(format!("tier invariant: {m}")));
        let tiers: [(&str, &Slots, SlotOf); 3] = [
            ("hbm", &st.hbm, |r| r.hbm),
            ("host", &st.host, |r| r.host),
            ("disk", &st.disk, |r| r.disk),
        ];
        for (name, slots, get) in tiers {
            let mut seen = HashSet::new();
            for &f in &slots.free {
                if !seen.insert(f) {
                    return bad(format!("{name} slot {f} twice on the free list"));
                }
                if slots.owner[f as usize].is_some() || slots.retired[f as usize] {
                    return bad(format!("{name} slot {f} free but owned or retired"));
                }
            }
            for (s, owner) in slots.owner.iter().enumerate() {
                match owner {
                    Some(i) if busy(*i) => {}
                    Some(i) => {
                        let o = &st.objs[*i as usize];
                        if !o.live || get(&o.res) != Some(s as u32) {
                            return bad(format!("{name} slot {s} owned by {i}, which disagrees"));
                        }
                        if slots.retired[s] {
                            return bad(format!("{name} slot {s} retired but owned"));
                        }
                    }
                    None => {
                        if !slots.retired[s] && !seen.contains(&(s as u32)) {
                            return bad(format!("{name} slot {s} neither owned nor free"));
                        }
                    }
                }
            }
            for (i, o) in st.objs.iter().enumerate() {
                if busy(i as u32) {
                    continue;
                }
                if let Some(s) = get(&o.res) {
                    if !o.live || slots.owner.get(s as usize) != Some(&Some(i as u32)) {
                        return bad(format!("object {i} claims {name} slot {s}"));
                    }
                }
            }
        }
        for (i, o) in st.objs.iter().enumerate() {
            if busy(i as u32) {
                continue;
            }
            if o.pinned_by.is_some() {
                return bad(format!("object {i} pinned with no operation in flight"));
            }
            if !o.live {
                if o.res != Residency::default() {
                    return bad(format!("dead object {i} holds copies"));
                }
                continue;
            }
            if o.lost {
                if o.res != Residency::default() || o.redundant {
                    return bad(format!("lost object {i} holds copies or is redundant"));
                }
                continue;
            }
            if o.res.fastest().is_none() {
                return bad(format!("live object {i} has no copy"));
            }
            if o.durability == Durability::Backed && o.res.host.is_none() && o.res.disk.is_none() {
                return bad(format!("backed object {i} lacks its authoritative copy"));
            }
        }
        for (p, page) in st.pages.iter().enumerate() {
            if page.is_none() {
                let spp = self.slots_per_page as usize;
                if (p * spp..(p + 1) * spp).any(|s| !st.hbm.retired[s]) {
                    return bad(format!("revoked page {p} has live slots"));
                }
            }
        }
        Ok(())
    }
}
