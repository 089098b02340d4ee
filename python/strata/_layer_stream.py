"""Layer streaming for `OffloadedStrataCache` (`swap="stream"`): the layers the device budget
cannot hold live in pinned host buffers and stream through two device slots, each copy on the
cache's side stream, overlapped with the compute of the layers before it.

The space's requests are (layer, batch row) pairs as in Pie's mode: group g is rows `g × batch
...`. A resident layer keeps its own group (fixed addresses; pages appended as tokens come). An
offloaded layer's KV lives in host buffers `[batch, max_cache_len, kv_heads, head_dim]` (pinned
on CUDA) and is read from one of the ring's slots (the groups of the first offloaded layers):

- fetch: when layer l's update has written its new tokens, the next offloaded layer m after l
  (cyclically: the last layer's update fetches the first one of the next step) is copied from
  its host buffer into the free slot, on the side stream, after an event of the compute stream
  (so the slot's last reader, which ran before l, is done). An event recorded after the copy is
  what m's update makes the compute stream wait for. So m's copy overlaps l's attention and
  everything up to m; only a fetch not issued ahead (the first offloaded layer of a prefill, a
  layer offloaded mid-step) is issued by its own update (a "stall": the compute stream waits,
  the host never does).
- write-back: after an offloaded layer's update wrote its new tokens into its slot, those tokens
  (only those) are copied to its host buffer on the side stream, after an event of the compute
  stream; the next fetch of that layer, later on the same stream, reads them.
- demotion: when the tokens grow so that the budget holds fewer layers, the layers to offload
  (a nested, evenly spread order: `spread_order`) are copied whole to new host buffers on the
  side stream, and their groups' pages are truncated once an event after the copy is done (a
  query at each update: until then the device holds those layers' pages beyond the budget; on
  the CPU the copy is done at once). Their host buffers are allocated then (pinned memory: a
  host call on that step's path, once per layer). Layers do not come back to the device before
  `reset`, which drops the host buffers.

The budget holds `g = budget // layer_bytes` layers (K and V of every row for the tokens held,
whole pages): with `g >= layers` nothing is offloaded; otherwise `s = min(2, g)` slots and
`g - s` resident layers, and `layers - g + s` layers stream each step. Nothing on a step's path waits for the device: no synchronization, no
`.item()`; waits are stream waits on events (`strata._streams`). Host calls on the path: the
pages a group needs as tokens grow (`strata_kv_append`, whole pages), as in `StrataCache`."""

import torch

from . import _lib
from ._swapper import layers_in_budget


def spread_order(n):
    """Layers 0..n-1 in an order whose every prefix is spread evenly over them (bit-reversed
    indices: for 16 layers the first 8 are the even ones), so that offloaded layers alternate
    with resident ones and each fetch overlaps more than one layer's compute."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


class LayerStreamer:
    def __init__(self, cache, space, layers, rows, streams, host_bytes):
        self.cache = cache
        self.space = space
        self.n, self.rows = layers, rows
        self.streams = streams
        self.host_limit = host_bytes
        self.order = spread_order(layers)
        s = space.stats()
        self.page_size = s["page_size"]
        names = "swap_ins swap_outs prefetch_hits stalls demotions bytes_to_device bytes_from_device"
        self.counts = dict.fromkeys(names.split(), 0)
        self._clear()

    def _clear(self):
        self.requests = []  # every (layer, row) request, by slot
        self.held = [0] * self.n  # tokens mapped per group
        self.offloaded = set()
        self.host = {}  # offloaded layer -> (K, V) host buffers
        self.host_rows = {}  # offloaded layer -> its host buffers' rows (K rows, then V rows)
        self.groups = {}  # group -> ((K, V) device tensors, their rows), made once
        self.ring = []  # the slots' groups
        self.owner = []  # per slot: the layer fetched into it, or None
        self.issued = {}  # layer fetched and not yet read -> its slot
        self.ready = {}  # layer -> the side stream's event after its fetch
        self.in_use = None  # the offloaded layer whose attention reads its slot now
        self.in_use_slot = None
        self.releasing = []  # (event, group): pages truncated once the event is done
        self.budget_tokens = 0

    # ---- groups and buffers ------------------------------------------------------------------

    def _group(self, g):
        return self.requests[g * self.rows : (g + 1) * self.rows]

    def _map(self, g, tokens):
        if tokens > self.held[g]:
            for r in self._group(g):
                r.append(tokens - self.held[g])
            self.held[g] = tokens

    def _cut(self, g, tokens):
        if self.held[g] > tokens:
            for r in self._group(g):
                r.truncate(tokens)
            self.held[g] = tokens

    def _rows(self, pair):
        """The K rows, then the V rows, of a (K, V) pair: each row's tokens are contiguous (one
        copy each; a strided copy between host and device would stage through unpinned memory)."""
        return [t[i] for t in pair for i in range(self.rows)]

    def _device(self, g):
        """((K, V), rows) of group g's device tensors."""
        if g not in self.groups:
            pair = self.cache._tensors(g)
            self.groups[g] = (pair, self._rows(pair))
        return self.groups[g]

    def _copy(self, dst_rows, src_rows, first, end):
        """Tokens first..end of every row, K and V, on the side stream; returns the bytes."""
        if end <= first:
            return 0
        pairs = [(d[first:end], s[first:end]) for d, s in zip(dst_rows, src_rows)]
        self.streams.copy(pairs)
        return sum(d.nbytes for d, _ in pairs)

    def _host_buffers(self, like):
        size = 2 * like.nbytes
        used = sum(2 * k.nbytes for k, _ in self.host.values())
        if self.host_limit is not None and used + size > self.host_limit:
            raise _lib.error(
                _lib.Status.OUT_OF_MEMORY,
                f"host_bytes {self.host_limit}: {used} bytes of host buffers hold the offloaded layers, "
                f"one more layer needs {size}",
            )
        pin = self.streams.pinned
        return tuple(torch.empty(like.shape, dtype=like.dtype, pin_memory=pin) for _ in range(2))

    # ---- the plan: which layers the budget holds ---------------------------------------------

    def _plan(self, upto):
        if upto == self.budget_tokens:
            return
        fits = layers_in_budget(self.cache, self.rows, self.page_size, upto)
        if fits >= self.n and not self.offloaded:
            self.budget_tokens = upto
            return
        slots = min(2, fits, len(self.ring) or 2)
        want = self.order[: max(len(self.offloaded), self.n - min(self.n, fits - slots))]
        now = self.streams.record()  # every read and write of the layers so far
        self.streams.side_waits(now)
        for d in want:
            if d not in self.offloaded:
                self._demote(d)
        while len(self.ring) > slots:  # fewer slots than before: the last one goes
            self._drop_slot()
        if not self.ring:
            self.ring = [d for d in self.order if d in self.offloaded][:slots]
            self.owner = [None] * slots
            self.releasing = [(e, g) for e, g in self.releasing if g not in self.ring]
        for g in self.ring:
            self._map(g, upto)
        self._reap()
        self.budget_tokens = upto  # planned (a failure above plans again at the next update)

    def _demote(self, d):
        """Layer d's KV goes to new host buffers (its group's pages once the copy is done)."""
        (k, _), rows = self._device(d)
        host = self._host_buffers(k)
        self.host_rows[d] = self._rows(host)
        moved = self._copy(self.host_rows[d], rows, 0, self.cache.layers[d].length)
        self.host[d] = host
        self.offloaded.add(d)
        self.counts["demotions"] += 1
        self.counts["bytes_from_device"] += moved
        self.releasing.append((self.streams.record(on_side=True), d))

    def _drop_slot(self):
        g = self.ring.pop()
        gone = self.owner.pop()
        if gone is not None:
            self.issued.pop(gone, None)
            self.ready.pop(gone, None)
        # The side stream waited for the compute stream's work so far: its event covers both.
        self.releasing.append((self.streams.record(on_side=True), g))

    def _reap(self):
        """Truncates the groups whose last copies (and readers) are done (a query, no wait)."""
        keep = []
        for event, g in self.releasing:
            if self.streams.done(event):
                self._cut(g, 0)
            else:
                keep.append((event, g))
        self.releasing = keep

    # ---- fetches --------------------------------------------------------------------------

    def _free_slot(self):
        for s, layer in enumerate(self.owner):
            if layer is None or (layer not in self.issued and layer != self.in_use):
                return s
        for s, layer in enumerate(self.owner):  # take back a fetch not read yet
            if layer != self.in_use:
                self.issued.pop(layer)
                self.ready.pop(layer, None)
                return s
        return None

    def _fetch(self, m):
        """Queues layer m's copy into a free slot (None: no slot is free now)."""
        s = self._free_slot()
        if s is None:
            return None
        self.streams.side_waits(self.streams.record())  # the slot's last reader is done
        rows = self._device(self.ring[s])[1]
        self.counts["bytes_to_device"] += self._copy(rows, self.host_rows[m], 0, self.cache.layers[m].length)
        self.ready[m] = self.streams.record(on_side=True)
        self.owner[s] = m
        self.issued[m] = s
        self.counts["swap_ins"] += 1
        return s

    def _next_offloaded(self, layer):
        for d in range(1, self.n + 1):
            m = (layer + d) % self.n
            if m in self.offloaded:
                return m
        return None

    # ---- the per-layer hooks --------------------------------------------------------------

    def before(self, layer, end):
        """Before `layer`'s update writes tokens up to `end`: the plan for the budget, then the
        layer's tensors: its own group, or the slot its fetch went to (the compute stream waits
        for that fetch's event)."""
        if not self.requests:
            self.requests = self.space.admit_many(self.n * self.rows)
        page = self.cache._tokens_per_page
        upto = min(-(-end // page) * page, self.cache.max_cache_len)
        self.in_use = None  # the layers before this one are queued: their reads come first
        self._plan(upto)
        if self.releasing:
            self._reap()
        state = self.cache.layers[layer]
        if layer not in self.offloaded:
            self._map(layer, upto)
            state._k, state._v = self._device(layer)[0]
            return
        s = self.issued.pop(layer, None)
        if s is None:
            self.counts["stalls"] += 1
            s = self._fetch(layer)
            self.issued.pop(layer)
        else:
            self.counts["prefetch_hits"] += 1
        self.streams.compute_waits(self.ready.pop(layer))
        self.in_use, self.in_use_slot = layer, s
        state._k, state._v = self._device(self.ring[s])[0]

    def after(self, layer, start, end):
        """After `layer`'s update wrote tokens start..end: an offloaded layer's new tokens go to
        its host buffer; the next offloaded layer's fetch is queued (before this update
        returns, so it overlaps this layer's attention and the layers up to it)."""
        if layer in self.offloaded:
            rows = self._device(self.ring[self.in_use_slot])[1]
            self.streams.side_waits(self.streams.record())
            self.counts["bytes_from_device"] += self._copy(self.host_rows[layer], rows, start, end)
            self.counts["swap_outs"] += 1
        m = self._next_offloaded(layer)
        if m is not None and m not in self.issued and m != layer:
            self._fetch(m)

    # ---- crop, reset, close ---------------------------------------------------------------

    def drain(self):
        """The host waits for the copies in flight (crop, reset, close: never a step)."""
        self.streams.synchronize()
        self._reap()

    def truncate(self, tokens):
        """Every group keeps its first `tokens` tokens (host buffers need nothing)."""
        self.drain()
        for g in range(self.n):
            self._cut(g, tokens)
        self.budget_tokens = 0

    def release_requests(self):
        self.drain()
        requests = self.requests
        self._clear()
        for r in requests:
            r.release()

    def shutdown(self):
        self.drain()

    def stats(self):
        out = dict(self.counts)
        out.update(
            mode="stream",
            layers_on_device=self.n - len(self.offloaded),
            floor=len(self.offloaded),
            slots=len(self.ring),
            host_buffer_bytes=sum(2 * k.nbytes for k, _ in self.host.values()),
            device_budget=self.cache.device_budget,
        )
        return out
