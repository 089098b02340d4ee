"""strata: GPU memory virtualization on the CUDA virtual-memory API — Python side.

A thin ctypes layer over libstrata.so (no torch needed to import it):

    import strata
    strata.stats()                      # {device: {"allocated_bytes": ..., ...}}
    with strata.tag("weights"):         # allocations of this thread carry the tag
        ...
    strata.sleep("weights", keep_host_copy=True)   # pages released, addresses kept
    strata.wake("weights")                          # same addresses, contents restored

PyTorch integration lives in `strata.torch` (imports torch lazily): `strata.torch.pool(tag)`
(the MemPool route) and `strata.torch.use_globally()` (the global route). Engines reach the rest
through `strata.kv` (KV spaces: tensors at fixed addresses, exported by DLPack, spilled to host
memory and disk), `strata.params` (MIRAGE parameter remapping) and `strata.harvest` (peer
memory). Failures raise subclasses of StrataError (OutOfMemory, StaleHandle, InvalidArgument, ...);
a device number or count outside its C type is InvalidArgument before it reaches the library.

The library is found through $STRATA_LIB, next to this package, or in a source checkout's
target/release or target/debug.
"""

import contextlib
import ctypes
import os

from . import _args, _lib
from ._lib import (
    DoubleFree,
    InvalidArgument,
    InvalidState,
    LimitExceeded,
    NoDevice,
    OutOfMemory,
    StaleHandle,
    StrataError,
    UnknownPointer,
    Unsupported,
    library_path,
)
from ._status import Status

__all__ = [
    "DoubleFree",
    "InvalidArgument",
    "InvalidState",
    "LimitExceeded",
    "NoDevice",
    "OutOfMemory",
    "StaleHandle",
    "Status",
    "Stream",
    "StrataError",
    "UnknownPointer",
    "Unsupported",
    "device_count",
    "empty_cache",
    "library_path",
    "offload",
    "onload",
    "set_memory_fraction",
    "set_overflow",
    "set_overflow_peer",
    "revoke_peer",
    "sleep",
    "spill_stats",
    "stats",
    "tag",
    "tag_stats",
    "take_revoked",
    "version",
    "wake",
]


def version():
    """The library's version string."""
    return _lib.lib().strata_version().decode()


def device_count():
    """Number of devices of the backend strata uses."""
    n = _lib.lib().strata_device_count()
    if n < 0:
        raise _lib.last_failure()
    return n


def stats(device=None):
    """Per-device figures: {device: {field: value}} (strata_stats_t), or one device's dict."""
    devices = range(device_count()) if device is None else [_args.integer(device, "device", _args.I32)]
    out = {}
    for d in devices:
        s = _lib.Stats()
        _lib.check(_lib.lib().strata_stats(d, s))
        out[d] = _lib.as_dict(s)
    return out if device is None else out[devices[0]]


def tag_stats(name, device=0):
    """Figures of tag `name` on `device` (strata_tag_stats_t) as a dict."""
    s = _lib.TagStats()
    device = _args.integer(device, "device", _args.I32)
    _lib.check(_lib.lib().strata_tag_stats(_lib.encode(name), device, s))
    return _lib.as_dict(s)


@contextlib.contextmanager
def tag(name):
    """Allocations the calling thread makes inside the block carry tag `name`."""
    _lib.check(_lib.lib().strata_tag_push(_lib.encode(name)))
    try:
        yield
    finally:
        _lib.check(_lib.lib().strata_tag_pop())


def _names(tags):
    if isinstance(tags, str):
        return [tags]
    names = list(tags)
    for n in names:
        _lib.encode(n)
    return names


def sleep(tags, keep_host_copy=True, disk_dir=None):
    """Puts each tag to sleep: copies its live allocations to host memory (if keep_host_copy),
    or into a file in directory `disk_dir` (if given: host memory holds only the chunks in
    flight), releases its pages, keeps its addresses. All or nothing: on failure the tags
    already put to sleep by this call are woken again and StrataError is raised."""
    names = _names(tags)
    done = []
    try:
        for n in names:
            if disk_dir is not None:
                _lib.check(_lib.lib().strata_sleep_to_disk(_lib.encode(n), os.fsencode(disk_dir)))
            else:
                _lib.check(_lib.lib().strata_sleep(_lib.encode(n), 1 if keep_host_copy else 0))
            done.append(n)
    except BaseException:
        for n in reversed(done):
            _lib.lib().strata_wake(_lib.encode(n))
        raise


def wake(tags):
    """Wakes each tag: fresh pages at the same addresses, contents restored from host memory or
    disk (zeros if it slept without copies)."""
    for n in _names(tags):
        _lib.check(_lib.lib().strata_wake(_lib.encode(n)))


_TIERS = {"host": 1, "disk": 2}


def _stream(stream):
    """A stream handle for the C ABI: None (the default stream), an int, or an object with
    `cuda_stream` (torch.cuda.Stream)."""
    if stream is None:
        return None
    return getattr(stream, "cuda_stream", stream)


class Stream:
    """A stream of strata's backend on `device` (strata_stream_create: a real CUstream on CUDA,
    a worker thread on the host backend): copies queued on it run in order, apart from the
    caller. Pass it wherever a stream is taken; close it (or use `with`) when done."""

    def __init__(self, device=0):
        handle = ctypes.c_void_p()
        device = _args.integer(device, "device", _args.I32)
        _lib.check(_lib.lib().strata_stream_create(device, ctypes.byref(handle)))
        self.cuda_stream = handle.value

    def synchronize(self):
        """Waits for the work queued on the stream; raises a copy's failure."""
        _lib.check(_lib.lib().strata_stream_synchronize(self._handle()))

    def close(self):
        """Destroys the stream once its work completes (idempotent)."""
        if self.cuda_stream is not None:
            handle, self.cuda_stream = self.cuda_stream, None
            _lib.check(_lib.lib().strata_stream_destroy(handle))

    def _handle(self):
        if self.cuda_stream is None:
            raise _lib.error(_lib.Status.INVALID_HANDLE, "the stream is closed")
        return self.cuda_stream

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def offload(tags, tier="host", stream=None):
    """Moves each tag's live allocations to `tier` at the same addresses: "host" (host memory
    mapped for the device: pointers and tensors stay usable, slower; copies ordered on
    `stream`) or "disk" (a sleep to a file in TMPDIR: unusable until onload)."""
    if tier not in _TIERS:
        raise _lib.error(_lib.Status.INVALID_ARGUMENT, f"tier {tier!r}: one of {', '.join(_TIERS)}")
    for n in _names(tags):
        _lib.check(_lib.lib().strata_offload(_lib.encode(n), _TIERS[tier], _stream(stream)))


def onload(tags, stream=None):
    """Brings each tag's allocations back onto the device's own memory at the same addresses
    (copies ordered on `stream`; a tag offloaded to disk is woken)."""
    for n in _names(tags):
        _lib.check(_lib.lib().strata_onload(_lib.encode(n), _stream(stream)))


def set_overflow(tags, tier="host"):
    """Lets each tag's allocations overflow onto host memory when a device is out of memory
    or at its `set_memory_fraction` cap (tier "host"), or stops it (tier None). Off by
    default."""
    code = 0 if tier is None else _TIERS.get(tier)
    if code is None or code == _TIERS["disk"]:
        raise _lib.error(_lib.Status.INVALID_ARGUMENT, f"overflow tier {tier!r}: 'host' or None")
    for n in _names(tags):
        _lib.check(_lib.lib().strata_set_overflow(_lib.encode(n), code))


def set_overflow_peer(tags, lender):
    """Lets each tag's allocations on every device in use but `lender` overflow onto
    `lender`'s pages (borrowed memory) when their device is out of memory. `set_overflow(tag,
    None)` or a `revoke_peer(lender)` turns it off."""
    lender = _args.integer(lender, "lender", _args.I32)
    for n in _names(tags):
        _lib.check(_lib.lib().strata_set_overflow_peer(_lib.encode(n), lender))


def revoke_peer(lender, stream=None):
    """Device `lender` takes its pages back: allocations on them move to their own device's
    memory (or host memory when it is full) at the same addresses, contents kept (copies
    ordered on `stream`). Returns the moves, as `take_revoked` would."""
    lender = _args.integer(lender, "lender", _args.I32)
    _lib.check(_lib.lib().strata_revoke_peer(lender, _stream(stream)))
    return take_revoked()


def take_revoked():
    """The revocation notices not taken yet, oldest first, each handed out once: dicts with
    `device`, `lender`, `to_device` (True: onto the device's own memory; False: host memory),
    `tag_id`, `ptr` and `bytes`."""
    out = []
    batch = (_lib.Revoked * 64)()
    while True:
        count = ctypes.c_size_t()
        _lib.check(_lib.lib().strata_take_revoked(batch, len(batch), ctypes.byref(count)))
        for r in batch[: count.value]:
            notice = _lib.as_dict(r)
            notice["to_device"] = bool(notice["to_device"])
            out.append(notice)
        if count.value < len(batch):
            return out


def spill_stats(name=None, device=0):
    """Tier bytes (local, peer, host) and migrations of tag `name` on `device`, or of the
    whole device when `name` is None (strata_spill_stats_t) as a dict."""
    s = _lib.SpillStats()
    tag = None if name is None else _lib.encode(name)
    device = _args.integer(device, "device", _args.I32)
    _lib.check(_lib.lib().strata_spill_stats(tag, device, s))
    return _lib.as_dict(s)


def empty_cache():
    """Returns cached pages of every device to the driver (what torch.cuda.empty_cache triggers
    on the global route)."""
    l = _lib.lib()
    l.strata_clear_error()
    l.strata_empty_cache()
    if _lib.last_error():
        raise _lib.last_failure()


def set_memory_fraction(fraction, device=0):
    """Caps all strata holds of `device`'s own memory (pages mapped for allocations, KV
    spaces and parameters, and the pool's free pages) at `fraction` of it; 1 lifts the cap.
    Host memory and peer pages behind strata's addresses (offload, overflow) do not count.
    Past it, mapping more raises `LimitExceeded` (an `OutOfMemory`), except for a tag set to
    overflow, which goes on there."""
    device = _args.integer(device, "device", _args.I32)
    l = _lib.lib()
    l.strata_clear_error()
    l.strata_set_memory_fraction(fraction, device)
    if _lib.last_error():
        raise _lib.last_failure()
