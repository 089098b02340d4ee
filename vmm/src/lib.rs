//! The VMM layer of strata: one contract ([`Backend`]) over the CUDA virtual-memory API, with a
//! CUDA backend and a faithful host emulation, plus RAII owners of reservations, physical memory,
//! mappings, streams and events. Kernels and library calls on a backend's streams (block copy,
//! GEMM) are a separate trait, [`DeviceWork`].
//!
//! [`FaultyBackend`] wraps any backend with fault injection, gates and slow streams, for tests
//! that must also run on the CUDA backend.
//!
//! Only this crate (and `ffi`) touches raw driver or C pointers.

mod backend;
pub mod cuda;
mod devbuf;
mod error;
mod faulty;
pub mod fork;
pub mod host;
mod hostbuf;
pub mod ipc;
mod raii;
mod select;
mod types;
mod vatable;
mod work;

pub use backend::{device_work, Backend};
pub use cuda::{CudaBackend, MallocAsync};
pub use devbuf::DeviceBuffer;
pub use error::{Error, Result};
pub use faulty::FaultyBackend;
pub use host::{HostBackend, HostConfig};
pub use hostbuf::{copy_async_in, try_host_vec, CopyKind, CopyScope, HostBuffer, MAX_HOST_CHUNK};
pub use raii::{
    check_deferred, process_is_exiting, record_deferred, Event, Mapping, PhysicalMemory,
    Reservation, Stream,
};
pub use select::{
    from_env, from_env_explained, global, host_or_cuda, open, open_explained, open_with, Choice,
};
/// Driver-call and copy costs (`STRATA_HOST_LATENCY`), re-exported for benches and tests.
pub use strata_latency as latency;
pub use types::{
    overlaps, round_up, Access, BackendKind, CopyDesc, CreateFlags, DeviceInfo, DevicePtr,
    EventHandle, LiveCounts, Location, MemInfo, PhysHandle, StreamHandle,
};
pub use work::{DeviceWork, GemmF32};
