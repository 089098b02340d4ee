"""Harvest: opportunistic allocations in peer GPUs' spare memory, revoked when the owner needs
it back (`strata_harvest_*` in include/strata.h).

    import strata.harvest as harvest
    a = harvest.alloc(64 << 20, requester=0, durability="lossy")
    a.on_revoke(lambda alloc, lost: print("revoked", alloc, "lost" if lost else "backed"))
    a.write(0, b"...")
    harvest.reclaim(peer=a.device, nbytes=64 << 20)   # the owner takes it back: callback runs

No room on any peer raises strata.OutOfMemory (a normal outcome: use host memory). A freed or
revoked allocation is stale: every later use raises strata.StaleHandle. Sizes, offsets and
devices are checked against their C types first: out of range raises strata.InvalidArgument. Revocation callbacks run
once, on the thread whose call revoked the allocation, with no strata lock held.
"""

import ctypes
import threading

from . import _args, _lib
from ._args import I32, SIZE, U64

BACKED, LOSSY = 0, 1


class Handle(ctypes.Structure):
    """strata_harvest_handle_t."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("ptr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("id", ctypes.c_uint64),
    ]


class Hints(ctypes.Structure):
    """strata_harvest_hints_t."""

    _fields_ = [
        ("requester", ctypes.c_int32),
        ("durability", ctypes.c_int32),
        ("direct_only", ctypes.c_int32),
        ("preferred_count", ctypes.c_int32),
        ("preferred", ctypes.POINTER(ctypes.c_int32)),
    ]


RevokeFn = ctypes.CFUNCTYPE(None, ctypes.POINTER(Handle), ctypes.c_int, ctypes.c_void_p)

_P = ctypes.POINTER
PROTOTYPES = {
    "strata_harvest_alloc": (ctypes.c_int, [ctypes.c_size_t, _P(Hints), _P(Handle)]),
    "strata_harvest_free": (ctypes.c_int, [_P(Handle)]),
    "strata_harvest_on_revoke": (ctypes.c_int, [_P(Handle), RevokeFn, ctypes.c_void_p]),
    "strata_harvest_reclaim": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64, _P(ctypes.c_uint64)]),
    "strata_harvest_write": (
        ctypes.c_int,
        [_P(Handle), ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t],
    ),
    "strata_harvest_read": (
        ctypes.c_int,
        [_P(Handle), ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t],
    ),
}

_lock = threading.Lock()
# Registered callbacks, kept alive until they ran: key -> (RevokeFn, Allocation, callable).
_callbacks = {}
_next_key = 0


_c = _lib.binder(PROTOTYPES)


def _durability(d):
    value = {"backed": BACKED, "lossy": LOSSY}.get(d, d)
    if value not in (BACKED, LOSSY):
        raise _lib.error(_lib.Status.INVALID_ARGUMENT, f"durability {d!r}: 'backed' or 'lossy'")
    return value


class Allocation:
    """A harvested allocation: `device` (the lending peer), `ptr`, `size` (pages), `id`."""

    def __init__(self, handle):
        self._handle = handle
        self._keys = []  # this allocation's registered callbacks (dropped by free)

    device = property(lambda self: self._handle.device)
    ptr = property(lambda self: self._handle.ptr)
    size = property(lambda self: self._handle.size)
    id = property(lambda self: self._handle.id)

    def __repr__(self):
        return f"harvest.Allocation(device={self.device}, ptr={self.ptr:#x}, size={self.size})"

    def free(self):
        """Returns the pages after the in-flight copies (no callback runs)."""
        _lib.check(_c().strata_harvest_free(ctypes.byref(self._handle)))
        with _lock:
            for key in self._keys:
                _callbacks.pop(key, None)

    def on_revoke(self, callback):
        """`callback(allocation, lost)` once when the allocation is revoked (`lost` is True for
        lossy data). An exception it raises is printed, not propagated (it runs inside the
        revoking call)."""
        global _next_key
        with _lock:
            _next_key += 1
            key = _next_key

        def trampoline(_handle, lost, user):
            with _lock:
                entry = _callbacks.pop(user, None)
            if entry is not None:
                entry[2](entry[1], bool(lost))

        fn = RevokeFn(trampoline)
        with _lock:
            _callbacks[key] = (fn, self, callback)
            self._keys.append(key)
        status = _c().strata_harvest_on_revoke(ctypes.byref(self._handle), fn, key)
        if status != 0:
            with _lock:
                _callbacks.pop(key, None)
            _lib.check(status)

    def write(self, offset, data):
        """Copies the bytes-like `data` in at `offset`. Raises InvalidArgument for a range
        outside the allocation, StaleHandle once it was freed or revoked."""
        offset = _args.integer(offset, "offset", U64)
        buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
        _lib.check(_c().strata_harvest_write(ctypes.byref(self._handle), offset, buf, len(data)))

    def read(self, offset, length):
        """`length` bytes at `offset`. Raises InvalidArgument for a range outside the
        allocation, StaleHandle once it was freed or revoked."""
        offset = _args.integer(offset, "offset", U64)
        buf = _args.buffer(length, "length", high=self.size)
        _lib.check(_c().strata_harvest_read(ctypes.byref(self._handle), offset, buf, len(buf)))
        return buf.raw


def alloc(size, requester=0, durability="backed", direct_only=False, preferred=()):
    """Allocates `size` bytes on the best-fit peer of `requester`. Raises OutOfMemory when no
    peer has room, InvalidArgument for a size or device outside its C type."""
    size = _args.integer(size, "size", SIZE)
    requester = _args.integer(requester, "requester", I32)
    preferred = [_args.integer(d, "preferred device", I32) for d in preferred]
    arr = (ctypes.c_int32 * max(len(preferred), 1))(*preferred)
    hints = Hints(requester, _durability(durability), 1 if direct_only else 0, len(preferred), arr)
    handle = Handle()
    _lib.check(_c().strata_harvest_alloc(size, ctypes.byref(hints), ctypes.byref(handle)))
    return Allocation(handle)


def reclaim(peer, nbytes):
    """The owner of device `peer` takes at least `nbytes` back; returns the bytes revoked.
    Raises InvalidArgument for a device or byte count outside its C type."""
    peer = _args.integer(peer, "peer", I32)
    nbytes = _args.integer(nbytes, "nbytes", U64)
    revoked = ctypes.c_uint64()
    _lib.check(_c().strata_harvest_reclaim(peer, nbytes, ctypes.byref(revoked)))
    return revoked.value
