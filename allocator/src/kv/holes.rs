//! Page-granular residency of active slots: evicting runs of pages (holes) and restoring them
//! (see "Page-granular residency (holes)" in the module documentation).

use std::ops::Range;

use strata_vmm::Result;

use super::{invalid, KvSpace, SlotId};

impl KvSpace {
    /// Checks that `pages` is a non-empty run below the extent of active slot `slot`, every page
    /// of which is a hole (`holes`) or none of which is (`!holes`); returns the slot's index.
    fn check_run(&self, slot: SlotId, pages: &Range<usize>, holes: bool) -> Result<usize> {
        let index = self.active(slot)?;
        let mapped = self.slots[index].mapped;
        if pages.start >= pages.end || pages.end > mapped {
            return Err(invalid(format!(
                "kv pages {pages:?} are not a non-empty run below the slot's extent of {mapped} pages"
            )));
        }
        let set = &self.holes[index];
        if let Some(p) = pages.clone().find(|p| set.contains(p) != holes) {
            let what = if holes { "resident" } else { "already evicted" };
            return Err(invalid(format!(
                "kv page {p} of the run {pages:?} is {what}"
            )));
        }
        Ok(index)
    }

    /// Evicts pages `pages` (a run of resident pages below the extent) of active slot `slot` in
    /// every tensor: unmaps them, gives the pool pages back and, with a zero page, maps it behind
    /// them again (read-only, one `set_access` per tensor). Their bytes are gone: copy them out
    /// first and synchronize the streams that may still touch them. The extent and the tokens do
    /// not change; the pages become holes until [`KvSpace::restore_pages`].
    ///
    /// A run that is empty, reaches past the extent or holds a hole is
    /// [`Error::InvalidArgument`](strata_vmm::Error::InvalidArgument) and changes nothing. A backend error is returned after the
    /// whole run was processed; the pages are holes then too (a page whose unmap failed is
    /// quarantined: never reused, never released).
    pub fn evict_pages(&mut self, slot: SlotId, pages: Range<usize>) -> Result<()> {
        let index = self.check_run(slot, &pages, false)?;
        self.file_owed(index);
        let result = self.unback_slot(index, pages.start, pages.end);
        self.holes[index].extend(pages);
        result.map(drop).map_err(|(_, e)| e)
    }

    /// [`KvSpace::evict_pages`] of the single page `page`.
    pub fn evict_page(&mut self, slot: SlotId, page: usize) -> Result<()> {
        self.evict_pages(slot, page..page + 1)
    }

    /// Restores pages `pages` (a run of holes) of active slot `slot`: maps fresh pool pages at
    /// the same addresses in every tensor (unmapping the zero page first), all taken from the pool
    /// in one call (reclaiming deferred slots once if it is out of memory), with one
    /// read-write `set_access` per tensor over the run. The new pages' bytes are whatever the pool
    /// pages held: copy the saved bytes back with backend copies.
    ///
    /// All or nothing: on any error (out of memory included) the pages stay holes. A run that is
    /// empty, reaches past the extent or holds a resident page is [`Error::InvalidArgument`](strata_vmm::Error::InvalidArgument).
    pub fn restore_pages(&mut self, slot: SlotId, pages: Range<usize>) -> Result<()> {
        let index = self.check_run(slot, &pages, true)?;
        self.back_slot(index, pages.start, pages.end)?;
        for p in pages {
            self.holes[index].remove(&p);
        }
        Ok(())
    }

    /// [`KvSpace::restore_pages`] of the single page `page`.
    pub fn restore_page(&mut self, slot: SlotId, page: usize) -> Result<()> {
        self.restore_pages(slot, page..page + 1)
    }
}
