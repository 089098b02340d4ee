//! Sharing physical memory across processes: POSIX file descriptor export and import, and the
//! size probe an imported handle needs (the driver has no size query for handles).

use std::os::fd::{BorrowedFd, OwnedFd};

use cudarc::driver::sys;

use super::result::{self, CUresult};
use super::{host_total_bytes, CudaBackend, HandleInfo, Scratch};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::types::{Location, PhysHandle};

impl CudaBackend {
    /// [`Backend::export_fd`].
    pub(super) fn export_handle(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let state = self.state.lock();
        let Some(info) = state.handles.get(&handle.0) else {
            return Err(Error::InvalidHandle {
                kind: "physical",
                id: handle.0,
            });
        };
        if !info.exportable {
            return Err(Error::InvalidArgument(format!(
                "handle {:#x} was not created with CreateFlags::EXPORTABLE",
                handle.0
            )));
        }
        self.enter(self.device_for(info.location)?)?;
        // SAFETY: the handle is live: we hold a reference and the state lock (no release
        // meanwhile).
        unsafe { result::phys::export_fd(handle.0) }
    }

    /// [`Backend::import_fd`].
    pub(super) fn import_handle(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle> {
        self.enter(0)?;
        let handle = result::phys::import_fd(fd)?;
        // Releases the new reference if anything below fails.
        struct Guard(u64, bool);
        impl Drop for Guard {
            fn drop(&mut self) {
                if self.1 {
                    // SAFETY: the handle was just imported and never published.
                    let _ = unsafe { result::phys::release(self.0) };
                }
            }
        }
        let mut guard = Guard(handle, true);
        // SAFETY: the handle was just imported and is live.
        let props = unsafe { result::phys::properties(handle)? };
        let location = location_from(&props.location)?;
        let location = match location {
            Location::Device(d) if self.device(d).is_err() => {
                return Err(Error::NoDevice(d.into()))
            }
            other => other,
        };
        let exportable = props.requestedHandleTypes
            == sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let granularity = self.granularity(location)?;
        let mut state = self.state.lock();
        let size = match state.handles.get(&handle) {
            Some(known) => known.size,
            None => self.probe_handle_size(handle, location, granularity)?,
        };
        let entry = state.handles.entry(handle).or_insert(HandleInfo {
            location,
            size,
            exportable,
            refs: 0,
        });
        entry.refs += 1;
        guard.1 = false;
        Ok(PhysHandle(handle))
    }

    /// Finds the size of an imported handle: the largest `k * granularity` that maps at offset
    /// 0, by binary search on a scratch reservation (the driver has no size query for handles).
    fn probe_handle_size(&self, handle: u64, location: Location, granularity: u64) -> Result<u64> {
        let bound = match location {
            Location::Device(d) => self.device(d)?.total,
            Location::Host => host_total_bytes(),
        };
        let max_units = (bound / granularity).max(1);
        let span = max_units
            .checked_mul(granularity)
            .ok_or(Error::Overflow("probe span"))?;
        self.enter(self.device_for(location)?)?;
        let va = result::va::reserve(span, granularity)?;
        let scratch = Scratch { va, size: span };
        let fits = |units: u64| -> Result<bool> {
            let size = units * granularity;
            // SAFETY: `scratch` is our own fresh reservation of `span >= size` bytes with nothing
            // mapped; `handle` is live (just imported, not yet published).
            match unsafe { result::map::map(scratch.va, size, 0, handle) } {
                Ok(()) => {
                    // SAFETY: the mapping was just made, covers exactly this range, and nothing
                    // has access to it.
                    unsafe { result::map::unmap(scratch.va, size)? };
                    Ok(true)
                }
                Err(e) if result::is_code(&e, CUresult::CUDA_ERROR_INVALID_VALUE) => Ok(false),
                Err(e) => Err(e),
            }
        };
        if !fits(1).map_err(|e| match super::vmm::not_supported(e) {
            Error::Unsupported(words) => {
                Error::Unsupported(format!("mapping an imported handle: {words}"))
            }
            other => other,
        })? {
            return Err(Error::Unsupported(
                "imported handle: cannot map even one granule to find its size".into(),
            ));
        }
        // Invariant: `lo` units map, `hi` units do not (`max_units + 1` is beyond the bound).
        let (mut lo, mut hi) = (1u64, max_units + 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        drop(scratch);
        Ok(lo * granularity)
    }
}

fn location_from(loc: &result::CUmemLocation) -> Result<Location> {
    match loc.type_ {
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => u32::try_from(loc.id)
            .map(Location::Device)
            .map_err(|_| Error::InvalidArgument(format!("device id {}", loc.id))),
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        | sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA
        | sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Ok(Location::Host),
        other => Err(Error::Unsupported(format!(
            "imported handle at location type {other:?}"
        ))),
    }
}
