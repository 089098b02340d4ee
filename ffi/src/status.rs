//! Stable numeric status codes of the C ABI (`strata_status_t` in `include/strata.h`).

use strata_vmm::Error;

/// The status every status-returning export gives back. Values are stable: they equal
/// [`Error::code`] for every error, never change once published, and 0 is success. The header
/// repeats them; a unit test checks the two agree.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types, dead_code)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// Physical memory or virtual address space exhausted (a normal, recoverable outcome).
    OutOfMemory = 1,
    /// A limit (`strata_set_memory_fraction`) would be exceeded.
    LimitExceeded = 2,
    /// An argument is outside what the call accepts (NULL, bad UTF-8, absurd size, ...).
    InvalidArgument = 3,
    /// A pointer this library did not hand out (or an interior pointer).
    UnknownPointer = 4,
    /// A pointer freed twice.
    DoubleFree = 5,
    /// An unknown or released handle (stream, event) or a stale id.
    InvalidHandle = 6,
    /// The call conflicts with the current state (e.g. allocating under a sleeping tag).
    InvalidState = 7,
    /// A virtual-memory mapping rule was broken (internal: mapped, not mapped, partial unmap).
    Mapping = 8,
    /// The operation or backend is not available here.
    Unsupported = 9,
    /// No CUDA driver, or no such device.
    NoDevice = 10,
    /// A CUDA driver call failed.
    Driver = 11,
    /// A fault injected by the host backend's test fault plan.
    InjectedFault = 12,
    /// An operating-system call failed.
    Os = 13,
    /// A configuration (environment) value could not be parsed.
    Config = 14,
    /// Asynchronous work failed; reported at a synchronization point.
    Async = 15,
    /// A bug inside strata was caught at the boundary (a panic); the message says where.
    Internal = 16,
}

impl Status {
    /// The status of an error (its [`Error::code`]).
    pub fn of(error: &Error) -> Status {
        Status::from_code(error.code())
    }

    /// The status with numeric value `code`; unknown values are [`Status::Internal`].
    pub fn from_code(code: i32) -> Status {
        match code {
            0 => Status::Ok,
            1 => Status::OutOfMemory,
            2 => Status::LimitExceeded,
            3 => Status::InvalidArgument,
            4 => Status::UnknownPointer,
            5 => Status::DoubleFree,
            6 => Status::InvalidHandle,
            7 => Status::InvalidState,
            8 => Status::Mapping,
            9 => Status::Unsupported,
            10 => Status::NoDevice,
            11 => Status::Driver,
            12 => Status::InjectedFault,
            13 => Status::Os,
            14 => Status::Config,
            15 => Status::Async,
            _ => Status::Internal,
        }
    }

    /// The constant's name in `include/strata.h`.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "STRATA_OK",
            Status::OutOfMemory => "STRATA_OUT_OF_MEMORY",
            Status::LimitExceeded => "STRATA_LIMIT_EXCEEDED",
            Status::InvalidArgument => "STRATA_INVALID_ARGUMENT",
            Status::UnknownPointer => "STRATA_UNKNOWN_POINTER",
            Status::DoubleFree => "STRATA_DOUBLE_FREE",
            Status::InvalidHandle => "STRATA_INVALID_HANDLE",
            Status::InvalidState => "STRATA_INVALID_STATE",
            Status::Mapping => "STRATA_MAPPING",
            Status::Unsupported => "STRATA_UNSUPPORTED",
            Status::NoDevice => "STRATA_NO_DEVICE",
            Status::Driver => "STRATA_DRIVER",
            Status::InjectedFault => "STRATA_INJECTED_FAULT",
            Status::Os => "STRATA_OS",
            Status::Config => "STRATA_CONFIG",
            Status::Async => "STRATA_ASYNC",
            Status::Internal => "STRATA_INTERNAL",
        }
    }

    /// Every status, in numeric order.
    pub const ALL: [Status; 17] = [
        Status::Ok,
        Status::OutOfMemory,
        Status::LimitExceeded,
        Status::InvalidArgument,
        Status::UnknownPointer,
        Status::DoubleFree,
        Status::InvalidHandle,
        Status::InvalidState,
        Status::Mapping,
        Status::Unsupported,
        Status::NoDevice,
        Status::Driver,
        Status::InjectedFault,
        Status::Os,
        Status::Config,
        Status::Async,
        Status::Internal,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_vmm::Location;

    #[test]
    fn statuses_round_trip_and_match_error_codes() {
        for (i, s) in Status::ALL.iter().enumerate() {
            assert_eq!(*s as i32, i as i32);
            assert_eq!(Status::from_code(i as i32), *s);
        }
        assert_eq!(Status::from_code(99), Status::Internal);
        let cases = [
            (
                Error::OutOfMemory {
                    location: Location::Device(0),
                    requested: 1,
                    available: 0,
                },
                Status::OutOfMemory,
            ),
            (
                Error::LimitExceeded {
                    requested: 1,
                    used: 1,
                    limit: 1,
                },
                Status::LimitExceeded,
            ),
            (Error::InvalidArgument("x".into()), Status::InvalidArgument),
            (Error::UnknownPointer(1), Status::UnknownPointer),
            (Error::DoubleFree(1), Status::DoubleFree),
            (Error::InvalidState("x".into()), Status::InvalidState),
            (Error::NoDevice(3), Status::NoDevice),
            (Error::Unsupported("x".into()), Status::Unsupported),
            (
                Error::Deferred(Box::new(Error::DoubleFree(1))),
                Status::DoubleFree,
            ),
        ];
        for (e, s) in cases {
            assert_eq!(Status::of(&e), s, "{e}");
        }
    }

    #[test]
    fn header_declares_every_status_with_its_value() {
        let header = include_str!("../../include/strata.h");
        for s in Status::ALL {
            let decl = format!("{} = {},", s.name(), s as i32);
            assert!(header.contains(&decl), "strata.h lacks `{decl}`");
        }
    }
}
