//! Unmapping pool pages one mapping each, with the one failure policy: a page whose unmap
//! failed may still be mapped, so it is quarantined, never reused or released.

use strata_vmm::{DevicePtr, Error};

use super::MappedPage;
use crate::pool::{Page, PagePool};

/// What [`unmap_pages`] could not unmap: every address that stays mapped (each page behind one
/// is quarantined) and the first error.
#[derive(Debug)]
pub struct StillMapped {
    /// The mapped addresses, one per quarantined page.
    pub vas: Vec<DevicePtr>,
    /// The first error the driver returned.
    pub first: Error,
}

impl StillMapped {
    /// Adds the addresses to `stuck` (an owner's list of VA never to hand out again) and
    /// returns the first error.
    pub fn into_error(self, stuck: &mut Vec<DevicePtr>) -> Error {
        stuck.extend(self.vas);
        self.first
    }
}

/// Unmaps every page of `mapped` (one mapping each), all of them, appending each unmapped page
/// to `out` (still counted in use by its pool). A page whose unmap failed goes to quarantine in
/// `pool` ([`MappedPage::unmap_or_quarantine`]: its home's counters; never into `out`), its
/// mapping leaked with it, and its address comes back in the [`StillMapped`] error.
pub fn unmap_pages(
    pool: &PagePool,
    mapped: impl IntoIterator<Item = MappedPage>,
    out: &mut Vec<Page>,
) -> Result<(), StillMapped> {
    let mut failed: Option<StillMapped> = None;
    for page in mapped {
        match page.unmap_or_quarantine(pool) {
            Ok(page) => out.push(page),
            Err((va, e)) => match &mut failed {
                Some(f) => f.vas.push(va),
                None => {
                    failed = Some(StillMapped {
                        vas: vec![va],
                        first: e,
                    })
                }
            },
        }
    }
    failed.map_or(Ok(()), Err)
}
