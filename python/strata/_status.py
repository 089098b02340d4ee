"""strata_status_t, the status of a strata call (include/strata.h).

`ffi/src/status.rs` is the source of these values; its unit tests fail when this copy or the
header disagrees with it.
"""

import enum
import re


class Status(enum.IntEnum):
    """A strata call's status; 0 is success. `c_name` is the header's constant."""

    OK = 0
    OUT_OF_MEMORY = 1
    LIMIT_EXCEEDED = 2
    INVALID_ARGUMENT = 3
    UNKNOWN_POINTER = 4
    DOUBLE_FREE = 5
    INVALID_HANDLE = 6
    INVALID_STATE = 7
    MAPPING = 8
    UNSUPPORTED = 9
    NO_DEVICE = 10
    DRIVER = 11
    INJECTED_FAULT = 12
    OS = 13
    CONFIG = 14
    ASYNC = 15
    INTERNAL = 16

    @property
    def c_name(self):
        return "STRATA_" + self.name

    @classmethod
    def of(cls, code):
        """The status of numeric `code`; unknown values are INTERNAL."""
        try:
            return cls(code)
        except ValueError:
            return cls.INTERNAL

    @classmethod
    def from_message(cls, message):
        """The status a last-error message names: the library ends every message with the
        status's constant in parentheses, e.g. "... (STRATA_CONFIG)". INTERNAL if none."""
        found = re.search(r"\((STRATA_[A-Z_]+)\)\s*$", message)
        if found:
            name = found.group(1)[len("STRATA_"):]
            if name in cls.__members__:
                return cls[name]
        return cls.INTERNAL
