//! The CUDA backend's virtual memory calls: reservations, physical handles, mappings and access.
//! Each checks the call against the VA table, calls the driver and records the result, all under
//! the state lock, so the driver never sees a call that breaks the [`Backend`] contract.

use super::result::{self, CUmemAccessDesc, CUresult};
use super::{device_location, host_location, host_total_bytes, CudaBackend, HandleInfo};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{Access, CreateFlags, DevicePtr, Location, PhysHandle};
use crate::vatable::VaTable;

impl CudaBackend {
    /// Granularity used for VA-only rules (reservations): the largest of the devices'.
    fn va_granularity(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.granularity)
            .max()
            .unwrap_or(1)
    }

    /// Granularity for `unmap`/`set_access`: the smallest of the known ones. Whole mappings are
    /// aligned to their own location's granularity already (checked at `map`); a sub-range that
    /// is aligned to this but not to its memory's granularity is refused by the driver.
    fn range_granularity(&self) -> u64 {
        let device_min = self
            .devices
            .iter()
            .map(|d| d.granularity)
            .min()
            .unwrap_or(1);
        match self.host_granularity.get() {
            Some(Ok(host)) => device_min.min(*host),
            _ => device_min,
        }
    }

    fn out_of_memory(&self, location: Location, requested: u64) -> Error {
        let available = match location {
            Location::Device(d) => self.mem_info(d).map(|m| m.free).unwrap_or(0),
            Location::Host => host_available_bytes(),
        };
        Error::OutOfMemory {
            location,
            requested,
            available,
        }
    }

    fn access_desc(&self, location: Location, access: Access) -> Result<CUmemAccessDesc> {
        let location = match location {
            Location::Device(d) => {
                self.device(d)?;
                device_location(d)
            }
            Location::Host => host_location(),
        };
        Ok(CUmemAccessDesc {
            location,
            flags: result::access::flags(access),
        })
    }

    /// [`Backend::reserve`].
    pub(super) fn reserve_va(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        let alignment = VaTable::check_reserve(size, alignment, self.va_granularity())?;
        self.enter(0)?;
        let mut state = self.state.lock();
        let ptr = match result::va::reserve(size, alignment) {
            Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                return Err(Error::OutOfAddressSpace { requested: size })
            }
            other => other?,
        };
        if let Err(e) = state.table.add_reservation(ptr, size) {
            // SAFETY: the reservation was just made, nothing is mapped in it and nobody else
            // has seen its address.
            let _ = unsafe { result::va::free(ptr, size) };
            return Err(e);
        }
        Ok(ptr)
    }

    /// [`Backend::free_va`].
    pub(super) fn free_reservation(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut state = self.state.lock();
        state.table.check_free(ptr, size)?;
        self.enter(0)?;
        // SAFETY: the table confirms `(ptr, size)` is exactly one live reservation of ours with
        // nothing mapped inside; the caller's contract (precondition 2, 4) covers in-flight work.
        unsafe { result::va::free(ptr, size)? };
        state.table.remove_reservation(ptr, size)
    }

    /// [`Backend::create`].
    pub(super) fn create_handle(
        &self,
        location: Location,
        size: u64,
        flags: CreateFlags,
    ) -> Result<PhysHandle> {
        let granularity = self.granularity(location)?;
        if size == 0 {
            return Err(Error::InvalidArgument("size must not be zero".into()));
        }
        if size % granularity != 0 {
            return Err(Error::Misaligned {
                what: "size",
                value: size,
                granularity,
            });
        }
        let device = self.device_for(location)?;
        let bound = match location {
            Location::Device(d) => self.device(d)?.total,
            Location::Host => host_total_bytes(),
        };
        if size > bound {
            return Err(self.out_of_memory(location, size));
        }
        let cu_location = match location {
            Location::Device(d) => device_location(d),
            Location::Host => host_location(),
        };
        let exportable = flags.contains(CreateFlags::EXPORTABLE);
        let prop = result::phys::prop(cu_location, exportable);
        self.enter(device)?;
        let handle = match result::phys::create(size, &prop) {
            Ok(h) => h,
            Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                return Err(self.out_of_memory(location, size));
            }
            Err(e)
                if location == Location::Host
                    && result::is_code(&e, CUresult::CUDA_ERROR_NOT_SUPPORTED) =>
            {
                return Err(Error::Unsupported(format!("host VMM memory: {e}")));
            }
            Err(e) => return Err(e),
        };
        let mut state = self.state.lock();
        let entry = state.handles.entry(handle).or_insert(HandleInfo {
            location,
            size,
            exportable,
            refs: 0,
        });
        entry.refs += 1;
        Ok(PhysHandle(handle))
    }

    /// [`Backend::release`].
    pub(super) fn release_handle(&self, handle: PhysHandle) -> Result<()> {
        let mut state = self.state.lock();
        let Some(info) = state.handles.get_mut(&handle.0) else {
            return Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            });
        };
        let device = self.device_for(info.location)?;
        self.enter(device)?;
        // SAFETY: the handle is live (we hold a reference to it, counted in `refs`) and this
        // releases exactly one of those references; mappings of it stay valid (precondition 6).
        unsafe { result::phys::release(handle.0)? };
        info.refs -= 1;
        if info.refs == 0 {
            state.handles.remove(&handle.0);
        }
        Ok(())
    }

    /// [`Backend::map`].
    pub(super) fn map_handle(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> Result<()> {
        let mut state = self.state.lock();
        let Some(info) = state.handles.get(&handle.0).copied() else {
            return Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            });
        };
        let granularity = self.granularity(info.location)?;
        state
            .table
            .check_map(va, size, offset, info.size, granularity)?;
        self.enter(self.device_for(info.location)?)?;
        // SAFETY: the table confirms the target lies inside one of our reservations and is
        // unmapped, that `offset + size` fits the handle, and the handle is live (we hold it and
        // the state lock, so no release runs concurrently).
        match unsafe { result::map::map(va, size, offset, handle.0) } {
            // The driver's mapping bookkeeping ran out: address space, as on the host backend.
            Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                return Err(Error::OutOfAddressSpace { requested: size })
            }
            other => other.map_err(not_supported)?,
        }
        state
            .table
            .insert_mapping(va, size, handle, offset, info.size, granularity)
    }

    /// [`Backend::unmap`].
    pub(super) fn unmap_range(&self, va: DevicePtr, size: u64) -> Result<()> {
        let mut state = self.state.lock();
        let granularity = self.range_granularity();
        state.table.check_unmap(va, size, granularity)?;
        self.enter(0)?;
        // SAFETY: the table confirms the range covers whole mappings of ours exactly;
        // precondition 4 makes the caller responsible for in-flight work on the range.
        unsafe { result::map::unmap(va, size)? };
        state.table.remove_mappings(va, size, granularity)?;
        Ok(())
    }

    /// [`Backend::set_access`].
    pub(super) fn set_range_access(
        &self,
        va: DevicePtr,
        size: u64,
        grants: &[(Location, Access)],
    ) -> Result<()> {
        let mut state = self.state.lock();
        let granularity = self.range_granularity();
        state
            .table
            .check_set_access(va, size, grants, granularity)?;
        state.table.check_host_grants(va, size, grants, |h| {
            state.handles.get(&h.0).map(|info| info.location)
        })?;
        let descs = grants
            .iter()
            .map(|&(l, a)| self.access_desc(l, a))
            .collect::<Result<Vec<_>>>()?;
        self.enter(0)?;
        // SAFETY: the table confirms the whole range is mapped by us; revoking access under
        // in-flight work is the caller's responsibility (precondition 5 / 8).
        unsafe { result::access::set(va, size, &descs)? };
        state.table.set_access(va, size, grants, granularity)?;
        Ok(())
    }
}

/// The driver's `CUDA_ERROR_NOT_SUPPORTED` as [`Error::Unsupported`], in the driver's own
/// words (what a caller can fall back on, e.g. a non-mappable imported handle); other errors
/// unchanged.
pub(super) fn not_supported(e: Error) -> Error {
    if result::is_code(&e, CUresult::CUDA_ERROR_NOT_SUPPORTED) {
        Error::Unsupported(e.to_string())
    } else {
        e
    }
}

fn host_available_bytes() -> u64 {
    // SAFETY: `sysconf` only reads system configuration values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_AVPHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}
