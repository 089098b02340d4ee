//! Stable numeric status codes of the C ABI: the one source of `strata_status_t`. The header
//! (`include/strata.h`) and the Python package (`python/strata/_status.py`) repeat it; a unit
//! test below fails when either disagrees with [`Status`] (a name, a value, a missing or an
//! extra status).

use strata_vmm::Error;

/// The status every status-returning export gives back. Values never change once published;
/// 0 is success.
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
    /// The status of an error. Exhaustive: a new error variant must choose its status here.
    pub fn of(error: &Error) -> Status {
        match error {
            Error::OutOfMemory { .. }
            | Error::OutOfAddressSpace { .. }
            | Error::OutOfTierSpace { .. } => Status::OutOfMemory,
            Error::LimitExceeded { .. } => Status::LimitExceeded,
            Error::InvalidArgument(_) | Error::Overflow(_) | Error::Misaligned { .. } => {
                Status::InvalidArgument
            }
            Error::UnknownPointer(_) => Status::UnknownPointer,
            Error::DoubleFree(_) => Status::DoubleFree,
            Error::InvalidHandle { .. } | Error::StaleId { .. } => Status::InvalidHandle,
            Error::InvalidState(_) => Status::InvalidState,
            Error::AlreadyMapped { .. }
            | Error::NotMapped { .. }
            | Error::PartialUnmap { .. }
            | Error::NotReserved { .. }
            | Error::StillMapped { .. }
            | Error::IllegalAccess { .. } => Status::Mapping,
            Error::Unsupported(_) => Status::Unsupported,
            Error::NoDriver(_) | Error::NoDevice(_) => Status::NoDevice,
            Error::Driver { .. } => Status::Driver,
            Error::InjectedFault(_) => Status::InjectedFault,
            Error::Os { .. } => Status::Os,
            Error::Config { .. } => Status::Config,
            Error::Async { .. } => Status::Async,
            Error::Deferred(inner) => Status::of(inner),
        }
    }

    /// The status with numeric value `code`; unknown values are [`Status::Internal`].
    pub fn from_code(code: i32) -> Status {
        Status::ALL
            .into_iter()
            .find(|s| *s as i32 == code)
            .unwrap_or(Status::Internal)
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
                Error::OutOfTierSpace {
                    tier: "disk",
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

    /// `(name, value)` of every `NAME = VALUE` line between `start` and `end` in `text`.
    fn declared(text: &str, start: &str, end: &str, prefix: &str) -> Vec<(String, i32)> {
        let from = text.find(start).unwrap_or_else(|| panic!("no `{start}`")) + start.len();
        let to = from
            + text[from..]
                .find(end)
                .unwrap_or_else(|| panic!("no `{end}`"));
        text[from..to]
            .lines()
            .filter_map(|line| {
                let (name, rest) = line.split_once('=')?;
                let value: String = rest
                    .trim()
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                Some((format!("{prefix}{}", name.trim()), value.parse().ok()?))
            })
            .collect()
    }

    fn expected() -> Vec<(String, i32)> {
        Status::ALL
            .iter()
            .map(|s| (s.name().to_string(), *s as i32))
            .collect()
    }

    #[test]
    fn header_declares_exactly_these_statuses() {
        let header = include_str!("../../include/strata.h");
        let got = declared(
            header,
            "typedef enum strata_status_t {",
            "} strata_status_t;",
            "",
        );
        assert_eq!(got, expected(), "include/strata.h disagrees with Status");
    }

    #[test]
    fn python_declares_exactly_these_statuses() {
        let python = include_str!("../../python/strata/_status.py");
        let got = declared(
            python,
            "class Status(enum.IntEnum):",
            "@property",
            "STRATA_",
        );
        assert_eq!(
            got,
            expected(),
            "python/strata/_status.py disagrees with Status"
        );
    }

    #[test]
    fn the_parser_sees_a_disagreement() {
        let text = "enum {\n    STRATA_OK = 0,\n    STRATA_CONFIG = 15, /* c */\n};";
        let got = declared(text, "enum {", "};", "");
        assert_ne!(got, expected());
        assert_eq!(got[1], ("STRATA_CONFIG".to_string(), 15));
    }
}
