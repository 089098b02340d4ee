//! Plain value types shared by every backend.

use std::fmt;

/// A virtual address in the backend's unified address space (a `CUdeviceptr` on CUDA, a process
/// address on the host backend). Host memory outside any reservation uses the same type.
pub type DevicePtr = u64;

/// Where physical memory lives, or which agent an access grant is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// A GPU (or emulated GPU) by ordinal.
    Device(u32),
    /// Host memory (CUDA: `CU_MEM_LOCATION_TYPE_HOST_NUMA`, node 0).
    Host,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Device(d) => write!(f, "device {d}"),
            Location::Host => write!(f, "host"),
        }
    }
}

/// Access granted to a location over a mapped range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Access {
    /// No access (the state of a fresh mapping).
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

bitflags::bitflags! {
    /// Options for [`crate::Backend::create`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct CreateFlags: u32 {
        /// Request a POSIX file-descriptor shareable handle (needed for `export_fd`).
        const EXPORTABLE = 1 << 0;
    }
}

/// An opaque physical allocation handle (`CUmemGenericAllocationHandle` on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// A stream: an in-order queue of asynchronous work. `StreamHandle::DEFAULT` is the legacy
/// default stream (synchronous with respect to the host for copies on the host backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamHandle(pub u64);

impl StreamHandle {
    /// The default (null) stream.
    pub const DEFAULT: StreamHandle = StreamHandle(0);
}

/// An event: a marker recorded on a stream, complete when the work before it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub u64);

/// Free and total physical memory of a device, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// What a backend knows about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    pub total_memory: u64,
    pub granularity: u64,
}

/// One copy of `len` bytes from `src` to `dst` (either may be device VA or host memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyDesc {
    pub dst: DevicePtr,
    pub src: DevicePtr,
    pub len: u64,
}

/// Which backend implementation is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cuda,
    Host,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Host => "host",
        })
    }
}

/// Live driver objects, for leak checks (`baseline == after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LiveCounts {
    pub reservations: u64,
    pub handles: u64,
    pub mappings: u64,
    pub streams: u64,
    pub events: u64,
}

/// Rounds `value` up to a multiple of `align` (a power of two or any non-zero value), checked.
pub fn round_up(value: u64, align: u64) -> Option<u64> {
    if align == 0 {
        return None;
    }
    let rem = value % align;
    if rem == 0 {
        Some(value)
    } else {
        value.checked_add(align - rem)
    }
}

/// True when `a..a+a_len` and `b..b+b_len` share a byte.
pub fn overlaps(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}
