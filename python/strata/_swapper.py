"""The layer swapper of `OffloadedStrataCache` (`strata.transformers`): Pie's controller
(`strata_pie_*`, tiers' `pie` and `overlap` modules) and the threads that carry out its
decisions on one KV space whose rows are (layer, batch row) requests."""

import concurrent.futures
import ctypes
import threading
import time

import torch

from . import _lib, kv

GPU, CPU, SWAPPING_IN, SWAPPING_OUT = range(4)
HOST_TO_DEVICE, DISK_TO_HOST = range(2)


class _Decision(ctypes.Structure):
    _fields_ = [("swap_in", ctypes.c_int32), ("swap_out", ctypes.c_int32)]


class Overlap(ctypes.Structure):
    """strata_pie_overlap_t: TierKV's Eq. 1-2 for one layer's transfer (-1: not measured)."""

    _fields_ = [
        ("steps", ctypes.c_int32),
        ("fits", ctypes.c_int32),
        ("t_transfer", ctypes.c_double),
        ("window", ctypes.c_double),
    ]


_u32p = ctypes.POINTER(ctypes.c_uint32)
_u64, _f64, _i32 = ctypes.c_uint64, ctypes.c_double, ctypes.c_int
_c = _lib.binder(
    {
        "strata_pie_create": (_i32, [ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(_u64)]),
        "strata_pie_destroy": (_i32, [_u64]),
        "strata_pie_set_floor": (_i32, [_u64, ctypes.c_uint32, _u32p]),
        "strata_pie_layer_start": (_i32, [_u64, ctypes.c_uint32, ctypes.POINTER(_Decision)]),
        "strata_pie_swap_done": (_i32, [_u64, _i32]),
        "strata_pie_state": (_i32, [_u64, ctypes.c_uint32, ctypes.POINTER(_i32)]),
        "strata_pie_observe": (_i32, [_u64, _i32, _f64, _u32p]),
        "strata_pie_observe_compute": (_i32, [_u64, ctypes.c_uint32, _f64]),
        "strata_pie_observe_transfer": (_i32, [_u64, _i32, _u64, _f64]),
        "strata_pie_overlap": (
            _i32,
            [_u64, ctypes.c_uint32, ctypes.c_uint32, _u64, _u64, ctypes.POINTER(Overlap)],
        ),
    }
)


def layers_in_budget(cache, rows, page_size, tokens):
    """How many layers of `rows` rows holding `tokens` tokens (K and V, whole pages) the cache's
    device budget holds; below one, strata.OutOfMemory."""
    layer_bytes = 2 * rows * -(-tokens // cache._tokens_per_page) * page_size
    fits = cache.device_budget // layer_bytes
    if fits == 0:
        raise _lib.error(
            _lib.Status.OUT_OF_MEMORY,
            f"device_budget {cache.device_budget} bytes is smaller than one layer's KV "
            f"({layer_bytes} bytes for {tokens} tokens of {rows} rows): "
            "OffloadedStrataCache needs room for at least one layer",
        )
    return fits


class Pie:
    """Pie's controller (`strata_pie_*`): mapping table, FIFO protocol, adaptive expansion, and
    TierKV's overlap condition from the compute and transfer times reported to it."""

    def __init__(self, layers, max_cpu_layers=0):
        h = _u64()
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
        s = _i32()
        _lib.check(_c().strata_pie_state(self.handle, layer, ctypes.byref(s)))
        return s.value

    def observe(self, waited, throughput):
        m = ctypes.c_uint32()
        _lib.check(_c().strata_pie_observe(self.handle, int(bool(waited)), float(throughput), ctypes.byref(m)))
        return m.value

    def observe_compute(self, layer, seconds):
        _lib.check(_c().strata_pie_observe_compute(self.handle, layer, seconds))

    def observe_transfer(self, hop, nbytes, seconds):
        _lib.check(_c().strata_pie_observe_transfer(self.handle, hop, nbytes, seconds))

    def overlap(self, start, layer, host_bytes, disk_bytes):
        """Eq. 1-2 for `layer`'s transfer started when layer `start` begins (`Overlap`)."""
        o = Overlap()
        _lib.check(_c().strata_pie_overlap(self.handle, start, layer, host_bytes, disk_bytes, ctypes.byref(o)))
        return o


class Swapper:
    """Runs Pie's decisions for one cache: per-layer requests (rows `layer * rows ...` of the
    space) and appends, the budget's floor, one swap each way at a time (two threads, as Pie),
    the disk hop ahead of need on a third thread (TierKV's lookahead, with `lookahead` and a
    disk tier), and the figures."""

    def __init__(self, cache, space, layers, rows, cuda, disk, lookahead):
        self.cache = cache
        self.pie = cache._pie
        self.space = space
        self.n, self.rows = layers, rows
        self.cuda = cuda
        self.disk = disk
        self.lookahead = lookahead and disk
        s = space.stats()
        self.page_size, self.block_bytes = s["page_size"], s["block_bytes"]
        self.requests = []  # every (layer, row) request, by slot
        self.queues = []  # per layer k: the handles in the order they run from layer k on
        self.held = [0] * layers  # tokens appended per row, per layer
        self.pool_in = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-swap-in")
        self.pool_out = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-swap-out")
        self.pool_stage = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-stage")
        self.inflight = {}  # True (swap-in) / False (swap-out) / "stage" -> (layer, future)
        # Guards the fields the transfer threads' completions change (inflight, counts,
        # brought_in, staged, current, error); Pie's controller has its own lock.
        self.cond = threading.Condition(threading.RLock())
        self.current = None  # the layer computing now (None: start nothing on completions)
        self.error = None  # a transfer's exception, raised by the next acquire
        self.floor = 0
        self.budget_tokens = 0
        self.fits = layers  # layers the budget holds
        self.shedding = False  # the budget shrank: swap-outs first
        self.all_on_device = True  # with cpu_layers 0 and nothing in flight: no protocol to run
        self.cpu_layers = 0
        self.brought_in = [False] * layers
        self.predicted = [None] * layers  # Eq. 1 when the layer's swap-in started (True/False/None)
        self.staged = [False] * layers  # its disk blocks came up to host memory ahead of need
        self.last = None  # (layer, when its acquire returned): the compute clock
        self.step_start = None
        self.step_waited = False
        self.steps = {"host": -1, "disk": -1}  # the last lookahead (layers) Eq. 1 asked for
        self.counts = dict(
            swap_ins=0,
            swap_outs=0,
            prefetch_hits=0,
            stalls=0,
            stall_seconds=0.0,
            swap_ins_early=0,
            swap_ins_early_hidden=0,
            two_hop_swap_ins=0,
            stages=0,
            stages_hidden=0,
            stage_objects=0,
        )

    def layer_requests(self, layer):
        return self.requests[layer * self.rows : (layer + 1) * self.rows]

    # ---- transfers ---------------------------------------------------------------------------

    def _tiers(self, layer):
        """(bytes in host memory, bytes on disk) of the layer's spilled blocks."""
        info, host, disk = kv.RequestInfo(), 0, 0
        get = kv._c().strata_kv_request_info
        for r in self.layer_requests(layer):
            _lib.check(get(self.space.handle, r.handle, ctypes.byref(info)))
            host, disk = host + info.host, disk + info.disk
        return host * self.block_bytes, disk * self.block_bytes

    def _swap_in(self, layer, host, disk):
        start = time.perf_counter()
        self.space.make_resident(self.layer_requests(layer))
        # On CUDA this is the time to queue the copies: a GPU run must time them on streams.
        took = time.perf_counter() - start
        if not disk:
            self.pie.observe_transfer(HOST_TO_DEVICE, host, took)
            return
        # Two hops: the disk hop is what the host hop (Eq. 2 on its fit) leaves of the time.
        up = self.pie.overlap(layer, layer, host + disk, 0).t_transfer
        if 0 <= up < took:
            self.pie.observe_transfer(DISK_TO_HOST, disk, took - up)

    def _swap_out(self, layer, fence):
        if fence is not None:
            fence.synchronize()
        # A page whose tokens are all appended counts as full, and a full page keeps its clean
        # copy in the host tier when it comes back (the next swap-out copies nothing of it). The
        # pages appended ahead are not written yet: cut the rows to the tokens written first, so
        # that the last page is partial and copied (its stale clean copy, if any, dropped).
        written = self.cache.layers[layer].length
        requests = self.layer_requests(layer)
        if self.held[layer] > written:
            for r in requests:
                r.truncate(written)
            self.held[layer] = written
        for r in requests:
            r.spill("host")

    def _stage(self, layer, disk):
        start = time.perf_counter()
        moved = self.space.stage(self.layer_requests(layer))
        took = time.perf_counter() - start
        # The store stages only into free room: a stage that left blocks on disk moved an
        # unknown share of `disk`, so only a complete one measures the link.
        if moved and not self._tiers(layer)[1]:
            self.pie.observe_transfer(DISK_TO_HOST, disk, took)
        with self.cond:
            self.counts["stage_objects"] += moved

    def _launch(self, swap_in, swap_out):
        """Starts the swaps Pie decided (the condition's lock held)."""
        if swap_out is not None:
            fence = torch.cuda.Event() if self.cuda else None
            if fence is not None:
                fence.record()
            self._submit(False, swap_out, self.pool_out.submit(self._swap_out, swap_out, fence))
        if swap_in is not None:
            host, disk = self._tiers(swap_in)
            self.counts["two_hop_swap_ins"] += bool(disk)
            self.counts["stages_hidden"] += self.staged[swap_in] and not disk
            self.staged[swap_in] = False
            o = self.pie.overlap(self.current, swap_in, host, disk) if self.current is not None else None
            self.predicted[swap_in] = None if o is None or o.fits < 0 else bool(o.fits)
            self.counts["swap_ins_early"] += bool(self.predicted[swap_in])
            if o is not None and not disk:
                self.steps["host"] = o.steps
            self._submit(True, swap_in, self.pool_in.submit(self._swap_in, swap_in, host, disk))

    def _stage_ahead(self, k):
        """TierKV's lookahead for the disk hop (the condition's lock held; Algorithm 1): the
        nearest layer on the CPU with blocks on disk whose two-hop transfer, started now, Eq. 1
        says is hidden by the compute of the layers in between starts moving them up to host
        memory. A layer not in time from here (or before the links and layer times are
        measured) is left to its swap-in, as Algorithm 1 leaves a block that does not fit the
        window. The store stages only into host room nothing else needs (`strata_kv_stage`), so
        a stage never pushes another layer to disk."""
        if not self.lookahead or "stage" in self.inflight:
            return
        for d in range(1, self.n):
            layer = (k + d) % self.n
            if self.pie.state(layer) != CPU or self.staged[layer]:
                continue
            host, disk = self._tiers(layer)
            if not disk:
                continue
            o = self.pie.overlap(k, layer, host, disk)
            self.steps["disk"] = o.steps
            if o.fits != 1:
                continue
            self.counts["stages"] += 1
            self._submit("stage", layer, self.pool_stage.submit(self._stage, layer, disk))
            return

    def _submit(self, key, layer, future):
        self.inflight[key] = (layer, future)
        future.add_done_callback(lambda f: self._finished(key, layer, f))

    def _finished(self, key, layer, future):
        """A transfer ended (on its thread): phase two, then Pie's protocol again for the layer
        running now, so a swap-out that made room starts the swap-in at once rather than at the
        next layer's start (the link never idles while a layer waits on the CPU)."""
        with self.cond:
            if self.inflight.get(key, (None, None))[1] is not future:
                return
            del self.inflight[key]
            try:
                if key == "stage":
                    self.staged[layer] = future.exception() is None
                else:
                    self.pie.swap_done(key)
                    self.counts["swap_ins" if key else "swap_outs"] += 1
                    if future.exception() is None and key:
                        self.brought_in[layer] = True
                if future.exception() is not None:
                    self.error = self.error or future.exception()
                if self.current is not None and self.error is None:
                    self._launch(*self.pie.layer_start(self.current))
                    self._stage_ahead(self.current)
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

    def _set_budget(self, tokens):
        if tokens == self.budget_tokens:
            return
        fits = layers_in_budget(self.cache, self.rows, self.page_size, tokens)
        self.budget_tokens = tokens
        self.shedding = fits < self.fits
        self.fits = fits
        floor = max(0, self.n - fits)
        if floor != self.floor:
            self.floor = floor
            self._aim(self.pie.set_floor(floor))

    def acquire(self, layer, tokens):
        """Before `layer`'s attention: the budget for `tokens`, the layer resident (waiting only
        for its own transfer, or for the swap-outs a smaller budget needs), then its pages for
        `tokens` mapped."""
        now = time.perf_counter()
        if layer == 0 and self.cache._expand:
            self._observe_step(now)
        page = self.cache._tokens_per_page
        upto = min(-(-tokens // page) * page, self.cache.max_cache_len)
        self._set_budget(upto)
        if not self.requests:
            self._admit()
        if self.inflight or not (self.all_on_device and self.cpu_layers == 0):
            if self.last is not None and self.last[0] == (layer - 1) % self.n:
                self.pie.observe_compute(self.last[0], now - self.last[1])
            if self.disk:
                # The host tier's order (TierKV): the layers from this one on, the one computed
                # last at the end, so a full host tier sends that one to disk first.
                _lib.check(kv._c().strata_kv_queue(self.space.handle, self.queues[layer], len(self.requests)))
            with self.cond:
                self._raise_error()
                self.current = layer
                self._protocol(layer)
        # Whole pages ahead, as StrataCache: the next tokens up to the page's end need no call.
        if upto > self.held[layer]:
            append, space, more = kv._c().strata_kv_append, self.space.handle, upto - self.held[layer]
            for r in self.layer_requests(layer):
                _lib.check(append(space, r.handle, more))
            self.held[layer] = upto
        self.last = (layer, time.perf_counter())

    def _on_device(self):
        return sum(self.pie.state(l) != CPU for l in range(self.n))

    def _protocol(self, layer):
        """Pie's protocol at the start of `layer` (and the disk hop ahead of need), then waits
        until the layer is on the device (and, after the budget shrank, until no more layers
        than it holds are)."""
        waited_since = None
        while True:
            self._launch(*self.pie.layer_start(layer))
            if waited_since is None:
                self._stage_ahead(layer)
            if self.pie.state(layer) == GPU and (not self.shedding or self._on_device() <= self.fits):
                break
            if not self.inflight:
                raise _lib.error(
                    _lib.Status.INVALID_STATE,
                    f"Pie's controller left layer {layer} off the device with no transfer running",
                )
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
            self.counts["swap_ins_early_hidden"] += bool(self.predicted[layer])
        self.brought_in[layer] = False
        self.predicted[layer] = None
        if self.cpu_layers == 0 and not self.inflight:
            self.all_on_device = self._on_device() == self.n

    def _observe_step(self, now):
        if self.step_start is not None:
            self._aim(self.pie.observe(self.step_waited, self.rows / max(now - self.step_start, 1e-9)))
        self.step_start, self.step_waited = now, False

    def _aim(self, cpu_layers):
        self.cpu_layers = cpu_layers
        if cpu_layers:
            self.all_on_device = False

    def _admit(self):
        """Every (layer, row) request at once, so that slot `layer * rows + row` is that row of
        that layer."""
        self.requests = self.space.admit_many(self.n * self.rows)
        handles = [r.handle for r in self.requests]
        per = self.rows
        self.queues = [
            (ctypes.c_uint64 * len(handles))(*(handles[k * per :] + handles[: k * per])) for k in range(self.n)
        ]

    def release_requests(self):
        self.drain()
        requests, self.requests, self.queues = self.requests, [], []
        self.held = [0] * self.n
        self.staged = [False] * self.n
        for r in requests:
            r.release()
        self.step_start = self.last = None

    def truncate(self, tokens):
        """Every layer keeps its first `tokens` tokens (the pages past them go back; the clean
        copies of the pages cut go too)."""
        self.drain()
        for layer in range(self.n):
            if self.held[layer] > tokens:
                for r in self.layer_requests(layer):
                    r.truncate(tokens)
                self.held[layer] = tokens
        self.last = None

    def stats(self):
        out = dict(self.counts)
        out.update(
            layers_on_device=self._on_device(),
            cpu_layers=self.cpu_layers,
            floor=self.floor,
            device_budget=self.cache.device_budget,
            lookahead=self.lookahead,
            lookahead_host_layers=self.steps["host"],
            lookahead_disk_layers=self.steps["disk"],
        )
        return out

    def shutdown(self):
        """Stops the transfer threads (after `drain`; the swapper is unusable after this)."""
        for pool in (self.pool_in, self.pool_out, self.pool_stage):
            pool.shutdown(wait=True)
