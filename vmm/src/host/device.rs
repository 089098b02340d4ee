//! Physical memory of the emulated devices: one memfd per location, an offset allocator over a
//! sparse offset space, capacity accounting, and the handle table entries.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};

use crate::error::{Error, Result};
use crate::types::Location;

use super::os::{self, Region};

/// First-fit allocator of granularity-aligned ranges in `0..space`, coalescing on free.
#[derive(Debug)]
pub(crate) struct OffsetAllocator {
    /// Free ranges by start offset; never adjacent (they are merged).
    free: BTreeMap<u64, u64>,
}

impl OffsetAllocator {
    pub(crate) fn new(space: u64) -> Self {
        let mut free = BTreeMap::new();
        if space > 0 {
            free.insert(0, space);
        }
        OffsetAllocator { free }
    }

    /// Takes `size` bytes (a multiple of the granularity) from the first free range that fits.
    pub(crate) fn alloc(&mut self, size: u64) -> Option<u64> {
        let (&start, &len) = self.free.iter().find(|(_, &len)| len >= size)?;
        self.free.remove(&start);
        if len > size {
            self.free.insert(start + size, len - size);
        }
        Some(start)
    }

    /// Returns `offset..offset+size`, merging with its free neighbours.
    pub(crate) fn free(&mut self, offset: u64, size: u64) {
        let mut start = offset;
        let mut len = size;
        if let Some((&p, &plen)) = self.free.range(..offset).next_back() {
            if p + plen == offset {
                self.free.remove(&p);
                start = p;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += nlen;
        }
        self.free.insert(start, len);
    }

    /// Total free bytes (tests).
    #[cfg(test)]
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

/// The physical memory of one location: a sparse memfd, a shadow view of it, and the capacity
/// account.
#[derive(Debug)]
pub(crate) struct Pool {
    location: Location,
    memfd: OwnedFd,
    shadow: Region,
    capacity: u64,
    used: u64,
    offsets: OffsetAllocator,
}

impl Pool {
    /// A pool of `capacity` bytes over a memfd of four times that size (so fragmentation of the
    /// offset space does not limit what capacity allows).
    pub(crate) fn new(location: Location, capacity: u64, granularity: u64) -> Result<Pool> {
        let space = crate::types::round_up(capacity, granularity)
            .and_then(|c| c.checked_mul(4))
            .ok_or(Error::Overflow("device capacity * 4"))?;
        let name = CString::new(format!("strata-host-{location}").replace(' ', "-"))
            .map_err(|_| Error::InvalidArgument("memfd name".into()))?;
        let memfd = os::memfd(&name, space)?;
        let shadow = Region::shared(memfd.as_fd(), space)?;
        Ok(Pool {
            location,
            memfd,
            shadow,
            capacity,
            used: 0,
            offsets: OffsetAllocator::new(space),
        })
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) fn available(&self) -> u64 {
        self.capacity.saturating_sub(self.used)
    }

    pub(crate) fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    pub(crate) fn shadow_base(&self) -> usize {
        self.shadow.base()
    }

    fn out_of_memory(&self, requested: u64) -> Error {
        Error::OutOfMemory {
            location: self.location,
            requested,
            available: self.available(),
        }
    }

    /// Charges `size` bytes of capacity (for memory that lives in its own memfd).
    pub(crate) fn charge(&mut self, size: u64) -> Result<()> {
        if size > self.available() {
            return Err(self.out_of_memory(size));
        }
        self.used += size;
        Ok(())
    }

    /// Returns `size` bytes of capacity.
    pub(crate) fn uncharge(&mut self, size: u64) {
        self.used = self.used.saturating_sub(size);
    }

    /// Charges `size` bytes and takes a range of the memfd for them.
    pub(crate) fn alloc(&mut self, size: u64) -> Result<u64> {
        if size > self.available() {
            return Err(self.out_of_memory(size));
        }
        let offset = self
            .offsets
            .alloc(size)
            .ok_or_else(|| self.out_of_memory(size))?;
        self.used += size;
        Ok(offset)
    }

    /// Punches the range out of the memfd (the memory really returns) and gives it back.
    pub(crate) fn free(&mut self, offset: u64, size: u64) -> Result<()> {
        let punched = os::punch_hole(self.memfd.as_fd(), offset, size);
        self.offsets.free(offset, size);
        self.uncharge(size);
        punched
    }

    /// Bytes the memfd really holds.
    pub(crate) fn resident(&self) -> Result<u64> {
        os::resident(self.memfd.as_fd())
    }
}

/// Where a handle's bytes live.
#[derive(Debug)]
pub(crate) enum Backing {
    /// A range of its location's pool memfd.
    Pooled { offset: u64 },
    /// Its own memfd (exportable or imported), with a shadow view of it.
    Own {
        fd: OwnedFd,
        shadow: Region,
        /// `(st_dev, st_ino)` of the file, to recognize our own exports on import.
        id: (u64, u64),
    },
}

/// One physical handle and its references.
#[derive(Debug)]
pub(crate) struct HandleEntry {
    pub(crate) location: Location,
    pub(crate) size: u64,
    pub(crate) backing: Backing,
    /// The creation (or import) reference is still held.
    pub(crate) created: bool,
    /// Mappings of this handle.
    pub(crate) maps: u64,
    /// In-flight copies touching it.
    pub(crate) pins: u64,
    /// Counted against its location's capacity.
    pub(crate) charged: bool,
    /// Came from `import_fd` (not counted in `resident_bytes`).
    pub(crate) imported: bool,
}

impl HandleEntry {
    /// Outstanding references; the memory returns when this reaches zero.
    pub(crate) fn refs(&self) -> u64 {
        u64::from(self.created) + self.maps + self.pins
    }

    /// Address in this process at which byte `offset` of the handle can be read and written
    /// (through the shadow view), given the pools.
    pub(crate) fn shadow_addr(
        &self,
        pools: &[Pool],
        pool_index: usize,
        offset: u64,
    ) -> Result<usize> {
        let (base, off) = match &self.backing {
            Backing::Pooled { offset: o } => {
                let pool = pools
                    .get(pool_index)
                    .ok_or(Error::InvalidArgument("pool".into()))?;
                (
                    pool.shadow_base(),
                    o.checked_add(offset)
                        .ok_or(Error::Overflow("shadow offset"))?,
                )
            }
            Backing::Own { shadow, .. } => (shadow.base(), offset),
        };
        let off = usize::try_from(off).map_err(|_| Error::Overflow("shadow offset"))?;
        base.checked_add(off)
            .ok_or(Error::Overflow("shadow address"))
    }
}

/// File identity `(st_dev, st_ino)` of a descriptor.
pub(crate) fn file_id(fd: std::os::fd::BorrowedFd<'_>) -> Result<(u64, u64)> {
    let st = os::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_first_fit_and_coalesce() {
        let mut a = OffsetAllocator::new(100);
        assert_eq!(a.alloc(10), Some(0));
        assert_eq!(a.alloc(20), Some(10));
        assert_eq!(a.alloc(30), Some(30));
        assert_eq!(a.alloc(50), None);
        a.free(10, 20);
        assert_eq!(a.alloc(15), Some(10));
        a.free(10, 15);
        a.free(0, 10);
        a.free(30, 30);
        assert_eq!(a.free_bytes(), 100);
        assert_eq!(a.alloc(100), Some(0));
    }

    #[test]
    fn pool_capacity_and_punch() {
        let g = 2 << 20;
        let mut p = Pool::new(Location::Device(0), 4 * g, g).unwrap();
        let a = p.alloc(2 * g).unwrap();
        let b = p.alloc(2 * g).unwrap();
        assert!(matches!(
            p.alloc(g),
            Err(Error::OutOfMemory { available: 0, .. })
        ));
        // SAFETY: the shadow maps the whole memfd read-write and `a` lies inside it.
        unsafe { std::ptr::write_bytes((p.shadow_base() + a as usize) as *mut u8, 7, g as usize) };
        assert!(p.resident().unwrap() >= g);
        p.free(a, 2 * g).unwrap();
        assert_eq!(p.resident().unwrap(), 0);
        assert_eq!(p.available(), 2 * g);
        p.free(b, 2 * g).unwrap();
        assert_eq!(p.available(), p.capacity());
    }
}
