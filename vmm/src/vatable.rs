//! Backend-independent bookkeeping of reservations, mappings and access grants.
//!
//! Both backends keep one [`VaTable`] so that they enforce the [`Backend`](crate::Backend)
//! preconditions identically and report the same typed errors. Everything here is pure: no
//! system or driver calls, no `unsafe`. The usual pattern is *check, act, record*: a backend
//! calls the `check_*` function, performs the driver/OS call, then records the change with the
//! matching mutating function (which re-checks, so it is safe to call alone).

#![deny(unsafe_code)]

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::types::{Access, DevicePtr, Location, PhysHandle};

/// Who performs an access: a specific location, or anyone with any grant (the host backend's
/// default stream may touch memory granted to any device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Accessor {
    /// Needs a grant for exactly this location.
    Location(Location),
    /// Any location's grant suffices.
    Any,
}

/// Access grants of one run of VA: at most one entry per location, sorted, never `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct AccessSet(Vec<(Location, Access)>);

impl AccessSet {
    /// The access granted to `location`.
    pub(crate) fn get(&self, location: Location) -> Access {
        match self.0.binary_search_by_key(&location, |&(l, _)| l) {
            Ok(i) => self.0[i].1,
            Err(_) => Access::None,
        }
    }

    fn set(&mut self, location: Location, access: Access) {
        match (self.0.binary_search_by_key(&location, |&(l, _)| l), access) {
            (Ok(i), Access::None) => {
                self.0.remove(i);
            }
            (Ok(i), a) => self.0[i].1 = a,
            (Err(_), Access::None) => {}
            (Err(i), a) => self.0.insert(i, (location, a)),
        }
    }

    /// The strongest access any location holds.
    pub(crate) fn strongest(&self) -> Access {
        self.0.iter().map(|&(_, a)| a).max().unwrap_or(Access::None)
    }

    /// True when `accessor` may perform an access that needs `need`.
    pub(crate) fn allows(&self, accessor: Accessor, need: Access) -> bool {
        let have = match accessor {
            Accessor::Location(l) => self.get(l),
            Accessor::Any => self.strongest(),
        };
        have >= need
    }
}

/// A run `start..end` of one mapping with uniform grants.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AccessRun {
    start: DevicePtr,
    end: DevicePtr,
    set: AccessSet,
}

/// One mapping: `size` bytes of `handle` from `offset`, at `va`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MapEntry {
    pub(crate) va: DevicePtr,
    pub(crate) size: u64,
    pub(crate) handle: PhysHandle,
    pub(crate) offset: u64,
    /// Runs covering `va..va+size` exactly, in order, adjacent runs differ.
    access: Vec<AccessRun>,
}

impl MapEntry {
    fn end(&self) -> DevicePtr {
        // Cannot overflow: checked when the mapping was inserted.
        self.va + self.size
    }

    /// Grants of the byte at `va` (which must lie inside this mapping).
    #[cfg(test)]
    pub(crate) fn access_at(&self, va: DevicePtr) -> AccessSet {
        self.access
            .iter()
            .find(|r| r.start <= va && va < r.end)
            .map(|r| r.set.clone())
            .unwrap_or_default()
    }

    fn allows(&self, from: DevicePtr, to: DevicePtr, accessor: Accessor, need: Access) -> bool {
        self.access
            .iter()
            .filter(|r| r.start < to && from < r.end)
            .all(|r| r.set.allows(accessor, need))
    }

    fn apply(&mut self, from: DevicePtr, to: DevicePtr, grants: &[(Location, Access)]) {
        let mut out: Vec<AccessRun> = Vec::with_capacity(self.access.len() + 2);
        for run in self.access.drain(..) {
            let lo = run.start.max(from).min(run.end);
            let hi = run.end.min(to).max(lo);
            if run.start < lo {
                out.push(AccessRun {
                    start: run.start,
                    end: lo,
                    set: run.set.clone(),
                });
            }
            if lo < hi {
                let mut set = run.set.clone();
                for &(location, access) in grants {
                    set.set(location, access);
                }
                out.push(AccessRun {
                    start: lo,
                    end: hi,
                    set,
                });
            }
            if hi < run.end {
                out.push(AccessRun {
                    start: hi,
                    end: run.end,
                    set: run.set,
                });
            }
        }
        // Merge adjacent runs with equal grants.
        let mut merged: Vec<AccessRun> = Vec::with_capacity(out.len());
        for run in out {
            match merged.last_mut() {
                Some(last) if last.end == run.start && last.set == run.set => last.end = run.end,
                _ => merged.push(run),
            }
        }
        self.access = merged;
    }
}

/// One piece of a translated device range: `len` bytes of `handle` from `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) handle: PhysHandle,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// Where the bytes of a copy operand live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Translation {
    /// Outside every reservation: plain host memory.
    Host,
    /// Device VA: the physical pieces, in order.
    Device(Vec<Piece>),
}

#[derive(Debug, Default)]
struct Reserved {
    size: u64,
    mappings: BTreeMap<DevicePtr, MapEntry>,
}

impl Reserved {
    /// The mappings that overlap `va..end`, in address order.
    fn mappings_over(&self, va: DevicePtr, end: DevicePtr) -> impl Iterator<Item = &MapEntry> {
        let first = self
            .mappings
            .range(..=va)
            .next_back()
            .filter(|(_, m)| m.end() > va);
        let rest = self.mappings.range(va.saturating_add(1)..end);
        first.into_iter().chain(rest).map(|(_, m)| m)
    }
}

/// All reservations of a backend and the mappings inside them.
#[derive(Debug, Default)]
pub(crate) struct VaTable {
    reservations: BTreeMap<DevicePtr, Reserved>,
    mappings: u64,
}

fn check_nonzero(what: &str, size: u64) -> Result<()> {
    if size == 0 {
        return Err(Error::InvalidArgument(format!("{what} must not be zero")));
    }
    Ok(())
}

fn check_aligned(what: &'static str, value: u64, granularity: u64) -> Result<()> {
    if granularity == 0 {
        return Err(Error::InvalidArgument(
            "granularity must not be zero".into(),
        ));
    }
    if value % granularity != 0 {
        return Err(Error::Misaligned {
            what,
            value,
            granularity,
        });
    }
    Ok(())
}

fn range_end(va: DevicePtr, size: u64, what: &'static str) -> Result<DevicePtr> {
    va.checked_add(size).ok_or(Error::Overflow(what))
}

/// Checks `(va, size)` of a map/unmap/set_access call: non-zero, aligned, no overflow.
fn check_range(va: DevicePtr, size: u64, granularity: u64) -> Result<DevicePtr> {
    check_nonzero("size", size)?;
    check_aligned("address", va, granularity)?;
    check_aligned("size", size, granularity)?;
    range_end(va, size, "address + size")
}

impl VaTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Number of live reservations.
    pub(crate) fn reservation_count(&self) -> u64 {
        self.reservations.len() as u64
    }

    /// Number of live mappings.
    pub(crate) fn mapping_count(&self) -> u64 {
        self.mappings
    }

    /// Every reservation as `(start, size)`.
    pub(crate) fn reservations(&self) -> impl Iterator<Item = (DevicePtr, u64)> + '_ {
        self.reservations.iter().map(|(&s, r)| (s, r.size))
    }

    /// Validates `reserve(size, alignment)`; returns the effective alignment (0 → granularity).
    pub(crate) fn check_reserve(size: u64, alignment: u64, granularity: u64) -> Result<u64> {
        check_nonzero("reservation size", size)?;
        check_aligned("reservation size", size, granularity)?;
        let alignment = if alignment == 0 {
            granularity
        } else {
            alignment
        };
        check_aligned("reservation alignment", alignment, granularity)?;
        size.checked_add(alignment)
            .ok_or(Error::Overflow("reservation size + alignment"))?;
        Ok(alignment)
    }

    /// Records a new reservation the backend obtained.
    pub(crate) fn add_reservation(&mut self, start: DevicePtr, size: u64) -> Result<()> {
        check_nonzero("reservation size", size)?;
        let end = range_end(start, size, "reservation end")?;
        let before = self
            .reservations
            .range(..end)
            .next_back()
            .is_some_and(|(&s, r)| s.saturating_add(r.size) > start);
        if before {
            return Err(Error::InvalidArgument(format!(
                "reservation {start:#x}+{size:#x} overlaps an existing one"
            )));
        }
        self.reservations.insert(
            start,
            Reserved {
                size,
                mappings: BTreeMap::new(),
            },
        );
        Ok(())
    }

    /// Validates `free_va(ptr, size)`: the exact pair `reserve` returned, nothing mapped inside.
    pub(crate) fn check_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let Some(r) = self.reservations.get(&ptr) else {
            return Err(Error::NotReserved { va: ptr, size });
        };
        if r.size != size {
            return Err(Error::InvalidArgument(format!(
                "free_va({ptr:#x}, {size:#x}): the reservation at {ptr:#x} has size {:#x}",
                r.size
            )));
        }
        if !r.mappings.is_empty() {
            return Err(Error::StillMapped { va: ptr, size });
        }
        Ok(())
    }

    /// Forgets a reservation (after [`check_free`](Self::check_free) passed).
    pub(crate) fn remove_reservation(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.check_free(ptr, size)?;
        self.reservations.remove(&ptr);
        Ok(())
    }

    /// The reservation holding all of `va..end`.
    fn reservation_of(&self, va: DevicePtr, end: DevicePtr) -> Option<(DevicePtr, &Reserved)> {
        let (&start, r) = self.reservations.range(..=va).next_back()?;
        let r_end = start.checked_add(r.size)?;
        (va < r_end && end <= r_end).then_some((start, r))
    }

    fn reservation_of_mut(&mut self, va: DevicePtr, end: DevicePtr) -> Option<&mut Reserved> {
        let (&start, r) = self.reservations.range_mut(..=va).next_back()?;
        let r_end = start.checked_add(r.size)?;
        (va < r_end && end <= r_end).then_some(r)
    }

    /// Validates `map(va, size, handle, offset)` for a handle of `handle_size` bytes.
    pub(crate) fn check_map(
        &self,
        va: DevicePtr,
        size: u64,
        offset: u64,
        handle_size: u64,
        granularity: u64,
    ) -> Result<()> {
        let end = check_range(va, size, granularity)?;
        check_aligned("offset", offset, granularity)?;
        if offset != 0 {
            // CUDA 11's documentation: "currently must be zero"; driver 580.159 on an H200
            // answered a non-zero offset with CUDA_ERROR_NOT_SUPPORTED (REFERENCE.md §1.2).
            return Err(Error::Unsupported(format!(
                "map at offset {offset:#x} into a handle: the CUDA driver maps handles from \
                 offset 0 only (CUDA_ERROR_NOT_SUPPORTED)"
            )));
        }
        let phys_end = range_end(offset, size, "offset + size")?;
        if phys_end > handle_size {
            return Err(Error::InvalidArgument(format!(
                "offset {offset:#x} + size {size:#x} exceeds the handle size {handle_size:#x}"
            )));
        }
        let Some((_, r)) = self.reservation_of(va, end) else {
            return Err(Error::NotReserved { va, size });
        };
        let overlapping = r
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(_, m)| m.end() > va);
        if overlapping {
            return Err(Error::AlreadyMapped { va, size });
        }
        Ok(())
    }

    /// Records a mapping (no access yet) after validating it like [`check_map`](Self::check_map).
    pub(crate) fn insert_mapping(
        &mut self,
        va: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
        handle_size: u64,
        granularity: u64,
    ) -> Result<()> {
        self.check_map(va, size, offset, handle_size, granularity)?;
        let end = range_end(va, size, "address + size")?;
        let r = self
            .reservation_of_mut(va, end)
            .ok_or(Error::NotReserved { va, size })?;
        r.mappings.insert(
            va,
            MapEntry {
                va,
                size,
                handle,
                offset,
                access: vec![AccessRun {
                    start: va,
                    end,
                    set: AccessSet::default(),
                }],
            },
        );
        self.mappings += 1;
        Ok(())
    }

    /// Validates `unmap(va, size)`; returns the mappings it would remove, in order.
    pub(crate) fn check_unmap(
        &self,
        va: DevicePtr,
        size: u64,
        granularity: u64,
    ) -> Result<Vec<MapEntry>> {
        let end = check_range(va, size, granularity)?;
        let Some((_, r)) = self.reservation_of(va, end) else {
            return Err(Error::NotReserved { va, size });
        };
        let mut found: Vec<MapEntry> = Vec::new();
        if let Some((_, m)) = r.mappings.range(..va).next_back() {
            if m.end() > va {
                return Err(Error::PartialUnmap { va, size });
            }
        }
        let mut cursor = va;
        let mut holes = false;
        for (_, m) in r.mappings.range(va..end) {
            if m.end() > end {
                return Err(Error::PartialUnmap { va, size });
            }
            if m.va != cursor {
                holes = true;
            }
            cursor = m.end();
            found.push(m.clone());
        }
        if holes || cursor != end || found.is_empty() {
            return Err(Error::NotMapped { va, size });
        }
        Ok(found)
    }

    /// Removes the mappings covering exactly `va..va+size`; returns them.
    pub(crate) fn remove_mappings(
        &mut self,
        va: DevicePtr,
        size: u64,
        granularity: u64,
    ) -> Result<Vec<MapEntry>> {
        let found = self.check_unmap(va, size, granularity)?;
        let end = range_end(va, size, "address + size")?;
        let r = self
            .reservation_of_mut(va, end)
            .ok_or(Error::NotReserved { va, size })?;
        for m in &found {
            r.mappings.remove(&m.va);
        }
        self.mappings = self.mappings.saturating_sub(found.len() as u64);
        Ok(found)
    }

    /// Validates `set_access(va, size, ..)`: the whole range must be mapped (sub-ranges of
    /// mappings are fine).
    pub(crate) fn check_set_access(
        &self,
        va: DevicePtr,
        size: u64,
        grants: &[(Location, Access)],
        granularity: u64,
    ) -> Result<()> {
        let end = check_range(va, size, granularity)?;
        if grants.is_empty() {
            return Err(Error::InvalidArgument(
                "set_access needs at least one grant".into(),
            ));
        }
        let Some((_, r)) = self.reservation_of(va, end) else {
            return Err(Error::NotReserved { va, size });
        };
        let mut cursor = va;
        for m in r.mappings_over(va, end) {
            if m.va > cursor {
                break;
            }
            cursor = m.end();
            if cursor >= end {
                return Ok(());
            }
        }
        Err(Error::NotMapped { va, size })
    }

    /// Host access can be granted only over host memory: the CUDA driver refuses
    /// `CU_MEM_LOCATION_TYPE_HOST_NUMA` grants for allocations of another location type
    /// (`cuMemSetAccess`), and both backends follow it. `location_of` names each mapped
    /// handle's memory. Call after [`check_set_access`](Self::check_set_access).
    pub(crate) fn check_host_grants(
        &self,
        va: DevicePtr,
        size: u64,
        grants: &[(Location, Access)],
        location_of: impl Fn(PhysHandle) -> Option<Location>,
    ) -> Result<()> {
        if !grants.iter().any(|&(l, _)| l == Location::Host) {
            return Ok(());
        }
        let end = range_end(va, size, "address + size")?;
        let Some((_, r)) = self.reservation_of(va, end) else {
            return Err(Error::NotReserved { va, size });
        };
        for m in r.mappings_over(va, end) {
            if location_of(m.handle) != Some(Location::Host) {
                return Err(Error::InvalidArgument(format!(
                    "host access over device memory at {:#x}: only host memory can be granted to the host",
                    m.va
                )));
            }
        }
        Ok(())
    }

    /// Applies `grants` over `va..va+size` (after validating like
    /// [`check_set_access`](Self::check_set_access)). Returns the resulting strongest access of
    /// each run inside the range, as `(va, len, access)` (what a CPU view should be protected to).
    pub(crate) fn set_access(
        &mut self,
        va: DevicePtr,
        size: u64,
        grants: &[(Location, Access)],
        granularity: u64,
    ) -> Result<Vec<(DevicePtr, u64, Access)>> {
        self.check_set_access(va, size, grants, granularity)?;
        let end = range_end(va, size, "address + size")?;
        let r = self
            .reservation_of_mut(va, end)
            .ok_or(Error::NotReserved { va, size })?;
        let first = r
            .mappings
            .range(..=va)
            .next_back()
            .filter(|(_, m)| m.end() > va)
            .map(|(&k, _)| k)
            .unwrap_or(va);
        let mut runs: Vec<(DevicePtr, u64, Access)> = Vec::new();
        for (_, m) in r.mappings.range_mut(first..end) {
            m.apply(va, end, grants);
            for run in m
                .access
                .iter()
                .filter(|run| run.start < end && va < run.end)
            {
                let lo = run.start.max(va);
                let hi = run.end.min(end);
                let strongest = run.set.strongest();
                match runs.last_mut() {
                    Some(last) if last.0 + last.1 == lo && last.2 == strongest => {
                        last.1 += hi - lo;
                    }
                    _ => runs.push((lo, hi - lo, strongest)),
                }
            }
        }
        Ok(runs)
    }

    /// The mapping containing `va`, if any.
    #[cfg(test)]
    pub(crate) fn mapping_at(&self, va: DevicePtr) -> Option<&MapEntry> {
        let (_, r) = self.reservation_of(va, va.checked_add(1)?)?;
        r.mappings
            .range(..=va)
            .next_back()
            .map(|(_, m)| m)
            .filter(|m| m.end() > va)
    }

    /// True when some byte of `va..va+len` lies inside a reservation.
    pub(crate) fn touches_reservation(&self, va: DevicePtr, len: u64) -> bool {
        let end = va.saturating_add(len);
        self.reservations
            .range(..end)
            .next_back()
            .is_some_and(|(&s, r)| s.saturating_add(r.size) > va)
    }

    /// Translates `va..va+len` for a copy by `accessor` that needs `need` access.
    ///
    /// A range that touches no reservation is host memory. A range inside one reservation must be
    /// fully mapped with the access needed; anything else is [`Error::IllegalAccess`].
    pub(crate) fn translate(
        &self,
        va: DevicePtr,
        len: u64,
        accessor: Accessor,
        need: Access,
    ) -> Result<Translation> {
        let end = range_end(va, len, "copy address + length")?;
        if len == 0 || !self.touches_reservation(va, len) {
            return Ok(Translation::Host);
        }
        let illegal = |reason: &'static str| Error::IllegalAccess {
            va,
            size: len,
            reason,
        };
        let Some((_, r)) = self.reservation_of(va, end) else {
            return Err(illegal("range crosses the boundary of a reservation"));
        };
        let mut pieces: Vec<Piece> = Vec::new();
        let mut cursor = va;
        while cursor < end {
            let Some((_, m)) = r
                .mappings
                .range(..=cursor)
                .next_back()
                .filter(|(_, m)| m.end() > cursor)
            else {
                return Err(illegal("range is not fully mapped"));
            };
            let piece_end = m.end().min(end);
            if !m.allows(cursor, piece_end, accessor, need) {
                return Err(illegal(match need {
                    Access::ReadWrite => "no write access granted to this stream's device",
                    _ => "no read access granted to this stream's device",
                }));
            }
            pieces.push(Piece {
                handle: m.handle,
                offset: m.offset + (cursor - m.va),
                len: piece_end - cursor,
            });
            cursor = piece_end;
        }
        Ok(Translation::Device(pieces))
    }

    /// Checks one launch of the block-copy kernel (`DeviceWork::copy_blocks_async`) for `accessor`:
    /// the rule both backends share, so they report the same typed errors before anything is
    /// queued.
    ///
    /// - `len` fits `usize`, `len × pairs` fits `u64`, every `address + len` fits
    ///   ([`Error::Overflow`]);
    /// - every source is readable and every destination writable by `accessor` (precondition 8:
    ///   [`Error::IllegalAccess`]), host pointers are not null ([`Error::InvalidArgument`]);
    /// - destinations are pairwise disjoint and disjoint from every source
    ///   ([`Error::InvalidArgument`]), compared on the memory itself: device ranges as
    ///   `(handle, offset)` pieces, so two VAs of one handle alias, host ranges as addresses.
    ///
    /// Returns the host (non-device) ranges `(address, len)` of the launch, sources first.
    pub(crate) fn check_blocks(
        &self,
        accessor: Accessor,
        len: u64,
        pairs: &[(DevicePtr, DevicePtr)],
    ) -> Result<Vec<(u64, u64)>> {
        usize::try_from(len).map_err(|_| Error::Overflow("block length"))?;
        let count = u64::try_from(pairs.len()).map_err(|_| Error::Overflow("block count"))?;
        len.checked_mul(count)
            .ok_or(Error::Overflow("block length × count"))?;
        for &(src, dst) in pairs {
            range_end(src, len, "copy address + length")?;
            range_end(dst, len, "copy address + length")?;
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        // Ranges per memory space: `None` is host memory, `Some(handle)` a physical handle.
        type Spaces = BTreeMap<Option<u64>, (Vec<(u64, u64)>, Vec<(u64, u64)>)>;
        let mut spaces = Spaces::new();
        let mut host = Vec::new();
        for (is_dst, need) in [(false, Access::Read), (true, Access::ReadWrite)] {
            for &(src, dst) in pairs {
                let addr = if is_dst { dst } else { src };
                let mut push = |key: Option<u64>, range: (u64, u64)| {
                    let entry = spaces.entry(key).or_default();
                    if is_dst {
                        entry.1.push(range);
                    } else {
                        entry.0.push(range);
                    }
                };
                match self.translate(addr, len, accessor, need)? {
                    Translation::Host if addr == 0 => {
                        return Err(Error::InvalidArgument("null host pointer in a copy".into()))
                    }
                    Translation::Host => {
                        push(None, (addr, len));
                        host.push((addr, len));
                    }
                    Translation::Device(pieces) => {
                        for p in pieces {
                            push(Some(p.handle.0), (p.offset, p.len));
                        }
                    }
                }
            }
        }
        for (space, (srcs, dsts)) in &spaces {
            if let Err((a, b)) = strata_kernels::blockcopy::check_disjoint(srcs, dsts) {
                let at = match space {
                    None => "host memory".to_string(),
                    Some(h) => format!("physical handle {h:#x} (offsets)"),
                };
                return Err(Error::InvalidArgument(format!(
                    "block-copy ranges overlap in {at}: {:#x}+{:#x} and {:#x}+{:#x}",
                    a.0, a.1, b.0, b.1
                )));
            }
        }
        Ok(host)
    }

    /// Checks the table's invariants (tests): mappings inside their reservation, disjoint,
    /// access runs covering each mapping exactly, the mapping count right.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut count = 0u64;
        let mut prev_end = 0u64;
        for (&start, r) in &self.reservations {
            if start < prev_end {
                return Err(format!("reservation {start:#x} overlaps the previous one"));
            }
            let r_end = start + r.size;
            prev_end = r_end;
            let mut cursor = start;
            for (&k, m) in &r.mappings {
                count += 1;
                if k != m.va || m.va < cursor || m.end() > r_end {
                    return Err(format!("mapping {:#x}+{:#x} misplaced", m.va, m.size));
                }
                cursor = m.end();
                let mut c = m.va;
                for run in &m.access {
                    if run.start != c || run.end <= run.start {
                        return Err(format!("access runs of {:#x} broken", m.va));
                    }
                    c = run.end;
                }
                if c != m.end() {
                    return Err(format!("access runs of {:#x} do not cover it", m.va));
                }
            }
        }
        if count != self.mappings {
            return Err(format!("mapping count {} != {count}", self.mappings));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
