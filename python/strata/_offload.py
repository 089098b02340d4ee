"""Tiered offload for `strata.transformers`: `OffloadedStrataCache`, a `StrataCache` whose layers'
KV lives in host memory or on disk while other layers compute, within a device budget.

    cache = OffloadedStrataCache(model.config, max_cache_len=4096, device_budget=256 << 20,
                                 host_bytes=1 << 30, disk_bytes=8 << 30, disk_dir="/scratch")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=1024)
    cache.stats()["offload"]   # swaps, prefetch hits, stalls, the lookahead's figures

Two ways to move layers (`swap`):

- "stream" (the default without a disk tier or `expand`; `strata._layer_stream`): the layers the
  budget cannot hold live in host buffers (pinned on CUDA) and stream through two device slots;
  each layer's fetch is queued on the cache's side stream by the update of the layer before it,
  after an event of the compute stream, and the layer's update makes the compute stream wait
  for the event after its fetch. Only an offloaded layer's new tokens are copied back. Nothing
  on a step's path waits for the device (no synchronization, no `.item()`, no strata call that
  waits): so the host keeps queueing kernels ahead of the GPU and the copies hide behind the
  compute, as transformers' own offloaded cache prefetches layer i+1 while layer i computes.
  Resident layers keep their addresses; an offloaded layer's views are its slot's.
- "pie" (the rest of this documentation): whole layers spilled to strata's host and disk tiers
  and made resident again at their own addresses, by Pie's and TierKV's policies. Moving a layer
  maps and unmaps its pages, and a swap-in needs the device slot of a swap-out, which waits for
  the device to finish reading the layer: on a GPU the host waits for the device whenever the
  swaps fall behind (the H200 run: 4.4× DynamicCache's time at half the KV on the device).

Pie's layout. One strata KV space whose requests are (layer, batch row) pairs: slot `layer × batch +
row`, tensors `[layers × batch, max_cache_len, kv_heads, head_dim]`, and layer l's K and V are
rows `l × batch ...` of them (views; the addresses never move). A layer is the unit of
residency: swapping it out spills its rows to the host tier (`strata_kv_spill`; full pages keep
a clean copy there, so swapping a layer out again copies only its last, growing page), swapping
it in brings them back at the same addresses (`strata_kv_make_resident`). All layers share the
space's host tier (`host_bytes`, default: every layer's full reservation) and disk tier
(`disk_bytes` in `disk_dir`): when the host tier is full, the store moves the blocks of the layer
that runs furthest away to disk (TierKV's order, from `strata_kv_queue`: the layers from the one
computing on, the one computed last at the end), and a layer on disk comes back through the
two-hop path disk → host → device.

Policy: Pie (seed 004), through `strata_pie_*` (tiers' `pie` module). The device budget holds
`g = budget // layer_bytes` layers (layer_bytes: K and V of every row for the tokens held, whole
pages), so at least `n - g` layers live off the device (the controller's floor; a budget below
one layer raises `strata.OutOfMemory`). When layer k's attention starts (`update(k)`), the FIFO
protocol swaps in the hottest CPU layer (the next one needed) and swaps out the coldest device
layer (the one computed last), one transfer each way at a time, on two transfer threads, so the
copies run while the next layers compute. A finished transfer runs the protocol again for the
layer computing now, so the swap-in a swap-out made room for starts at once. Layer k waits only
for its own swap-in, if it is still in flight (a stall). Before a swap-out the rows are cut to
the tokens written (pages are appended a page ahead, and a page counted full would keep a stale
clean copy). Adaptive expansion (`expand=True`) adds CPU layers beyond the floor while no step
waits and tokens/s does not fall, and backs off after a wait; it is off by default, because one
cache with a fixed batch gains nothing from it (the layers it moves free device pages for other
users of the pool, at the price of more traffic).

Lookahead: TierKV (seed 002, Eq. 1-2, through `strata_pie_overlap`, tiers' `overlap` module).
The swapper reports each layer's compute time (from its start to the next layer's start) and
each transfer's bytes and time per hop (host → device swap-ins, disk → host stages); tiers fits
each link's latency and bandwidth and answers whether a layer's transfer, started now, is hidden
by the compute of the layers in between (Eq. 1) and how many layers ahead it must start. With a
disk tier and `lookahead=True` (the default), the nearest CPU layer with blocks on disk whose
two-hop transfer, started now, Eq. 1 says is hidden (`K_SSD > K_DRAM`, §3.3) starts its disk →
host hop (`strata_kv_stage`, a third thread); its swap-in then crosses one hop. A layer not in
time from here (or before the links and layer times are measured) is left to its swap-in, as
Algorithm 1 leaves a block that does not fit the window.

When it is on, exactly: the store stages only into host room nothing else needs (free slots
beyond what spilling the resident layers would take) and never moves another layer down for it,
and its reads wait behind every swap-in's disk reads. So the lookahead reads nothing a swap-in
would not have read and writes nothing; with a host tier that stays full (a steady decode whose
off-device KV is larger than `host_bytes`) it stages nothing. Taking room from the layers that
run later (TierKV's eviction order) would hide more disk hops but, layers running in a cycle,
turns them into a rotation through disk: every off-device layer read back each token instead of
only those that do not fit, measured 30-70 % more disk reads and slower decoding on the
development VM (BENCHMARKS.md).

Pie's own swap-in needs a free device slot, so with host memory alone it already starts as early
as the budget allows, and Eq. 1 only predicts: the figures count the swap-ins it predicted hidden
(`swap_ins_early`), those that were (`prefetch_hits`), both (`swap_ins_early_hidden`), the stages
started, the objects they moved (`stage_objects`), the stages whose layer then came back from
host memory alone (`stages_hidden`), and the swap-ins that took two hops; the space's stats add
`staged_objects` and `staged_evicted` (dropped before a swap-in read them).

On CUDA a swap-out first waits for an event recorded when the next layer started (the
attention that read the layer is done); swap-ins are ordered on the default stream. Beam
search (`reorder_cache`) is not supported with offload.
"""

import torch
from transformers.cache_utils import Cache

from . import _lib
from ._layer_stream import LayerStreamer
from ._streams import Streams
from ._swapper import Pie, Swapper
from .transformers import StrataCache, _checked_space, _kept

__all__ = ["OffloadedStrataCache", "Pie"]


class OffloadedStrataCache(StrataCache):
    """A `StrataCache` that keeps at most `device_budget` bytes of KV pages on the device (see the
    module documentation). `swap` is how layers move: "stream" (the default without a disk tier
    or `expand`: offloaded layers stream through two device slots from pinned host buffers, the
    copies on a side stream overlapped with compute; `strata._layer_stream`) or "pie" (whole
    layers spilled to strata's host and disk tiers and made resident again at their own
    addresses, Pie's and TierKV's policies). `host_bytes` is the host memory of all layers
    together (default: every layer's full reservation; with "stream" the limit of the host
    buffers, default none), `disk_bytes` in `disk_dir` their disk tier (default: none; "pie");
    `expand` turns on Pie's adaptive expansion above the budget's floor; `lookahead=False`
    turns off TierKV's disk hop ahead of need (only Pie's swaps remain)."""

    def __init__(
        self,
        config,
        max_cache_len,
        device_budget,
        device=0,
        host_bytes=None,
        disk_bytes=0,
        disk_dir=None,
        expand=False,
        lookahead=True,
        swap=None,
    ):
        if isinstance(device_budget, bool) or not isinstance(device_budget, int) or device_budget <= 0:
            raise _lib.error(
                _lib.Status.INVALID_ARGUMENT, f"device_budget {device_budget!r}: a positive number of bytes"
            )
        if swap is None:
            swap = "pie" if disk_bytes or expand else "stream"
        if swap not in ("stream", "pie") or (swap == "stream" and (disk_bytes or expand)):
            raise _lib.error(
                _lib.Status.INVALID_ARGUMENT,
                f"swap={swap!r}: \"stream\" (host memory only, no expand) or \"pie\"",
            )
        super().__init__(config, max_cache_len, device=device)
        self.device_budget = device_budget
        self._host_bytes = host_bytes
        self._disk = dict(disk_bytes=disk_bytes, disk_dir=disk_dir)
        self._expand = expand
        self._lookahead = lookahead
        self.swap = swap
        self._streams_for = Streams.for_device  # torch device -> Streams (tests pass a stand-in)
        self._pie = None
        self._swap = None  # set with the space
        self._base = None  # the space's K and V tensors, every layer's rows

    # ---- the space and its requests ---------------------------------------------------------

    def _open_space(self, batch, heads, dim, dtype, device, torch_device_type):
        n = len(self.layers)
        tiers = {}  # "stream": no strata tiers (the streamer's host buffers hold the layers)
        if self.swap == "pie":
            host = self._host_bytes
            if host is None:
                elem = torch.empty((), dtype=dtype).element_size()
                host = n * 2 * batch * (self.max_cache_len * heads * dim * elem + (2 << 20))
            tiers = dict(host_bytes=host, **self._disk)
        space = _checked_space(
            torch_device_type,
            layers=1,
            kv_heads=heads,
            head_dim=dim,
            dtype=str(dtype),
            max_requests=n * batch,
            max_tokens=self.max_cache_len,
            device=device,
            **tiers,
        )
        try:
            if self.swap == "stream":
                where = torch.device("cuda", device) if torch_device_type == "cuda" else torch.device("cpu")
                self._swap = LayerStreamer(self, space, n, batch, self._streams_for(where), self._host_bytes)
            else:
                self._pie = Pie(n, n - 1 if self._expand else 0)
                cuda, disk = torch_device_type == "cuda", bool(self._disk["disk_bytes"])
                self._swap = Swapper(self, space, n, batch, cuda, disk, self._lookahead)
        except BaseException:
            if self._pie is not None:
                self._pie.close()
                self._pie = None
            space.close()
            raise
        # StrataLayer.update never calls StrataCache._hold (its appends): the swapper or the
        # streamer maps each layer's pages itself.
        self._mapped = self.max_cache_len
        return space

    def _tensors(self, layer):
        if self._base is None:
            self._base = tuple(torch.from_dlpack(self._space.tensor(0, kind)) for kind in ("k", "v"))
        rows = self._shape[0]
        return tuple(t[layer * rows : (layer + 1) * rows] for t in self._base)

    def _release_requests(self):
        if self._swap is not None:
            self._swap.release_requests()

    # ---- transformers' Cache ----------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._live()
        self._check_states(key_states, value_states)
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
        if self.swap == "pie":
            self._swap.acquire(layer_idx, end)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        start = layer.length
        self._swap.before(layer_idx, end)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._swap.after(layer_idx, start, end)
        return out

    def crop(self, tokens):
        """As `StrataCache.crop`, layer by layer (after the transfers in flight)."""
        self._live()
        _kept(0, tokens)
        Cache.crop(self, tokens)
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
        """`StrataCache.stats()` (`kv_bytes` and `pages` are what is on the device now) plus
        `offload`: the swapper's figures."""
        if self._space is None:
            return {"tokens": 0, "token_bytes": 0, "kv_bytes": 0, "pages": 0, "offload": {}}
        s = self._space.stats()
        tokens = self.get_seq_length()
        offload = self._swap.stats()
        s.update(
            tokens=tokens,
            token_bytes=2 * len(self.layers) * self._shape[0] * tokens * self._space.bytes_per_token,
            kv_bytes=s["blocks_resident"] * s["block_bytes"],
            pages=s["blocks_resident"] * 2,
            offload=offload,
        )
        if self.swap == "stream":  # the streamer's copies, not the space's tiers
            s.update(bytes_to_device=offload["bytes_to_device"], bytes_from_device=offload["bytes_from_device"])
        return s

    def close(self):
        """As `StrataCache.close`: refused (`strata.InvalidState`) while views the caller holds keep
        the space alive, and the cache is then empty but usable (its transfer threads stay)."""
        if self._closed:
            return
        if self._swap is not None:
            self._swap.drain()
        self._base = None
        super().close()
        if self._swap is not None:
            self._swap.shutdown()
            self._swap = None
        if self._pie is not None:
            self._pie.close()
            self._pie = None
