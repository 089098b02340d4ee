//! [`DeviceBuffer`]: device memory in one piece, beside [`HostBuffer`](crate::HostBuffer) —
//! one reservation, one physical allocation, one mapping, read-write for one device.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::raii::{Mapping, PhysicalMemory, Reservation};
use crate::types::{round_up, Access, CreateFlags, DevicePtr, Location};

/// At least the requested bytes of device memory (rounded up to the granularity), mapped
/// read-write for its device. On drop: unmap, release, free the VA (the mapping owns the
/// reservation and the memory, so the order falls out of ownership). Callers drain the streams
/// that use it first (unmap does not wait). Not from a page pool: for scratch and staging
/// buffers that tools and calibration own for their whole run.
pub struct DeviceBuffer {
    mapping: Mapping,
}

impl DeviceBuffer {
    /// `bytes` (at least one granule, rounded up to the granularity) on `device`.
    pub fn new(backend: &Arc<dyn Backend>, device: u32, bytes: u64) -> Result<Self> {
        let location = Location::Device(device);
        let size = round_up(bytes.max(1), backend.granularity(location)?)
            .ok_or(Error::Overflow("device buffer size"))?;
        let phys = Arc::new(PhysicalMemory::create(
            backend,
            location,
            size,
            CreateFlags::empty(),
        )?);
        let reservation = Arc::new(Reservation::new(backend, size, 0)?);
        // On failure `reservation` and `phys` drop here: nothing leaks.
        let mapping = Mapping::new(
            &reservation,
            reservation.ptr(),
            phys,
            0,
            size,
            &[(location, Access::ReadWrite)],
        )?;
        Ok(DeviceBuffer { mapping })
    }

    /// First byte.
    pub fn ptr(&self) -> DevicePtr {
        self.mapping.va()
    }

    /// Bytes mapped (the rounded size).
    pub fn size(&self) -> u64 {
        self.mapping.size()
    }

    /// The reservation, for [`CopyScope`](crate::CopyScope)s.
    pub fn reservation(&self) -> &Reservation {
        self.mapping.reservation()
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}+{:#x})", self.ptr(), self.size())
    }
}
