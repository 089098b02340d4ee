"""MIRAGE parameters (`strata_params_*` in include/strata.h): a model's layers as strata
parameter memory with a host copy as authority. Under KV pressure the device's remapping
controller gives idle models' layer pages to the pool KV spaces grow from, and takes them back
when pressure falls; streamed layers are reloaded into slots by `prepare_layer`.

    import strata.params as params
    m = params.register([layer0_bytes, layer1_bytes, ...], cap=8)   # idle until set_active
    m.report_compute(per_layer_seconds=0.002)
    m.report_prefill(seconds=0.05)            # optional: an idle model's budget (MIRAGE 5.3)
    params.step(device=0, pages_short=64)     # e.g. after a KV space raised OutOfMemory
    m.prepare_layer(3, stream); ...; m.layer_done(3, stream)
    m.prepare_next(3)                         # look-ahead: the next streamed layer loads now
    params.step(device=0, pages_short=0)      # revert what the device has room for

Every integer is checked against its C type before it reaches the library, and durations must
be finite and >= 0: out of range raises strata.InvalidArgument naming the argument, a
non-number TypeError.
"""

import ctypes

from . import _args, _lib
from ._args import I32, U32, U64

_u64 = ctypes.c_uint64
_int = ctypes.c_int
_vp = ctypes.c_void_p


class ModelStats(ctypes.Structure):
    """strata_params_model_stats_t."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("layers", ctypes.c_uint32),
        ("layer_bytes", _u64),
        ("pages_per_layer", _u64),
        ("remapped_layers", ctypes.c_uint32),
        ("streamed_layers", ctypes.c_uint32),
        ("slots", ctypes.c_uint32),
        ("remap_limit", ctypes.c_uint32),
        ("gpu_pages", _u64),
        ("transfer_ns", _u64),
        ("streamed_runs", _u64),
        ("slot_loads", _u64),
        ("loads_ahead", _u64),
        ("found_prepared", _u64),
        ("load_waits", _u64),
        ("spare", _u64 * 4),
    ]


_P = ctypes.POINTER
PROTOTYPES = {
    "strata_params_register": (
        _int,
        [_int, ctypes.c_uint32, _u64, ctypes.c_uint32, _P(_vp), _P(_u64)],
    ),
    "strata_params_layer_ptr": (_int, [_u64, ctypes.c_uint32, _P(_u64)]),
    "strata_params_set_active": (_int, [_u64, _int]),
    "strata_params_report_compute": (_int, [_u64, _u64]),
    "strata_params_report_prefill": (_int, [_u64, _u64]),
    "strata_params_prepare_next": (_int, [_u64, ctypes.c_uint32, _P(ctypes.c_uint32)]),
    "strata_params_step": (_int, [_int, _u64, _P(ctypes.c_uint32)]),
    "strata_params_revert_all": (_int, [_int]),
    "strata_params_prepare_layer": (_int, [_u64, ctypes.c_uint32, _vp]),
    "strata_params_layer_done": (_int, [_u64, ctypes.c_uint32, _vp]),
    "strata_params_read": (_int, [_u64, ctypes.c_uint32, _u64, _vp, ctypes.c_size_t]),
    "strata_params_model_stats": (_int, [_u64, _P(ModelStats)]),
    "strata_params_unregister": (_int, [_u64, _P(_u64)]),
}

NO_LAYER = 0xFFFF_FFFF  # STRATA_PARAMS_NO_LAYER

_c = _lib.binder(PROTOTYPES)


class Model:
    """A registered model (its handle stays valid until `unregister`)."""

    def __init__(self, handle):
        self.handle = handle

    def __repr__(self):
        return f"params.Model({self.handle:#x})"

    def layer_ptr(self, layer):
        """The address `layer`'s parameters are at now. Raises InvalidArgument for a layer the
        model does not have, InvalidState for a streamed layer in no slot."""
        out = _u64()
        _lib.check(_c().strata_params_layer_ptr(self.handle, _args.integer(layer, "layer", U32), ctypes.byref(out)))
        return out.value

    def set_active(self, active=True):
        _lib.check(_c().strata_params_set_active(self.handle, 1 if active else 0))

    def report_compute(self, per_layer_seconds):
        """T_c, the compute time of one layer. Raises InvalidArgument for NaN, an infinity or a
        negative time."""
        ns = _args.nanoseconds(per_layer_seconds, "per_layer_seconds")
        _lib.check(_c().strata_params_report_compute(self.handle, ns))

    def report_prefill(self, seconds):
        """The model's prefill time: its compute budget while idle (without it, layers x T_c).
        Raises InvalidArgument for NaN, an infinity or a negative time."""
        _lib.check(_c().strata_params_report_prefill(self.handle, _args.nanoseconds(seconds, "seconds")))

    def prepare_next(self, after):
        """The look-ahead: queues the load of the next streamed layer after `after` (ring order)
        into a slot that can take it now, and returns that layer (also when it is in a slot
        already); None when nothing streams or no slot is free of running layers. Nothing
        waits for the load until `prepare_layer` asks for the layer. Raises InvalidArgument for
        a layer the model does not have."""
        out = ctypes.c_uint32()
        after = _args.integer(after, "after", U32)
        _lib.check(_c().strata_params_prepare_next(self.handle, after, ctypes.byref(out)))
        return None if out.value == NO_LAYER else out.value

    def prepare_layer(self, layer, stream=None):
        """Makes `layer` ready; `stream` waits for its reload (None: the default stream). Raises
        InvalidArgument for a layer the model does not have."""
        layer = _args.integer(layer, "layer", U32)
        _lib.check(_c().strata_params_prepare_layer(self.handle, layer, _lib.stream_handle(stream)))

    def layer_done(self, layer, stream=None):
        """Reports `layer`'s kernels queued on `stream`: its slot may take another layer once
        they ran. Raises InvalidArgument for a layer the model does not have."""
        layer = _args.integer(layer, "layer", U32)
        _lib.check(_c().strata_params_layer_done(self.handle, layer, _lib.stream_handle(stream)))

    def read(self, layer, offset, length):
        """`length` bytes of `layer` at `offset`, wherever it is now (a backend copy). Raises
        InvalidArgument for a range outside the layer."""
        layer = _args.integer(layer, "layer", U32)
        offset = _args.integer(offset, "offset", U64)
        buf = _args.buffer(length, "length", high=self.stats()["layer_bytes"])
        _lib.check(_c().strata_params_read(self.handle, layer, offset, buf, len(buf)))
        return buf.raw

    def stats(self):
        s = ModelStats()
        _lib.check(_c().strata_params_model_stats(self.handle, ctypes.byref(s)))
        return _lib.as_dict(s)

    def unregister(self):
        """Gives every page the model holds back to the device's pool and returns how many;
        the model is unusable afterwards. Raises `InvalidState` (nothing changed) while it is
        active or a slot holds a layer not reported done (`layer_done`)."""
        out = _u64()
        _lib.check(_c().strata_params_unregister(self.handle, ctypes.byref(out)))
        return out.value


def register(layers, cap, device=0):
    """Registers a model whose layer i holds the bytes-like `layers[i]` (all the same length);
    the bytes are copied into strata's host copy, the authority. Idle until `set_active`. Raises
    InvalidArgument for layers of different lengths or a count, `cap` or `device` outside its C
    type, NoDevice for a device that does not exist."""
    cap = _args.integer(cap, "cap", U32)
    device = _args.integer(device, "device", I32)
    layers = [bytes(layer) for layer in layers]
    if not layers or len({len(layer) for layer in layers}) != 1:
        raise _args.invalid("layers must be a non-empty list of equal-length byte strings")
    _args.integer(len(layers), "len(layers)", U32)
    keep = [ctypes.create_string_buffer(layer, len(layer)) for layer in layers]
    ptrs = (_vp * len(keep))(*[ctypes.cast(b, _vp) for b in keep])
    out = _u64()
    _lib.check(
        _c().strata_params_register(
            device, len(layers), len(layers[0]), cap, ptrs, ctypes.byref(out)
        )
    )
    return Model(out.value)


def step(device=0, pages_short=0):
    """One controller step; returns the number of models changed. `pages_short` > 0: remap idle
    models' layers until that many pages are free; 0: dynamic reversion, remapped layers come
    back while the pool's free pages and the room left on the device cover them. Raises
    InvalidArgument for a device or page count outside its C type (nothing moves)."""
    device = _args.integer(device, "device", I32)
    pages_short = _args.integer(pages_short, "pages_short", U64)
    n = ctypes.c_uint32()
    _lib.check(_c().strata_params_step(device, pages_short, ctypes.byref(n)))
    return n.value


def revert_all(device=0):
    """Every remapped layer of every model on `device` back at its own address. Raises
    InvalidArgument for a device outside an int32_t, OutOfMemory when the pages cannot be had."""
    _lib.check(_c().strata_params_revert_all(_args.integer(device, "device", I32)))
