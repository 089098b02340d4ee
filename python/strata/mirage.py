"""MIRAGE for torch models: a model's decoder layers live in strata parameter memory
(`strata.params`), and when another model's KV cache runs out of pages the idle model's layer
pages become KV pages; when the idle model runs again its remapped layers stream back from
their host copies through the forward hooks, the next one loading while the current one
computes, and its outputs are unchanged. When pressure falls the layers come back.

    import strata.mirage as mirage
    from strata.transformers import StrataCache

    chat = mirage.ModelParams(chat_model)      # its layers' parameters move into strata memory
    code = mirage.ModelParams(code_model)
    with chat.serving():                       # chat serves (remapped last), code is idle
        cache = StrataCache(chat_model.config, 4096, on_out_of_memory=mirage.reclaim)
        chat_model.generate(..., past_key_values=cache)   # may take code's layer pages as KV
    with code.serving():
        code_model.generate(...)               # code's remapped layers stream through slots
    cache.close()
    with code.serving():                       # pressure fell: code's layers are back
        ...
    mirage.revert()                            # or all at once, whatever the pressure

Which layers: the decoder's `layers` (`model.get_decoder().layers`; every layer with the same
parameters, as in Llama, Mistral, Qwen2 or Mixtral). Embeddings, the final norm and the LM head
stay where they are. Each layer's parameters are packed into one strata layer (each tensor at a
64-byte aligned offset) and the model's `Parameter`s become views of it (DLPack, no copy): CUDA
tensors on the CUDA backend, CPU tensors on the host backend outside strict mode.

When (MIRAGE's Algorithm 1, one controller step per device, `strata_params_step`): a
`StrataCache` out of pages calls `reclaim(pages_short)` (its `on_out_of_memory`), which remaps
idle models' layers first, up to each model's `cap` and within its timing budget
`T_T · N ≤ T_compute` (`T_T`: strata's measured host → device time of one layer; `T_compute`:
an active model's per-token compute `layers · T_c`, an idle model's prefill time when known).
`T_c` and the prefill time are measured here between the layer hooks on the CPU, or given as
`compute_per_layer` and `prefill` (on CUDA, where kernels run asynchronously, only the given
ones count); a model has no budget until it has run once or was given them. Dynamic reversion:
`reclaim(0)`, run by every `serving()` (or `set_active(True)`), brings remapped layers back
while the pool's free pages and the room left on the device (under `set_memory_fraction`'s cap)
cover them; `revert()` brings every layer back at once.

Streaming: a remapped model streams `m = α + β` evenly spaced layers through `β` slots (Eq. 4
or 5). A layer's pre-hook asks for it (`prepare_layer`: the compute stream waits only for that
layer's load), and each hook then starts the look-ahead (`prepare_next`): the next streamed
layers load into whatever slots are free of running layers while this one computes. `stats()`
counts `streamed_runs`, `found_prepared` (runs whose layer the look-ahead had loaded) and
`load_waits` (runs that found their load still in flight); `look_ahead=False` turns it off
(each layer then loads when it is needed).

Contract: a layer's parameters are valid inside its forward. Between forwards a remapped layer's
`Parameter`s point at unmapped memory until its next pre-hook (on the host backend, reading them
then faults the process): read them only inside a forward, or once the layer is back (after
`revert()`, or a step that reverted it: resident layers are bound at their own addresses again). Models are
registered for the process's life (strata parameter models are never unregistered).
"""

import contextlib
import ctypes
import threading
import time
import weakref

import torch

from . import _args, _dlpack, _lib, kv, params
from ._args import I32, U32, U64

__all__ = ["ModelParams", "reclaim", "revert"]

_ALIGN = 64
_lock = threading.Lock()
_models = {}  # device -> WeakSet of ModelParams registered on it
_kinds = {}  # device -> (DLPack device type, device id) of strata memory there


def _memory_kind(device):
    """Where strata memory on `device` lives for DLPack: (1, 0) for CPU-readable host memory,
    (2, n) for CUDA device n. The strict host backend has no CPU-readable memory: Unsupported."""
    with _lock:
        if device not in _kinds:
            with kv.KvSpace(
                layers=1, kv_heads=1, head_dim=1, dtype="uint8", max_requests=1, max_tokens=1, device=device
            ) as probe:
                t = probe.tensor(0, "k")
                _kinds[device] = (t.dlpack_device_type, t.device)
        kind = _kinds[device]
    if kind[0] == 0:
        raise _lib.error(
            _lib.Status.UNSUPPORTED,
            "strata memory is not CPU-accessible here (the strict host backend, "
            "STRATA_HOST_STRICT=1): torch cannot read parameters from it",
        )
    return kind


def _layout(layer):
    """[(name, shape, dtype, offset, bytes)] of a layer's parameters packed at aligned offsets,
    and the packed size."""
    entries, offset = [], 0
    for name, p in layer.named_parameters():
        offset = -(-offset // _ALIGN) * _ALIGN
        nbytes = p.numel() * p.element_size()
        entries.append((name, tuple(p.shape), p.dtype, offset, nbytes))
        offset += nbytes
    return entries, offset


def _views(flat, layout):
    return [flat[off : off + n].view(dtype).view(shape) for _, shape, dtype, off, n in layout]


def _current_stream(kind):
    return torch.cuda.current_stream(kind[1]) if kind[0] == 2 else None


class _Seconds:
    """An attribute holding seconds or None: NaN, infinities and negatives raise InvalidArgument."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else obj.__dict__.get(self.name)

    def __set__(self, obj, seconds):
        if seconds is not None:
            _args.nanoseconds(seconds, self.name)
        obj.__dict__[self.name] = seconds


class ModelParams:
    """The decoder layers of a torch `model` in strata parameter memory on `device`, with
    forward hooks that make each layer's parameters ready before it runs (`prepare_layer`),
    report it done after (`layer_done`) and load the next streamed layers ahead
    (`prepare_next`, unless `look_ahead` is False). `cap`: the most layers MIRAGE may remap
    (default: all but one). `compute_per_layer` and `prefill`: seconds of compute per layer and
    forward step, and of one prefill, to report to the controller instead of the times
    measured between the hooks (CPU only); with `compute_per_layer` given and `prefill` not, no
    prefill is reported (the idle budget is then `layers · compute_per_layer`). The three are
    attributes of the same names, read again at every controller step. Raises InvalidArgument
    (nothing moved) for a time that is NaN, infinite or negative (also when set later), or a
    `cap` or `device` outside its C type; InvalidState when the model is already in strata
    memory; Unsupported when torch cannot read strata memory here."""

    compute_per_layer = _Seconds()
    prefill = _Seconds()

    def __init__(self, model, cap=None, device=0, compute_per_layer=None, prefill=None, look_ahead=True):
        if getattr(model, "_strata_params", None) is not None:
            raise _lib.error(_lib.Status.INVALID_STATE, "this model's parameters are already in strata memory")
        self.compute_per_layer, self.prefill = compute_per_layer, prefill
        device = _args.integer(device, "device", I32)
        cap = None if cap is None else _args.integer(cap, "cap", U32)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
            raise _lib.error(_lib.Status.INVALID_ARGUMENT, "the model has no decoder `layers` (a ModuleList)")
        layout, size = _layout(layers[0])
        signature = [e[:3] for e in layout]
        for i, layer in enumerate(layers):
            if [e[:3] for e in _layout(layer)[0]] != signature:
                raise _lib.error(
                    _lib.Status.INVALID_ARGUMENT,
                    f"decoder layer {i} has other parameters than layer 0: strata layers are all alike",
                )
        if size == 0:
            raise _lib.error(_lib.Status.INVALID_ARGUMENT, "the decoder layers have no parameters")
        devices = {p.device for layer in layers for p in layer.parameters()}
        self._kind = _memory_kind(device)
        want = torch.device("cuda", self._kind[1]) if self._kind[0] == 2 else torch.device("cpu")
        if devices != {want}:
            raise _lib.error(
                _lib.Status.UNSUPPORTED,
                f"the model's layers are on {sorted(map(str, devices))} but strata memory on device "
                f"{device} is {want} memory (STRATA_BACKEND)",
            )
        n = len(layers)
        self.layers = n
        self.device = device
        self.layer_bytes = size
        self._layout = layout
        self._params = [[layer.get_parameter(e[0]) for e in layout] for layer in layers]
        self._model = params.register([self._packed(i) for i in range(n)], n - 1 if cap is None else cap, device)
        self._exports = 0
        self._bound = [None] * n  # address each layer's Parameters point at
        self._views = {}  # (layer, address) -> the Parameters' data there
        self._running = None  # layer between its pre-hook and its hook
        self._spent, self._runs, self._started = 0.0, 0, None
        self._forward_started, self._measured_prefill = None, None
        self.look_ahead = look_ahead
        self._streaming = False  # the plan streams layers (refreshed after every controller step)
        for i in range(n):
            self._bind(i, self._model.layer_ptr(i))
        self._hooks = [
            h
            for i, layer in enumerate(layers)
            for h in (
                layer.register_forward_pre_hook(lambda _m, a, kw, i=i: self._before(i, a, kw), with_kwargs=True),
                layer.register_forward_hook(lambda _m, _a, _o, i=i: self._after(i), always_call=True),
            )
        ]
        model._strata_params = self
        with _lock:
            _models.setdefault(device, weakref.WeakSet()).add(self)

    def _packed(self, layer):
        buf = torch.zeros(self.layer_bytes, dtype=torch.uint8)
        with torch.no_grad():
            for view, p in zip(_views(buf, self._layout), self._params[layer]):
                view.copy_(p.detach().to("cpu"))
        return ctypes.string_at(buf.data_ptr(), self.layer_bytes)

    # ---- DLPack owner ---------------------------------------------------------------------

    def _dlpack_exported(self):
        with _lock:
            self._exports += 1

    def _dlpack_released(self):
        with _lock:
            self._exports -= 1

    def _bind(self, layer, address):
        """Points layer `layer`'s Parameters at its bytes at `address`."""
        views = self._views.get((layer, address))
        if views is None:
            self._dlpack_exported()
            try:
                capsule = _dlpack.capsule(
                    self, address, self._kind[0], self._kind[1], (1, 8), (self.layer_bytes,), (1,)
                )
            except BaseException:
                self._dlpack_released()
                raise
            views = _views(torch.from_dlpack(capsule), self._layout)
            self._views[(layer, address)] = views
        for p, v in zip(self._params[layer], views):
            p.data = v
        self._bound[layer] = address

    # ---- the hooks ------------------------------------------------------------------------

    def _prepare(self, layer):
        self._model.prepare_layer(layer, _current_stream(self._kind))
        address = self._model.layer_ptr(layer)
        if address != self._bound[layer]:
            self._bind(layer, address)

    def _before(self, layer, args, kwargs):
        cpu = self._kind[0] != 2
        if layer == 0 and cpu:
            hidden = args[0] if args else kwargs.get("hidden_states")
            prefill = isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] > 1
            self._forward_started = time.perf_counter() if prefill else None
        self._prepare(layer)
        self._look_ahead(layer)
        self._running = layer
        self._started = time.perf_counter()

    def _after(self, layer):
        self._running = None
        now = time.perf_counter()
        if self._started is not None and self._kind[0] != 2:
            # On the CPU the layer's compute is done when its hook runs; CUDA kernels are
            # asynchronous, so there only `compute_per_layer` gives T_c.
            self._spent += now - self._started
            self._runs += 1
        self._started = None
        if layer == self.layers - 1 and self._forward_started is not None:
            self._measured_prefill = now - self._forward_started
            self._forward_started = None
        self._model.layer_done(layer, _current_stream(self._kind))
        self._look_ahead(layer)

    def _look_ahead(self, layer):
        """Loads the streamed layers after `layer` into the slots free of running layers."""
        if not (self.look_ahead and self._streaming):
            return
        after = layer
        for _ in range(self.layers):
            after = self._model.prepare_next(after)
            if after is None or after == layer:
                return

    def _report(self):
        per_layer = self.compute_per_layer
        if per_layer is None and self._runs:
            per_layer = self._spent / self._runs
        if per_layer is not None:
            self._model.report_compute(per_layer)
        prefill = self.prefill
        if prefill is None and self.compute_per_layer is None:
            prefill = self._measured_prefill  # measured times only beside measured times
        if prefill is not None:
            self._model.report_prefill(prefill)

    def _after_step(self):
        """A controller step may have moved layers: resident ones are bound at their own
        addresses again, and the layer now running is readied again."""
        self._streaming = self._model.stats()["streamed_layers"] > 0
        for layer in range(self.layers):
            try:
                address = self._model.layer_ptr(layer)
            except _lib.InvalidState:
                continue  # streamed and in no slot: bound by its next pre-hook
            if address != self._bound[layer]:
                self._bind(layer, address)
        if self._running is not None:
            self._prepare(self._running)

    # ---- public ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def serving(self):
        """This model serves inside the block (MIRAGE remaps serving models last); idle after."""
        self.set_active(True)
        try:
            yield self
        finally:
            self.set_active(False)

    def set_active(self, active=True):
        """Marks the model serving (remapped last) or idle. Becoming active runs one controller
        step without a shortage (`reclaim(0)`): remapped layers come back while the device has
        room for them (dynamic reversion; best effort: if the pages cannot be had after all, the
        layers stay remapped and stream)."""
        self._report()
        self._model.set_active(active)
        if active:
            try:
                reclaim(0, self.device)
            except _lib.OutOfMemory:
                pass  # the room the step counted on went elsewhere: the layers stay remapped

    def stats(self):
        """The model's figures (`strata_params_model_stats_t`): layers, `remapped_layers`,
        `streamed_layers`, `slots`, `gpu_pages`, `transfer_ns` (T_T), the streaming counters
        (`streamed_runs`, `slot_loads`, `loads_ahead`, `found_prepared`, `load_waits`), and
        `measured_compute_per_layer` and `measured_prefill` (seconds; None until measured)."""
        s = self._model.stats()
        s["measured_compute_per_layer"] = self._spent / self._runs if self._runs else None
        s["measured_prefill"] = self._measured_prefill
        return s

    def read(self, layer, offset, length):
        """`length` bytes of `layer`'s packed parameters at `offset`, wherever they are now."""
        return self._model.read(layer, offset, length)


def _synchronize(device):
    if _memory_kind(device)[0] == 2:
        torch.cuda.synchronize(_memory_kind(device)[1])


def _controller_step(device, step):
    with _lock:
        models = list(_models.get(device, ()))
    for m in models:
        m._report()
    # Nothing queued may still read a layer the step unmaps.
    _synchronize(device)
    try:
        return step()
    finally:
        for m in models:
            m._after_step()


def reclaim(pages_short, device=0):
    """One remapping-controller step on `device`: `pages_short` pages a KV cache could not get
    (idle models' layer pages become KV pages), or 0 (dynamic reversion: remapped layers come
    back, serving models first, while the pool's free pages and the room left on the device
    cover them). Returns True when a model's layers moved. A `StrataCache`'s
    `on_out_of_memory` callback: `StrataCache(config, n, on_out_of_memory=strata.mirage.reclaim)`.
    Raises InvalidArgument (nothing moves) for a page count or device outside its C type."""
    pages_short = _args.integer(pages_short, "pages_short", U64)
    device = _args.integer(device, "device", I32)
    return _controller_step(device, lambda: params.step(device=device, pages_short=pages_short)) > 0


def revert(device=0):
    """Every remapped layer of every model on `device` back at its own address (pages from the
    pool, created if needed: `strata.OutOfMemory` when the device has none left); every
    `Parameter` is valid again outside a forward (as after any step that brought them back).
    Raises InvalidArgument for a device outside an int32_t."""
    device = _args.integer(device, "device", I32)
    _controller_step(device, lambda: params.revert_all(device=device))
