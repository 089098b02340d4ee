//! The one flat error type of strata.
//!
//! Every layer returns [`Error`]; the C ABI (`ffi/src/status.rs`) maps each variant to a stable
//! numeric status, with an exhaustive match, so a new variant must choose its status there.
//! Out-of-memory is an ordinary variant, never a panic.

use crate::types::{DevicePtr, Location};

/// Result alias used throughout strata.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in strata.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Physical memory (or an allocator limit) is exhausted. A normal, recoverable outcome.
    #[error("out of memory on {location}: requested {requested} bytes, {available} available")]
    OutOfMemory {
        location: Location,
        requested: u64,
        available: u64,
    },
    /// No virtual address range of the requested size is left (CUDA: reserve out of memory).
    #[error("out of virtual address space: {requested} bytes requested")]
    OutOfAddressSpace { requested: u64 },
    /// A storage tier (a tier store's host or disk tier, or the filesystem under its disk
    /// tier) has no room left. As recoverable as [`Error::OutOfMemory`].
    #[error("out of {tier} tier space: {requested} bytes requested, {available} available")]
    OutOfTierSpace {
        tier: &'static str,
        requested: u64,
        available: u64,
    },
    /// A size, address or offset is not a multiple of the allocation granularity.
    #[error("{what} {value:#x} is not a multiple of the granularity {granularity:#x}")]
    Misaligned {
        what: &'static str,
        value: u64,
        granularity: u64,
    },
    /// An argument is outside what the call accepts.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Arithmetic on a caller-supplied size or address overflowed.
    #[error("size arithmetic overflowed: {0}")]
    Overflow(&'static str),
    /// `map` over a range that is already (partly) mapped.
    #[error("range {va:#x}+{size:#x} is already mapped")]
    AlreadyMapped { va: DevicePtr, size: u64 },
    /// An operation that needs a mapped range found none (or only part of one).
    #[error("range {va:#x}+{size:#x} is not mapped")]
    NotMapped { va: DevicePtr, size: u64 },
    /// `unmap` of a range that does not cover whole mappings exactly.
    #[error("range {va:#x}+{size:#x} does not cover whole mappings (partial unmap)")]
    PartialUnmap { va: DevicePtr, size: u64 },
    /// An address range that lies in no reservation, or crosses a reservation's end.
    #[error("range {va:#x}+{size:#x} lies outside every reservation")]
    NotReserved { va: DevicePtr, size: u64 },
    /// A copy touched memory without the access it needs (CUDA: illegal address).
    #[error("illegal access to {va:#x}+{size:#x}: {reason}")]
    IllegalAccess {
        va: DevicePtr,
        size: u64,
        reason: &'static str,
    },
    /// A handle (physical, stream, event) that is unknown or already released.
    #[error("invalid {kind} handle {id:#x}")]
    InvalidHandle { kind: &'static str, id: u64 },
    /// A reservation still has mappings inside it.
    #[error("reservation {va:#x}+{size:#x} still has mappings inside")]
    StillMapped { va: DevicePtr, size: u64 },
    /// A pointer that this allocator did not hand out (or already took back).
    #[error("unknown pointer {0:#x} (never allocated here, or already freed)")]
    UnknownPointer(DevicePtr),
    /// A pointer freed twice.
    #[error("double free of {0:#x}")]
    DoubleFree(DevicePtr),
    /// A stale id (its generation no longer matches).
    #[error("stale {kind} id {index}/{generation}")]
    StaleId {
        kind: &'static str,
        index: u32,
        generation: u32,
    },
    /// The operation conflicts with the object's state (e.g. allocating under a sleeping tag).
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// An allocator limit would be exceeded.
    #[error("limit exceeded: {requested} bytes requested, {used} used of {limit}")]
    LimitExceeded {
        requested: u64,
        used: u64,
        limit: u64,
    },
    /// The requested backend or feature is not available here.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No CUDA driver library could be loaded, or it has no devices.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The device ordinal does not exist.
    #[error("no such device {0}")]
    NoDevice(i64),
    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Driver {
        call: &'static str,
        code: i32,
        name: String,
    },
    /// A fault injected by the host backend's fault plan.
    #[error("injected fault in {0}")]
    InjectedFault(&'static str),
    /// An operating-system call failed.
    #[error("{call}: {source}")]
    Os {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A configuration value could not be parsed.
    #[error("bad configuration {name}={value:?}: {reason}")]
    Config {
        name: &'static str,
        value: String,
        reason: String,
    },
    /// An asynchronous operation failed; reported at the next synchronization point.
    #[error("asynchronous failure on stream {stream:#x}: {message}")]
    Async { stream: u64, message: String },
    /// An error that a destructor could not return, surfaced by the next fallible call.
    #[error("deferred from a destructor: {0}")]
    Deferred(Box<Error>),
}

impl Error {
    /// Captures `errno` for an OS call.
    pub fn os(call: &'static str) -> Self {
        Error::Os {
            call,
            source: std::io::Error::last_os_error(),
        }
    }

    /// True for out-of-memory and limit errors: the caller may free something and retry.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. }
            | Error::OutOfAddressSpace { .. }
            | Error::OutOfTierSpace { .. }
            | Error::LimitExceeded { .. } => true,
            Error::Deferred(inner) => inner.is_out_of_memory(),
            _ => false,
        }
    }
}

/// A copy with the same variant and fields, for a failure reported more than once (a cached
/// backend-selection error). `std::io::Error` is not `Clone`: an OS error keeps its code, or its
/// kind and message.
impl Clone for Error {
    fn clone(&self) -> Self {
        match self {
            Error::OutOfMemory {
                location,
                requested,
                available,
            } => Error::OutOfMemory {
                location: *location,
                requested: *requested,
                available: *available,
            },
            Error::OutOfAddressSpace { requested } => Error::OutOfAddressSpace {
                requested: *requested,
            },
            Error::OutOfTierSpace {
                tier,
                requested,
                available,
            } => Error::OutOfTierSpace {
                tier,
                requested: *requested,
                available: *available,
            },
            Error::Misaligned {
                what,
                value,
                granularity,
            } => Error::Misaligned {
                what,
                value: *value,
                granularity: *granularity,
            },
            Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
            Error::Overflow(what) => Error::Overflow(what),
            Error::AlreadyMapped { va, size } => Error::AlreadyMapped {
                va: *va,
                size: *size,
            },
            Error::NotMapped { va, size } => Error::NotMapped {
                va: *va,
                size: *size,
            },
            Error::PartialUnmap { va, size } => Error::PartialUnmap {
                va: *va,
                size: *size,
            },
            Error::NotReserved { va, size } => Error::NotReserved {
                va: *va,
                size: *size,
            },
            Error::IllegalAccess { va, size, reason } => Error::IllegalAccess {
                va: *va,
                size: *size,
                reason,
            },
            Error::InvalidHandle { kind, id } => Error::InvalidHandle { kind, id: *id },
            Error::StillMapped { va, size } => Error::StillMapped {
                va: *va,
                size: *size,
            },
            Error::UnknownPointer(p) => Error::UnknownPointer(*p),
            Error::DoubleFree(p) => Error::DoubleFree(*p),
            Error::StaleId {
                kind,
                index,
                generation,
            } => Error::StaleId {
                kind,
                index: *index,
                generation: *generation,
            },
            Error::InvalidState(m) => Error::InvalidState(m.clone()),
            Error::LimitExceeded {
                requested,
                used,
                limit,
            } => Error::LimitExceeded {
                requested: *requested,
                used: *used,
                limit: *limit,
            },
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::NoDriver(m) => Error::NoDriver(m.clone()),
            Error::NoDevice(d) => Error::NoDevice(*d),
            Error::Driver { call, code, name } => Error::Driver {
                call,
                code: *code,
                name: name.clone(),
            },
            Error::InjectedFault(what) => Error::InjectedFault(what),
            Error::Os { call, source } => Error::Os {
                call,
                source: match source.raw_os_error() {
                    Some(code) => std::io::Error::from_raw_os_error(code),
                    None => std::io::Error::new(source.kind(), source.to_string()),
                },
            },
            Error::Config {
                name,
                value,
                reason,
            } => Error::Config {
                name,
                value: value.clone(),
                reason: reason.clone(),
            },
            Error::Async { stream, message } => Error::Async {
                stream: *stream,
                message: message.clone(),
            },
            Error::Deferred(inner) => Error::Deferred(inner.clone()),
        }
    }
}
