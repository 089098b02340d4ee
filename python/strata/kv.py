"""KV spaces: an engine's KV cache at fixed addresses, spilled to host memory and disk
(`strata_kv_*` in include/strata.h).

    import strata.kv, torch
    space = strata.kv.KvSpace(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16",
                              max_requests=64, max_tokens=8192, host_bytes=8 << 30)
    k0 = torch.from_dlpack(space.tensor(0, "k"))   # [max_requests, max_tokens, heads, dim]
    r = space.admit()
    r.append(512)                    # pages mapped for 512 tokens in every layer
    k0[r.slot, :512] = ...           # the engine writes through its own tensors
    r.spill("host")                  # pages back to the pool, bytes in host memory
    space.make_resident([r], stream) # same addresses, bytes back, ordered on the stream

Tensors are DLPack exports of the space's memory (no copy): CUDA tensors on the CUDA backend,
CPU tensors on the host backend outside strict mode. Their addresses never change while the
space lives, spilled or not (spilled blocks read as zeros with the zero page). A space with
exported tensors alive cannot be closed (InvalidState), and a tensor descriptor (`KvTensor`) of
a closed space cannot be exported (StaleHandle): no framework tensor ever outlives the memory.

Errors raise typed exceptions (strata.OutOfMemory, strata.StaleHandle, strata.InvalidState, ...).
Every integer argument is checked against its C type (and token counts against `max_tokens`)
before it reaches the library: out of range raises strata.InvalidArgument naming it, a
non-integer TypeError.
Lost-block callbacks run on the thread that called `revoke`, after strata released its locks.
"""

import copy
import ctypes
import os
import threading

from . import _args, _dlpack, _lib
from ._args import I32, U32, U64

BACKED, LOSSY = 0, 1
_KINDS = {"k": 0, "v": 1, 0: 0, 1: 1}
_DURABILITY = {"backed": BACKED, "lossy": LOSSY, BACKED: BACKED, LOSSY: LOSSY}
_TIERS = {"host": 1, "disk": 2}
_DIRECTIONS = {"in": 0, "out": 1}
_RESIDENCY = {0: "device", 1: "host", 2: "disk", 3: "lost"}

_u64 = ctypes.c_uint64
_int = ctypes.c_int
_size = ctypes.c_size_t
_vp = ctypes.c_void_p


class Config(ctypes.Structure):
    """strata_kv_config_t."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("durability", ctypes.c_int32),
        ("layers", ctypes.c_uint32),
        ("kv_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("elem_size", ctypes.c_uint32),
        ("max_requests", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("zero_page", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("host_bytes", _u64),
        ("disk_bytes", _u64),
        ("disk_dir", ctypes.c_char_p),
        ("step_time_ns", _u64),
        ("spare", _u64 * 4),
    ]


class TensorDesc(ctypes.Structure):
    """strata_kv_tensor_t."""

    _fields_ = [
        ("data", _u64),
        ("device", ctypes.c_int32),
        ("dlpack_device_type", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("elem_size", ctypes.c_uint32),
        ("shape", ctypes.c_int64 * 4),
        ("strides", ctypes.c_int64 * 4),
    ]


class RequestInfo(ctypes.Structure):
    """strata_kv_request_info_t."""

    _fields_ = [
        (name, ctypes.c_uint32)
        for name in ("slot", "tokens", "blocks", "resident", "host", "disk", "lost", "reserved")
    ]


class Stats(ctypes.Structure):
    """strata_kv_stats_t."""

    _fields_ = [
        (name, _u64)
        for name in (
            "page_size tokens_per_block block_bytes requests_admitted blocks blocks_resident "
            "blocks_spilled blocks_clean blocks_lost pool_free_pages pool_in_use_pages "
            "pool_created_pages pool_adopted_pages host_used_bytes host_capacity_bytes "
            "disk_used_bytes disk_capacity_bytes bytes_to_device bytes_from_device "
            "disk_read_bytes disk_write_bytes spills clean_spills clean_revocations restores "
            "prefetch_hits prefetch_misses stalls evictions lost_blocks pages_revoked "
            "staged_objects staged_evicted pages_ahead pages_from_ahead"
        ).split()
    ] + [("spare", _u64 * 4)]


class TokenCopy(ctypes.Structure):
    """strata_kv_token_copy_t."""

    _fields_ = [
        ("request", _u64),
        ("layer", ctypes.c_uint32),
        ("kind", ctypes.c_int32),
        ("first_token", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("address", _u64),
    ]


LostFn = ctypes.CFUNCTYPE(None, _u64, _u64, ctypes.c_uint32, _vp)

_P = ctypes.POINTER
PROTOTYPES = {
    "strata_kv_create": (_int, [_P(Config), _P(_u64)]),
    "strata_kv_destroy": (_int, [_u64]),
    "strata_kv_tensor": (_int, [_u64, ctypes.c_uint32, _int, _P(TensorDesc)]),
    "strata_kv_admit": (_int, [_u64, _P(_u64)]),
    "strata_kv_append": (_int, [_u64, _u64, ctypes.c_uint32]),
    "strata_kv_release": (_int, [_u64, _u64]),
    "strata_kv_truncate": (_int, [_u64, _u64, ctypes.c_uint32]),
    "strata_kv_request_info": (_int, [_u64, _u64, _P(RequestInfo)]),
    "strata_kv_residency": (_int, [_u64, _u64, _P(ctypes.c_uint8), _size, _P(_size)]),
    "strata_kv_write": (_int, [_u64, _u64, ctypes.c_uint32, _int, ctypes.c_uint32, _vp, _size]),
    "strata_kv_read": (
        _int,
        [_u64, _u64, ctypes.c_uint32, _int, ctypes.c_uint32, _vp, _size, _P(_int)],
    ),
    "strata_kv_copy_tokens": (_int, [_u64, _int, ctypes.c_uint32, _P(TokenCopy), _size, _vp]),
    "strata_kv_spill": (_int, [_u64, _u64, _int]),
    "strata_kv_spill_idle": (_int, [_u64, _u64, _int, _P(_u64)]),
    "strata_kv_advance": (_int, [_u64, _u64]),
    "strata_kv_queue": (_int, [_u64, _P(_u64), _size]),
    "strata_kv_hint": (_int, [_u64, _P(_u64), _P(ctypes.c_uint32), _size, _vp]),
    "strata_kv_make_resident": (_int, [_u64, _P(_u64), _size, _vp]),
    "strata_kv_stage": (_int, [_u64, _P(_u64), _size, _P(_u64)]),
    "strata_kv_take_lost": (_int, [_u64, _u64, _P(ctypes.c_uint32), _size, _P(_size)]),
    "strata_kv_on_lost": (_int, [_u64, LostFn, _vp]),
    "strata_kv_revoke": (_int, [_u64, _u64, _P(_u64)]),
    "strata_kv_stats": (_int, [_u64, _P(Stats)]),
    "strata_kv_check": (_int, [_u64]),
}



_c = _lib.binder(PROTOTYPES)


def _choice(table, value, what):
    try:
        return table[value]
    except (KeyError, TypeError):
        raise _args.invalid(f"{what} {value!r}: one of {', '.join(map(repr, table))}") from None


def _kind(kind):
    return _choice(_KINDS, kind, "kind")


def _tier(tier):
    return _choice(_TIERS, tier, "tier")



def _handles(requests):
    arr = (_u64 * max(len(requests), 1))(*[r.handle for r in requests])
    return arr, len(requests)


class KvTensor:
    """One (layer, K/V) tensor of a space, whole ([max_requests, max_tokens, heads, dim]) or one
    request's rows ([max_tokens, heads, dim]). Exported by DLPack without a copy."""

    def __init__(self, space, desc, dtype, request=None):
        self.space = space
        self.request = request
        self.dtype = dtype
        self.elem_size = desc.elem_size
        self.device = desc.device
        self.dlpack_device_type = desc.dlpack_device_type
        shape = list(desc.shape)
        strides = list(desc.strides)  # bytes
        self.data_ptr = desc.data
        if request is not None:
            self.data_ptr += request.slot * strides[0]
            shape, strides = shape[1:], strides[1:]
        self.shape = tuple(shape)
        self.byte_strides = tuple(strides)

    def __repr__(self):
        return f"KvTensor(shape={self.shape}, dtype={self.dtype}, data={self.data_ptr:#x})"

    def flat(self):
        """The same memory as one 1-D KvTensor over every element the strides reach. torch sizes a
        DLPack tensor's storage by its element count, which the extent of a padded layout
        exceeds, and the compiler's checks then refuse writes through it:
        `torch.from_dlpack(t.flat()).as_strided(t.shape, element strides)` has a storage that
        covers the view."""
        flat = copy.copy(self)
        flat.shape = (1 + sum((n - 1) * s for n, s in zip(self.shape, self.byte_strides)) // self.elem_size,)
        flat.byte_strides = (self.elem_size,)
        return flat

    def __dlpack_device__(self):
        if self.dlpack_device_type == 0:
            raise _lib.error(
                _lib.Status.UNSUPPORTED,
                "KV addresses are not CPU-accessible on the strict host backend "
                "(STRATA_HOST_STRICT=1): no DLPack export",
            )
        return (self.dlpack_device_type, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A "dltensor" capsule (DLPack 0.x). `copy=True` is refused (the point is no copy);
        the stream argument needs no synchronization: make_resident already ordered its
        copies on the stream the caller named. Raises StaleHandle once the space is closed,
        Unsupported on the strict host backend."""
        device = self.__dlpack_device__()
        if copy:
            raise BufferError("strata KV tensors are exported without a copy (copy=True)")
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"KV tensor lives on {device}, asked for {tuple(dl_device)}")
        strides = [s // self.elem_size for s in self.byte_strides]
        code_bits = _dlpack.dtype_of(self.dtype, self.elem_size)
        self.space._dlpack_exported()
        try:
            return _dlpack.capsule(
                self.space, self.data_ptr, device[0], device[1], code_bits, self.shape, strides
            )
        except BaseException:
            self.space._dlpack_released()
            raise


class Request:
    """A request of a KvSpace (its handle is stale once released)."""

    def __init__(self, space, handle):
        self.space = space
        self.handle = handle

    def __repr__(self):
        return f"Request({self.handle:#x})"

    def __eq__(self, other):
        return isinstance(other, Request) and other.handle == self.handle

    def __hash__(self):
        return hash(self.handle)

    def _call(self, name, *args):
        _lib.check(getattr(_c(), name)(self.space.handle, self.handle, *args))

    def append(self, tokens):
        """Maps the pages `tokens` more tokens need in every tensor. Raises InvalidArgument
        beyond `max_tokens` (nothing mapped), OutOfMemory when the device has no pages left."""
        self._call("strata_kv_append", _args.integer(tokens, "tokens", U32))

    def truncate(self, tokens):
        """Keeps the first `tokens` tokens: the pages past them go back to the pool (the
        addresses stay). A negative count, or more tokens than the request holds, raises
        InvalidArgument (nothing changes); a non-integer TypeError."""
        self._call("strata_kv_truncate", _args.integer(tokens, "tokens", U32))

    def release(self):
        self._call("strata_kv_release")

    def spill(self, tier="host"):
        """Moves the request's resident blocks to "host" or "disk"."""
        self._call("strata_kv_spill", _tier(tier))

    def info(self):
        i = RequestInfo()
        self._call("strata_kv_request_info", ctypes.byref(i))
        return {n: getattr(i, n) for n, _ in RequestInfo._fields_ if n != "reserved"}

    @property
    def slot(self):
        return self.info()["slot"]

    @property
    def tokens(self):
        return self.info()["tokens"]

    def residency(self):
        """Per block: "device", "host", "disk" or "lost"."""
        n = _size()
        blocks = self.info()["blocks"] + 64
        out = (ctypes.c_uint8 * blocks)()
        self._call("strata_kv_residency", out, blocks, ctypes.byref(n))
        return [_RESIDENCY[out[i]] for i in range(n.value)]

    def take_lost(self):
        """Blocks lost to revocations and not reported yet (each reported once)."""
        cap = self.info()["blocks"] + 64
        out = (ctypes.c_uint32 * cap)()
        n = _size()
        self._call("strata_kv_take_lost", out, cap, ctypes.byref(n))
        return list(out[: n.value])

    def tensor(self, layer, kind):
        """This request's rows of the (layer, kind) tensor: [max_tokens, heads, dim]."""
        return self.space.tensor(layer, kind, request=self)

    def write(self, layer, kind, first_token, data):
        """Copies whole tokens of `data` (bytes-like) in with a backend copy (strict mode too).
        Raises InvalidArgument for a layer, kind or token range outside the request."""
        layer = _args.integer(layer, "layer", U32)
        first_token = _args.integer(first_token, "first_token", U32)
        buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
        self._call("strata_kv_write", layer, _kind(kind), first_token, buf, len(data))

    def read(self, layer, kind, first_token, tokens):
        """`tokens` tokens from wherever they are, as bytes. Raises InvalidArgument for a layer,
        kind or token range outside the request."""
        layer = _args.integer(layer, "layer", U32)
        first_token = _args.integer(first_token, "first_token", U32)
        tokens = _args.integer(tokens, "tokens", U32, high=self.space.max_tokens)
        n = tokens * self.space.bytes_per_token
        buf = _args.buffer(n, "read")
        self._call("strata_kv_read", layer, _kind(kind), first_token, buf, n, None)
        return buf.raw


class KvSpace:
    """A KV space (strata_kv_create). Close it (or use `with`) to release its memory."""

    def __init__(
        self,
        layers,
        kv_heads,
        head_dim,
        dtype="float16",
        max_requests=16,
        max_tokens=4096,
        device=0,
        durability=LOSSY,
        zero_page=True,
        host_bytes=0,
        disk_bytes=0,
        disk_dir=None,
        step_time=None,
    ):
        name = str(dtype).rsplit(".", 1)[-1]
        if name not in _dlpack.DTYPES:
            raise _args.invalid(f"dtype {dtype!r}: one of {', '.join(_dlpack.DTYPES)}")
        elem_size = _dlpack.DTYPES[name][1] // 8
        c = Config()
        c.device = _args.integer(device, "device", I32)
        c.durability = _choice(_DURABILITY, durability, "durability")
        counts = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, max_requests=max_requests,
                      max_tokens=max_tokens)
        for field, value in counts.items():
            setattr(c, field, _args.integer(value, field, U32))
        c.elem_size = elem_size
        c.zero_page = 1 if zero_page else 0
        c.host_bytes = _args.integer(host_bytes, "host_bytes", U64)
        c.disk_bytes = _args.integer(disk_bytes, "disk_bytes", U64)
        c.disk_dir = os.fsencode(disk_dir) if disk_dir is not None else None
        c.step_time_ns = _args.nanoseconds(step_time, "step_time") if step_time is not None else 0
        self.dtype = name
        self.max_tokens = c.max_tokens
        self.bytes_per_token = c.kv_heads * c.head_dim * elem_size
        handle = _u64()
        _lib.check(_c().strata_kv_create(ctypes.byref(c), ctypes.byref(handle)))
        self.handle = handle.value
        self._exports = 0
        self._exports_lock = threading.Lock()
        self._close_pending = False
        self._on_lost = None  # (LostFn, python callable): kept alive while registered
        self._callback_errors = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _dlpack_exported(self):
        """Counts an export about to be handed out. Raises StaleHandle once the space is closed:
        the check and the count share the lock `close` destroys the space under, so no export
        of a destroyed space ever exists."""
        with self._exports_lock:
            if self.handle is None:
                raise _lib.error(_lib.Status.INVALID_HANDLE, "the KV space is closed: no DLPack export")
            self._exports += 1

    def _dlpack_released(self):
        with self._exports_lock:
            self._exports -= 1
            due = self._exports == 0 and self._close_pending
        if due:
            self.close_when_released()

    def close_when_released(self):
        """Destroys the space now, or, while DLPack tensors of it are alive, as soon as the last
        of them is released (an engine that shut down while its tensors live on)."""
        with self._exports_lock:
            if self._exports:
                self._close_pending = True
                return
            self._destroy()

    def close(self):
        """Destroys the space (again: nothing). Raises InvalidState while DLPack tensors of it
        are alive; once closed, exporting a tensor taken before raises StaleHandle."""
        with self._exports_lock:
            if self._exports:
                raise _lib.error(
                    _lib.Status.INVALID_STATE, f"{self._exports} DLPack tensors of this KV space are still alive"
                )
            self._destroy()

    def _destroy(self):
        # Under _exports_lock: an export in another thread waits, then finds the space closed.
        if self.handle is None:
            return
        _lib.check(_c().strata_kv_destroy(self.handle))
        self.handle = None
        self._on_lost = None

    def _space(self):
        if self.handle is None:
            raise _lib.error(_lib.Status.INVALID_HANDLE, "the KV space is closed")
        return self.handle

    def admit(self):
        h = _u64()
        _lib.check(_c().strata_kv_admit(self._space(), ctypes.byref(h)))
        return Request(self, h.value)

    def admit_many(self, count):
        """`count` requests, by ascending slot; all or none (the ones admitted are released when
        one fails). Raises InvalidArgument for a negative count."""
        count = _args.integer(count, "count", U32)
        requests = []
        try:
            for _ in range(count):
                requests.append(self.admit())
        except BaseException:
            for r in requests:
                r.release()
            raise
        requests.sort(key=lambda r: r.slot)
        return requests

    def request(self, handle):
        """The Request of a raw handle (as a lost-block callback passes it)."""
        return Request(self, handle)

    def tensor(self, layer, kind, request=None):
        """The (layer, kind) tensor's descriptor (a `KvTensor`), whole or `request`'s rows.
        Raises InvalidArgument for a layer or kind the space does not have."""
        layer = _args.integer(layer, "layer", U32)
        d = TensorDesc()
        _lib.check(_c().strata_kv_tensor(self._space(), layer, _kind(kind), ctypes.byref(d)))
        return KvTensor(self, d, self.dtype, request)

    def make_resident(self, requests, stream=None):
        """Every block of `requests` resident; `stream` waits on the copies (None: the default
        stream, which on the host backend means the copies are done on return)."""
        arr, n = _handles(list(requests))
        _lib.check(_c().strata_kv_make_resident(self._space(), arr, n, _lib.stream_handle(stream)))

    def copy_tokens(self, direction, tokens, copies, stream=None):
        """Queues copies of `tokens` tokens each between requests and memory outside the space
        (an engine's own KV blocks) on `stream`, after the requests' earlier copies; the host
        does not wait: synchronize the stream (a `strata.Stream`) before relying on the bytes
        or touching the outside memory. `direction`: "in" (into the requests) or "out".
        `copies`: (request, layer, kind, first_token, address) tuples, or a ctypes array of
        `TokenCopy` (bulk callers fill one themselves). Spills, reads and releases of those
        requests wait for the copies; "in" drops the clean copies of the blocks it writes.
        Raises InvalidArgument (nothing queued) for a count, layer, token range or address
        outside what the requests and C types hold, InvalidState for a spilled request."""
        code = _choice(_DIRECTIONS, direction, "direction")
        tokens = _args.integer(tokens, "tokens", U32)
        if isinstance(copies, ctypes.Array) and copies._type_ is TokenCopy:
            arr, n = copies, len(copies)
        else:
            copies = list(copies)
            arr, n = (TokenCopy * max(len(copies), 1))(), len(copies)
            for c, (r, layer, kind, first, address) in zip(arr, copies):
                c.request, c.layer, c.kind = r.handle, _args.integer(layer, "layer", U32), _kind(kind)
                c.first_token = _args.integer(first, "first_token", U32)
                c.address = _args.integer(address, "address", U64)
        _lib.check(
            _c().strata_kv_copy_tokens(self._space(), code, tokens, arr, n, _lib.stream_handle(stream))
        )

    def stage(self, requests):
        """Moves the disk-resident spilled blocks of `requests` up to host memory ahead of a
        `make_resident` (TierKV's first hop), only into host room nothing else needs (free, beyond
        what spilling the other resident requests would take: it never pushes a request to disk);
        returns the store objects moved (0 when nothing is on disk or no room)."""
        arr, n = _handles(list(requests))
        moved = _u64()
        _lib.check(_c().strata_kv_stage(self._space(), arr, n, ctypes.byref(moved)))
        return moved.value

    def hint(self, steps, stream=None):
        """Lookahead: `steps` is a list of the next steps' batches (lists of requests)."""
        steps = [list(s) for s in steps]
        flat = [r for s in steps for r in s]
        arr, _ = _handles(flat)
        counts = (ctypes.c_uint32 * max(len(steps), 1))(*[len(s) for s in steps])
        _lib.check(_c().strata_kv_hint(self._space(), arr, counts, len(steps), _lib.stream_handle(stream)))

    def queue(self, waiting):
        arr, n = _handles(list(waiting))
        _lib.check(_c().strata_kv_queue(self._space(), arr, n))

    def advance(self, step):
        """Moves the scheduler's step clock to `step` (a uint64_t; InvalidArgument outside)."""
        _lib.check(_c().strata_kv_advance(self._space(), _args.integer(step, "step", U64)))

    def spill_idle(self, idle_steps, tier="host"):
        """Spills every request not used for more than `idle_steps` steps (a uint64_t) to
        `tier`; returns the blocks spilled. Raises InvalidArgument for a count outside a
        uint64_t or an unknown tier."""
        idle_steps = _args.integer(idle_steps, "idle_steps", U64)
        n = _u64()
        _lib.check(
            _c().strata_kv_spill_idle(self._space(), idle_steps, _tier(tier), ctypes.byref(n))
        )
        return n.value

    def on_lost(self, callback):
        """`callback(request, block)` for each block a revocation loses (None clears). It runs on
        the thread that called `revoke`, with no strata lock held; an exception it raises is
        re-raised by that `revoke`."""
        if callback is None:
            _lib.check(_c().strata_kv_on_lost(self._space(), LostFn(), None))
            self._on_lost = None
            return

        def trampoline(_kv, request, block, _user):
            try:
                callback(Request(self, request), block)
            except BaseException as e:  # noqa: BLE001 - handed to the revoking thread
                self._callback_errors.append(e)

        fn = LostFn(trampoline)
        _lib.check(_c().strata_kv_on_lost(self._space(), fn, None))
        self._on_lost = (fn, callback)

    def revoke(self, pages):
        """Takes `pages` pages (a uint64_t; InvalidArgument outside) back to the device's pool;
        returns the blocks lost."""
        pages = _args.integer(pages, "pages", U64)
        lost = _u64()
        status = _c().strata_kv_revoke(self._space(), pages, ctypes.byref(lost))
        errors, self._callback_errors = self._callback_errors, []
        if errors:
            raise errors[0]
        _lib.check(status)
        return lost.value

    def stats(self):
        s = Stats()
        _lib.check(_c().strata_kv_stats(self._space(), ctypes.byref(s)))
        return _lib.as_dict(s)

    def check(self):
        _lib.check(_c().strata_kv_check(self._space()))
