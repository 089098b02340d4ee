"""ctypes binding of libstrata.so (include/strata.h). Internal: use the functions in `strata`."""

import ctypes
import os
import pathlib
import threading

from ._status import Status


class StrataError(RuntimeError):
    """A strata call failed. `status` is the strata_status_t (a `Status`, an int), `message` its
    last error. Python code raises a subclass with the message alone (`OutOfMemory("...")`):
    the status is the subclass's own."""

    def __init__(self, *args):
        if len(args) == 1 and type(self) in STATUS_OF:
            args = (STATUS_OF[type(self)], args[0])
        if len(args) != 2:
            raise TypeError(
                f"{type(self).__name__} takes (status, message)"
                + (" or the message alone" if type(self) in STATUS_OF else "")
            )
        status, message = args
        super().__init__(message)
        self.status = Status.of(status)
        self.status_name = self.status.c_name
        self.message = message


class OutOfMemory(StrataError):
    """STRATA_OUT_OF_MEMORY: physical memory, address space or a tier is exhausted (recoverable)."""


class LimitExceeded(OutOfMemory):
    """STRATA_LIMIT_EXCEEDED: the memory-fraction cap would be exceeded."""


class InvalidArgument(StrataError, ValueError):
    """STRATA_INVALID_ARGUMENT: an argument is outside what the call accepts."""


class UnknownPointer(StrataError):
    """STRATA_UNKNOWN_POINTER: not a pointer strata handed out."""


class DoubleFree(StrataError):
    """STRATA_DOUBLE_FREE: freed twice."""


class StaleHandle(StrataError):
    """STRATA_INVALID_HANDLE: a destroyed, released or unknown handle (never someone else's)."""


class InvalidState(StrataError):
    """STRATA_INVALID_STATE: the call conflicts with the current state."""


class Unsupported(StrataError):
    """STRATA_UNSUPPORTED: the operation or backend is not available here."""


class NoDevice(StrataError):
    """STRATA_NO_DEVICE: no driver, or no such device."""


ERROR_CLASSES = {
    Status.OUT_OF_MEMORY: OutOfMemory,
    Status.LIMIT_EXCEEDED: LimitExceeded,
    Status.INVALID_ARGUMENT: InvalidArgument,
    Status.UNKNOWN_POINTER: UnknownPointer,
    Status.DOUBLE_FREE: DoubleFree,
    Status.INVALID_HANDLE: StaleHandle,
    Status.INVALID_STATE: InvalidState,
    Status.UNSUPPORTED: Unsupported,
    Status.NO_DEVICE: NoDevice,
}

STATUS_OF = {cls: status for status, cls in ERROR_CLASSES.items()}


def error(status, message):
    """The typed exception for `status` (StrataError for statuses without a subclass)."""
    status = Status.of(status)
    return ERROR_CLASSES.get(status, StrataError)(status, message)


class Stats(ctypes.Structure):
    """strata_stats_t."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("initialized", ctypes.c_int32),
        ("total_bytes", ctypes.c_uint64),
        ("page_size", ctypes.c_uint64),
        ("allocated_bytes", ctypes.c_uint64),
        ("allocated_block_bytes", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("mapped_pages", ctypes.c_uint64),
        ("cached_large_bytes", ctypes.c_uint64),
        ("pool_free_bytes", ctypes.c_uint64),
        ("peak_allocated_bytes", ctypes.c_uint64),
        ("peak_reserved_bytes", ctypes.c_uint64),
        ("live_allocations", ctypes.c_uint64),
        ("pending_blocks", ctypes.c_uint64),
        ("limit_bytes", ctypes.c_uint64),
        ("allocs", ctypes.c_uint64),
        ("frees", ctypes.c_uint64),
        ("cache_hits", ctypes.c_uint64),
        ("cache_misses", ctypes.c_uint64),
        ("ooms", ctypes.c_uint64),
        ("sleeps", ctypes.c_uint64),
        ("wakes", ctypes.c_uint64),
        ("pool_in_use_bytes", ctypes.c_uint64),
        ("lent_bytes", ctypes.c_uint64),
        ("borrowed_bytes", ctypes.c_uint64),
        ("limit_set", ctypes.c_uint64),
        ("spare", ctypes.c_uint64 * 4),
    ]


class SpillStats(ctypes.Structure):
    """strata_spill_stats_t."""

    _fields_ = [
        ("local_bytes", ctypes.c_uint64),
        ("peer_bytes", ctypes.c_uint64),
        ("host_bytes", ctypes.c_uint64),
        ("migrations_to_host", ctypes.c_uint64),
        ("migrations_to_device", ctypes.c_uint64),
        ("bytes_to_host", ctypes.c_uint64),
        ("bytes_to_device", ctypes.c_uint64),
        ("stalled_ns", ctypes.c_uint64),
        ("spare", ctypes.c_uint64 * 4),
    ]


class Revoked(ctypes.Structure):
    """strata_revoked_t."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("lender", ctypes.c_int32),
        ("to_device", ctypes.c_int32),
        ("tag_id", ctypes.c_uint32),
        ("ptr", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


class TagStats(ctypes.Structure):
    """strata_tag_stats_t."""

    _fields_ = [
        ("tag_id", ctypes.c_uint32),
        ("asleep", ctypes.c_int32),
        ("allocated_bytes", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("peak_allocated_bytes", ctypes.c_uint64),
        ("live_allocations", ctypes.c_uint64),
        ("allocs", ctypes.c_uint64),
        ("frees", ctypes.c_uint64),
        ("host_copy_bytes", ctypes.c_uint64),
        ("spare", ctypes.c_uint64 * 4),
    ]


def as_dict(struct):
    """A ctypes structure's fields as a dict (without the spare padding)."""
    return {name: getattr(struct, name) for name, _ in struct._fields_ if name != "spare"}


_c_int = ctypes.c_int
_c_void_p = ctypes.c_void_p
_c_size_t = ctypes.c_size_t
_c_char_p = ctypes.c_char_p

# name: (restype, argtypes)
PROTOTYPES = {
    "strata_version": (_c_char_p, []),
    "strata_last_error": (_c_char_p, []),
    "strata_clear_error": (None, []),
    "strata_device_count": (_c_int, []),
    "strata_malloc": (_c_void_p, [_c_size_t, _c_int, _c_void_p]),
    "strata_free": (None, [_c_void_p, _c_size_t, _c_int, _c_void_p]),
    "strata_free_checked": (_c_int, [_c_void_p, _c_size_t, _c_int, _c_void_p]),
    "strata_init": (None, [_c_int]),
    "strata_empty_cache": (None, []),
    "strata_set_memory_fraction": (None, [ctypes.c_double, _c_int]),
    "strata_record_stream": (None, [_c_void_p, _c_void_p]),
    "strata_stats": (_c_int, [_c_int, ctypes.POINTER(Stats)]),
    "strata_tag_stats": (_c_int, [_c_char_p, _c_int, ctypes.POINTER(TagStats)]),
    "strata_tag_push": (_c_int, [_c_char_p]),
    "strata_tag_pop": (_c_int, []),
    "strata_tag_depth": (_c_int, []),
    "strata_sleep": (_c_int, [_c_char_p, _c_int]),
    "strata_wake": (_c_int, [_c_char_p]),
    "strata_sleep_to_disk": (_c_int, [_c_char_p, _c_char_p]),
    "strata_offload": (_c_int, [_c_char_p, _c_int, _c_void_p]),
    "strata_onload": (_c_int, [_c_char_p, _c_void_p]),
    "strata_set_overflow": (_c_int, [_c_char_p, _c_int]),
    "strata_set_overflow_peer": (_c_int, [_c_char_p, _c_int]),
    "strata_revoke_peer": (_c_int, [_c_int, _c_void_p]),
    "strata_take_revoked": (
        _c_int,
        [ctypes.POINTER(Revoked), _c_size_t, ctypes.POINTER(_c_size_t)],
    ),
    "strata_spill_stats": (_c_int, [_c_char_p, _c_int, ctypes.POINTER(SpillStats)]),
    "strata_stream_create": (_c_int, [_c_int, ctypes.POINTER(_c_void_p)]),
    "strata_stream_destroy": (_c_int, [_c_void_p]),
    "strata_stream_synchronize": (_c_int, [_c_void_p]),
    "strata_memcpy_htod": (_c_int, [_c_void_p, _c_void_p, _c_size_t]),
    "strata_memcpy_dtoh": (_c_int, [_c_void_p, _c_void_p, _c_size_t]),
}

_lock = threading.Lock()
_lib = None
_path = None


def library_path():
    """Where libstrata.so is: $STRATA_LIB, next to this package, or a source checkout's target/."""
    env = os.environ.get("STRATA_LIB")
    if env:
        if not os.path.exists(env):
            raise OSError(f"STRATA_LIB={env!r} does not exist")
        return os.path.abspath(env)
    here = pathlib.Path(__file__).resolve().parent
    root = here.parent.parent
    candidates = [
        here / "libstrata.so",
        root / "target" / "release" / "libstrata.so",
        root / "target" / "debug" / "libstrata.so",
    ]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    raise OSError(
        "libstrata.so not found: set STRATA_LIB, or put it next to the strata package "
        "(looked at " + ", ".join(str(c) for c in candidates) + ")"
    )


def lib():
    """The loaded library with its prototypes declared (loaded once, on first use)."""
    global _lib, _path
    if _lib is None:
        with _lock:
            if _lib is None:
                path = library_path()
                handle = ctypes.CDLL(path)
                for name, (restype, argtypes) in PROTOTYPES.items():
                    fn = getattr(handle, name)
                    fn.restype = restype
                    fn.argtypes = argtypes
                _path = path
                _lib = handle
    return _lib


def binder(prototypes):
    """A function returning the library with `prototypes` ({name: (restype, argtypes)})
    declared, on first use: the modules over the optional calls (kv, params, harvest) declare
    theirs this way."""
    bound = []
    lock = threading.Lock()

    def bound_lib():
        if not bound:
            handle = lib()
            with lock:
                if not bound:
                    for name, (restype, argtypes) in prototypes.items():
                        fn = getattr(handle, name)
                        fn.restype = restype
                        fn.argtypes = argtypes
                    bound.append(handle)
        return bound[0]

    return bound_lib


def stream_handle(stream):
    """A cudaStream_t value from None, an int or a torch stream (its `cuda_stream`)."""
    if stream is None:
        return None
    return getattr(stream, "cuda_stream", stream) or None


def loaded_path():
    """The path the library was loaded from (loads it if needed)."""
    lib()
    return _path


def last_error():
    return lib().strata_last_error().decode("utf-8", "replace")


def check(status):
    """Raises the typed StrataError subclass of a non-zero status."""
    if status != 0:
        raise error(status, last_error())


def encode(name):
    """A tag name as the C API takes it. A NUL inside would cut the name short in C (another
    tag's name), so it is refused."""
    if not isinstance(name, str):
        raise TypeError(f"tag names are str, not {type(name).__name__}")
    if "\0" in name:
        raise ValueError(f"tag name {name!r} contains a NUL character")
    return name.encode("utf-8")


def function_pointer(name):
    """The address of export `name`, as PyTorch's hook setters take it."""
    return ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value


# ---- Low-level calls (tests and tools; PyTorch calls malloc/free itself) ------------------


def malloc(size, device=0, stream=None):
    """strata_malloc; returns the address (int) or raises StrataError (size 0 returns 0)."""
    l = lib()
    l.strata_clear_error()
    ptr = l.strata_malloc(size, device, stream)
    if not ptr:
        message = last_error()
        if size == 0 and not message:
            return 0
        raise error(Status.from_message(message), message)
    return ptr


def last_failure():
    """A StrataError for a call that reports failure without a status (NULL, -1): the status
    is the one its last error names."""
    message = last_error()
    return error(Status.from_message(message), message)


def free(ptr, size=0, device=0, stream=None):
    check(lib().strata_free_checked(ptr, size, device, stream))


def memcpy_htod(ptr, data):
    buf = ctypes.create_string_buffer(bytes(data), len(data))
    check(lib().strata_memcpy_htod(ptr, buf, len(data)))


def memcpy_dtoh(ptr, length):
    buf = ctypes.create_string_buffer(length)
    check(lib().strata_memcpy_dtoh(buf, ptr, length))
    return buf.raw
