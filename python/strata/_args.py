"""Argument checks before a value reaches ctypes: ctypes wraps an integer beyond its C type
silently (2**32 + 5 as a uint32_t is 5), so every integer, count and duration a strata module
hands to the library goes through these first. Out of range raises `strata.InvalidArgument`
naming the argument and its range; a value of the wrong type (a bool or float where a count is
due) raises TypeError."""

import ctypes
import math
import operator

from . import _lib
from ._status import Status

I32 = ctypes.c_int32
U32 = ctypes.c_uint32
U64 = ctypes.c_uint64
SIZE = ctypes.c_size_t


def _limits(ctype):
    bits = 8 * ctypes.sizeof(ctype)
    if ctype(-1).value == -1:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def invalid(message):
    return _lib.error(Status.INVALID_ARGUMENT, message)


def integer(value, name, ctype=U32, low=None, high=None):
    """`value` as an int within C type `ctype` and, where given, [`low`, `high`]. Raises
    InvalidArgument (naming `name` and the range) outside it, TypeError for a non-integer."""
    if isinstance(value, bool):
        raise TypeError(f"{name} is an integer, not a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} is an integer, not {type(value).__name__}") from None
    lo, hi = _limits(ctype)
    lo = lo if low is None else max(lo, low)
    hi = hi if high is None else min(hi, high)
    if not lo <= value <= hi:
        raise invalid(f"{name} is {value}: expected {lo}..{hi}")
    return value


def nanoseconds(seconds, name):
    """`seconds` (a finite number >= 0) as whole nanoseconds in a uint64_t. Raises
    InvalidArgument for NaN, infinities, negatives and durations beyond 2**64 - 1 ns, TypeError
    for a non-number."""
    if isinstance(seconds, bool):
        raise TypeError(f"{name} is a number of seconds, not a bool")
    try:
        seconds = float(seconds)
    except (TypeError, ValueError):
        raise TypeError(f"{name} is a number of seconds, not {type(seconds).__name__}") from None
    ns = seconds * 1e9
    if not (math.isfinite(ns) and 0 <= ns < 2.0**64):
        raise invalid(f"{name} is {seconds!r} s: expected a finite duration of 0..{2**64 - 1} ns")
    return min(int(ns), 2**64 - 1)


def buffer(length, name, high=None):
    """A zeroed ctypes buffer of `length` bytes (checked as `integer(length, name, SIZE, 0,
    high)`). Raises OutOfMemory when Python cannot allocate it."""
    length = integer(length, name, SIZE, 0, high)
    try:
        return ctypes.create_string_buffer(length)
    except (MemoryError, OverflowError):  # OverflowError: beyond what Python can address
        raise _lib.error(Status.OUT_OF_MEMORY, f"{name}: no host memory for {length} bytes") from None
