"""Tiered offload for `strata.transformers`: `OffloadedStrataCache`, a `StrataCache` whose layers'
KV lives in host memory while other layers compute, within a device budget.

    cache = OffloadedStrataCache(model.config, max_cache_len=4096, device_budget=256 << 20)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=1024)
    cache.stats()["offload"]   # bytes moved, prefetch hits, stalls, layers on the CPU

Layout. One strata KV space per layer (each a single-layer space, tensors `[batch,
max_cache_len, kv_heads, head_dim]` as in `StrataCache`), so a layer is the unit of residency:
a layer swapped out has its pages spilled to the host tier (`strata_kv_spill`; full pages keep a
clean copy there, so swapping a layer out again copies only its last, growing page), and comes
back at the same addresses (`strata_kv_make_resident`). The tensors' addresses never move.

Policy: Pie (seed 004), through `strata_pie_*` (tiers' `pie` module). The device budget holds
`g = budget // layer_bytes` layers (layer_bytes: K and V of every row for the tokens held, whole
pages), so at least `n - g` layers live on the CPU (the controller's floor; a budget below one
layer raises `strata.OutOfMemory`). When layer k's attention starts (`update(k)`), the FIFO
protocol swaps in the hottest CPU layer (the next one needed: the lookahead) and swaps out the
coldest device layer (the one computed last), one transfer each way at a time, on two transfer
threads, so the copies run while the next layers compute. A finished transfer runs the protocol
again for the layer computing now, so the swap-in a swap-out made room for starts at once. Layer
k waits only for its own swap-in, if it is still in flight (a stall). Before a swap-out the rows
are cut to the tokens written (pages are appended a page ahead, and a page counted full would
keep a stale clean copy). Adaptive expansion (`expand=True`) adds CPU layers
beyond the floor while no step waits and tokens/s does not fall, and backs off after a wait;
it is off by default, because one cache with a fixed batch gains nothing from more CPU layers
(they free device pages for other users of the pool, at the price of more traffic).

On CUDA a swap-out first waits for an event recorded when the next layer started (the
attention that read the layer is done); swap-ins are ordered on the default stream. Beam
search (`reorder_cache`) is not supported with offload.
"""

import concurrent.futures
import ctypes
import threading
import time

import torch
from transformers.cache_utils import Cache

from . import _lib, kv
from .transformers import StrataCache, _checked_space

__all__ = ["OffloadedStrataCache", "Pie"]

GPU, CPU, SWAPPING_IN, SWAPPING_OUT = range(4)


class _Decision(ctypes.Structure):
    _fields_ = [("swap_in", ctypes.c_int32), ("swap_out", ctypes.c_int32)]


_u32p = ctypes.POINTER(ctypes.c_uint32)
_c = _lib.binder(
    {
        "strata_pie_create": (ctypes.c_int, [ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]),
        "strata_pie_destroy": (ctypes.c_int, [ctypes.c_uint64]),
        "strata_pie_set_floor": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint32, _u32p]),
        "strata_pie_layer_start": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint32, ctypes.POINTER(_Decision)]),
        "strata_pie_swap_done": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int]),
        "strata_pie_state": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int)]),
        "strata_pie_observe": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int, ctypes.c_double, _u32p]),
    }
)


class Pie:
    """Pie's controller (`strata_pie_*`): mapping table, FIFO protocol, adaptive expansion."""

    def __init__(self, layers, max_cpu_layers=0):
        h = ctypes.c_uint64()
        _lib.check(_c().strata_pie_create(layers, max_cpu_layers, ctypes.byref(h)))
        self.handle = h.value

    def close(self):
        if self.handle:
            _lib.check(_c().strata_pie_destroy(self.handle))
            self.handle = 0

    def set_floor(self, floor):
        m = ctypes.c_uint32()
        _lib.check(_c().strata_pie_set_floor(self.handle, floor, ctypes.byref(m)))
        return m.value

    def layer_start(self, layer):
        """(swap_in, swap_out): layers to start moving, None for none."""
        d = _Decision()
        _lib.check(_c().strata_pie_layer_start(self.handle, layer, ctypes.byref(d)))
        return (d.swap_in if d.swap_in >= 0 else None, d.swap_out if d.swap_out >= 0 else None)

    def swap_done(self, swap_in):
        _lib.check(_c().strata_pie_swap_done(self.handle, 0 if swap_in else 1))

    def state(self, layer):
        s = ctypes.c_int()
        _lib.check(_c().strata_pie_state(self.handle, layer, ctypes.byref(s)))
        return s.value

    def observe(self, waited, throughput):
        m = ctypes.c_uint32()
        _lib.check(_c().strata_pie_observe(self.handle, int(bool(waited)), float(throughput), ctypes.byref(m)))
        return m.value


class _LayerSpaces:
    """One single-layer KV space per layer, with the calls `StrataCache` makes on its space."""

    def __init__(self, spaces):
        self.layers = spaces

    def tensor(self, layer, kind):
        return self.layers[layer].tensor(0, kind)

    def stats(self):
        """The spaces' figures summed (sizes and ratios taken from the first)."""
        out = {}
        for s in (sp.stats() for sp in self.layers):
            for name, value in s.items():
                if name in ("page_size", "tokens_per_block", "block_bytes"):
                    out.setdefault(name, value)
                elif name.startswith("pool_"):
                    out[name] = value  # one device pool: every space reports the same
                else:
                    out[name] = out.get(name, 0) + value
        return out

    def check(self):
        for s in self.layers:
            s.check()

    def close(self):
        errors = []
        for s in self.layers:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - close the others, then report
                errors.append(e)
        if errors:
            raise errors[0]


class OffloadedStrataCache(StrataCache):
    """A `StrataCache` that keeps at most `device_budget` bytes of KV pages on the device (see the
    module documentation). `host_bytes` is the host tier of all layers together (default: every
    layer's full reservation); `expand` turns on Pie's adaptive expansion above the budget's
    floor."""

    def __init__(self, config, max_cache_len, device_budget, device=0, host_bytes=None, expand=False):
        if isinstance(device_budget, bool) or not isinstance(device_budget, int) or device_budget <= 0:
            raise _lib.error(_lib.Status.INVALID_ARGUMENT, f"device_budget {device_budget!r}: a positive number of bytes")
        super().__init__(config, max_cache_len, device=device)
        self.device_budget = device_budget
        self._host_bytes = host_bytes
        self._expand = expand
        self._pie = None
        self._swap = None  # set with the spaces

    # ---- spaces and requests, per layer ------------------------------------------------------

    def _open_space(self, batch, heads, dim, dtype, device, torch_device_type):
        n = len(self.layers)
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = self._host_bytes // n if self._host_bytes else 2 * batch * (self.max_cache_len * heads * dim * elem + (2 << 20))
        spaces = []
        try:
            for _ in range(n):
                spaces.append(
                    _checked_space(
                        torch_device_type,
                        layers=1,
                        kv_heads=heads,
                        head_dim=dim,
                        dtype=str(dtype),
                        max_requests=batch,
                        max_tokens=self.max_cache_len,
                        device=device,
                        host_bytes=per_layer,
                    )
                )
            space = _LayerSpaces(spaces)
            self._pie = Pie(n, n - 1 if self._expand else 0)
            self._swap = _Swapper(self, space, torch_device_type == "cuda")
        except BaseException:
            if self._pie is not None:
                self._pie.close()
                self._pie = None
            _LayerSpaces(spaces).close()
            raise
        # StrataLayer.update never calls StrataCache._hold (one space's appends): update maps
        # each layer's pages itself.
        self._mapped = self.max_cache_len
        return space

    def _release_requests(self):
        if self._swap is not None:
            self._swap.release_requests()

    # ---- transformers' Cache ----------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._live()
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        end = layer.length + key_states.shape[-2]
        if end > self.max_cache_len:
            raise _lib.error(
                _lib.Status.INVALID_ARGUMENT,
                f"{end} tokens do not fit: this StrataCache was reserved for max_cache_len = "
                f"{self.max_cache_len} per sequence",
            )
        self._swap.acquire(layer_idx, end)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def crop(self, tokens_to_remove):
        """As `StrataCache.crop`, layer by layer (after the transfers in flight)."""
        self._live()
        Cache.crop(self, tokens_to_remove)
        if self._swap is not None:
            self._swap.truncate(max(layer.length for layer in self.layers))

    def reset(self):
        if self._swap is not None:
            self._swap.drain()
        super().reset()

    def reorder_cache(self, beam_idx):
        raise _lib.error(_lib.Status.UNSUPPORTED, "OffloadedStrataCache does not support beam search (reorder_cache)")

    # ---- strata -----------------------------------------------------------------------------

    def stats(self):
        """`StrataCache.stats()` (summed over the layers' spaces; `kv_bytes` and `pages` are what
        is on the device now) plus `offload`: the swapper's figures."""
        if self._space is None:
            return {"tokens": 0, "token_bytes": 0, "kv_bytes": 0, "pages": 0, "offload": {}}
        s = self._space.stats()
        tokens = self.get_seq_length()
        s.update(
            tokens=tokens,
            token_bytes=2 * len(self.layers) * self._shape[0] * tokens * self._space.layers[0].bytes_per_token,
            kv_bytes=s["blocks_resident"] * s["block_bytes"],
            pages=s["blocks_resident"] * 2,
            offload=self._swap.stats(),
        )
        return s

    def close(self):
        if self._closed:
            return
        if self._swap is not None:
            self._swap.close()
        super().close()
        if self._pie is not None:
            self._pie.close()
            self._pie = None


class _Swapper:
    """Runs Pie's decisions for one cache: two transfer threads (one swap each way at a time, as
    Pie), per-layer requests and appends, the budget's floor, and the figures."""

    def __init__(self, cache, spaces, cuda):
        self.cache = cache
        self.pie = cache._pie
        self.spaces = spaces.layers
        self.cuda = cuda
        self.page_size = self.spaces[0].stats()["page_size"]
        n = len(self.spaces)
        self.requests = [[] for _ in range(n)]
        self.held = [0] * n  # tokens appended per row, per layer (whole pages while on the device)
        self.pool_in = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-swap-in")
        self.pool_out = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-swap-out")
        self.inflight = {}  # True (swap-in) / False (swap-out) -> (layer, future)
        # Guards the fields the transfer threads' completions change (inflight, counts,
        # brought_in, current, error); Pie's controller has its own lock.
        self.cond = threading.Condition(threading.RLock())
        self.current = None  # the layer computing now (None: start nothing on completions)
        self.error = None  # a transfer's exception, raised by the next acquire
        self.floor = 0
        self.budget_tokens = 0
        self.fits = n  # layers the budget holds
        self.shedding = False  # the budget shrank: swap-outs first
        self.all_on_device = True  # with cpu_layers 0 and nothing in flight: no protocol to run
        self.cpu_layers = 0
        self.brought_in = [False] * n
        self.step_start = None
        self.step_waited = False
        self.counts = dict(swap_ins=0, swap_outs=0, prefetch_hits=0, stalls=0, stall_seconds=0.0)

    # ---- transfers ---------------------------------------------------------------------------

    def _swap_in(self, layer):
        if self.requests[layer]:
            self.spaces[layer].make_resident(self.requests[layer])

    def _swap_out(self, layer, fence):
        if fence is not None:
            fence.synchronize()
        # A page whose tokens are all appended counts as full, and a full page keeps its clean
        # copy in the host tier when it comes back (the next swap-out copies nothing of it). The
        # pages appended ahead are not written yet: cut the rows to the tokens written first, so
        # that the last page is partial and copied (its stale clean copy, if any, dropped).
        written = self.cache.layers[layer].length
        if self.held[layer] > written:
            for r in self.requests[layer]:
                r.truncate(written)
            self.held[layer] = written
        for r in self.requests[layer]:
            r.spill("host")

    def _launch(self, swap_in, swap_out):
        """Starts the swaps Pie decided (the condition's lock held)."""
        if swap_out is not None:
            fence = torch.cuda.Event() if self.cuda else None
            if fence is not None:
                fence.record()
            self._submit(False, swap_out, self.pool_out.submit(self._swap_out, swap_out, fence))
        if swap_in is not None:
            self._submit(True, swap_in, self.pool_in.submit(self._swap_in, swap_in))

    def _submit(self, direction, layer, future):
        self.inflight[direction] = (layer, future)
        future.add_done_callback(lambda f: self._finished(direction, layer, f))

    def _finished(self, direction, layer, future):
        """A transfer ended (on its thread): phase two, then Pie's protocol again for the layer
        running now, so a swap-out that made room starts the swap-in at once rather than at the
        next layer's start (the link never idles while a layer waits on the CPU)."""
        with self.cond:
            if self.inflight.get(direction, (None, None))[1] is not future:
                return
            del self.inflight[direction]
            try:
                self.pie.swap_done(direction)
                self.counts["swap_ins" if direction else "swap_outs"] += 1
                if future.exception() is not None:
                    self.error = self.error or future.exception()
                elif direction:
                    self.brought_in[layer] = True
                if self.current is not None and self.error is None:
                    self._launch(*self.pie.layer_start(self.current))
            except Exception as e:  # noqa: BLE001 - a transfer thread: raised by the next acquire
                self.error = self.error or e
            finally:
                self.cond.notify_all()

    def _raise_error(self):
        error, self.error = self.error, None
        if error is not None:
            raise error

    def drain(self):
        """Waits for the transfers in flight (and starts no more until the next acquire)."""
        with self.cond:
            self.current = None
            while self.inflight:
                self.cond.wait()
            self._raise_error()

    # ---- the per-layer hook ------------------------------------------------------------------

    def _layer_bytes(self, tokens):
        """K and V of every row for `tokens` tokens, in whole pages."""
        return 2 * self.cache._shape[0] * -(-tokens // self.cache._tokens_per_page) * self.page_size

    def _set_budget(self, tokens):
        if tokens == self.budget_tokens:
            return
        n = len(self.spaces)
        layer_bytes = self._layer_bytes(tokens)
        fits = self.cache.device_budget // layer_bytes
        if fits == 0:
            raise _lib.error(
                _lib.Status.OUT_OF_MEMORY,
                f"device_budget {self.cache.device_budget} bytes is smaller than one layer's KV "
                f"({layer_bytes} bytes for {tokens} tokens of {self.cache._shape[0]} rows): "
                "OffloadedStrataCache needs room for at least one layer",
            )
        self.budget_tokens = tokens
        self.shedding = fits < self.fits
        self.fits = fits
        floor = max(0, n - fits)
        if floor != self.floor:
            self.floor = floor
            self._aim(self.pie.set_floor(floor))

    def acquire(self, layer, tokens):
        """Before `layer`'s attention: the budget for `tokens`, the layer resident (waiting only
        for its own transfer, or for the swap-outs a smaller budget needs), then its pages for
        `tokens` mapped."""
        if layer == 0 and self.cache._expand:
            self._observe_step()
        page = self.cache._tokens_per_page
        upto = min(-(-tokens // page) * page, self.cache.max_cache_len)
        self._set_budget(upto)
        if self.inflight or not (self.all_on_device and self.cpu_layers == 0):
            with self.cond:
                self._raise_error()
                self.current = layer
                self._protocol(layer)
        if not self.requests[layer]:
            self.requests[layer] = self._admit(layer)
        # Whole pages ahead, as StrataCache: the next tokens up to the page's end need no call.
        if upto > self.held[layer]:
            append, space, more = kv._c().strata_kv_append, self.spaces[layer].handle, upto - self.held[layer]
            for r in self.requests[layer]:
                _lib.check(append(space, r.handle, more))
            self.held[layer] = upto

    def _on_device(self):
        return sum(self.pie.state(l) != CPU for l in range(len(self.spaces)))

    def _protocol(self, layer):
        """Pie's protocol at the start of `layer`, then waits until the layer is on the device
        (and, after the budget shrank, until no more layers than it holds are)."""
        waited_since = None
        while True:
            self._launch(*self.pie.layer_start(layer))
            if self.pie.state(layer) == GPU and (not self.shedding or self._on_device() <= self.fits):
                break
            if not self.inflight:
                raise _lib.error(_lib.Status.INVALID_STATE, f"Pie's controller left layer {layer} off the device with no transfer running")
            waited_since = waited_since or time.perf_counter()
            self.cond.wait()
            self._raise_error()
        self.shedding = False
        if waited_since is not None:
            self.counts["stalls"] += 1
            self.counts["stall_seconds"] += time.perf_counter() - waited_since
            self.step_waited = True  # adaptive expansion's "waited" (expand=True)
        elif self.brought_in[layer]:
            self.counts["prefetch_hits"] += 1
        self.brought_in[layer] = False
        if self.cpu_layers == 0 and not self.inflight:
            self.all_on_device = self._on_device() == len(self.spaces)

    def _observe_step(self):
        now = time.perf_counter()
        if self.step_start is not None:
            rows = self.cache._shape[0]
            self._aim(self.pie.observe(self.step_waited, rows / max(now - self.step_start, 1e-9)))
        self.step_start, self.step_waited = now, False

    def _aim(self, cpu_layers):
        self.cpu_layers = cpu_layers
        if cpu_layers:
            self.all_on_device = False

    def _admit(self, layer):
        space = self.spaces[layer]
        requests = []
        try:
            for _ in range(self.cache._shape[0]):
                requests.append(space.admit())
        except BaseException:
            for r in requests:
                r.release()
            raise
        requests.sort(key=lambda r: r.slot)
        return requests

    def release_requests(self):
        self.drain()
        for layer, requests in enumerate(self.requests):
            self.requests[layer], self.held[layer] = [], 0
            for r in requests:
                r.release()
        self.step_start = None

    def truncate(self, tokens):
        """Every layer keeps its first `tokens` tokens (the pages past them go back; the clean
        copies of the pages cut go too)."""
        self.drain()
        for layer, requests in enumerate(self.requests):
            if self.held[layer] > tokens:
                for r in requests:
                    r.truncate(tokens)
                self.held[layer] = tokens

    def stats(self):
        out = dict(self.counts)
        out.update(
            layers_on_device=self._on_device(),
            cpu_layers=self.cpu_layers,
            floor=self.floor,
            device_budget=self.cache.device_budget,
        )
        return out

    def close(self):
        try:
            self.drain()
        finally:
            self.pool_in.shutdown(wait=True)
            self.pool_out.shutdown(wait=True)
