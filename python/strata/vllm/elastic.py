"""Elastic KV for vLLM: the model runner's KV tensors live in one strata KV space at fixed
addresses; pages are mapped when the scheduler's block pool hands blocks out and returned when
whole groups of blocks fall free. A space belongs to one engine: the scheduler built with the
model runner's vLLM config attaches to it, and the engine's shutdown closes it.

Geometry. vLLM views every attention layer's cache as ``[B, H, N, C]`` bytes where a block ``B``
is one dense page of ``block_bytes``. Each vLLM layer gets one strata tensor (strata layer
``i // 2``, K for even ``i``, V for odd ``i``: a strata "K/V" is just a second tensor here), and a
strata *token* is ``token_bytes`` = the smaller of the block and the strata page. A strata request
is a *group*: one slot of ``blocks_per_group`` consecutive vLLM blocks (one page or one block,
whichever is larger), mapped in every layer at once by ``append``. vLLM block ``b`` lives in
group ``b // blocks_per_group``; the slot strata gives an admitted request is the group it maps.

Unmapped groups read as zeros (the space's zero page). Returning a group to the pool truncates
its request to no tokens: the pages go back to the pool at once, nothing is copied, and the
request keeps its slot (``release`` would keep the pages mapped for the slot's next request).

Trimming. A group whose blocks all fell free stays mapped: ``spare_groups`` of them for good (a
busy pool does not thrash), the others for ``trim_delay`` seconds (a burst after a short pause
finds its pages mapped). A process-wide trimmer thread (trimmer.py) unmaps them once their
delay is over, so an engine that goes idle returns its pages without another step. An engine
short of pages first takes back, at once, the delayed groups of the other engines of its
process. The trimmer works on vLLM's block pool (free queue, prefix cache) only under the
engine's ``engine_lock``, which the scheduler holds over every call that reads or changes the
pool (patches.py).

Limit. ``limit_bytes`` (None: the device's room) caps the bytes mapped: beyond it no group is
mapped (vLLM queues and preempts as on a smaller device) and free groups are unmapped at once,
spares too. It comes from ``STRATA_VLLM_KV_LIMIT``, ``set_limit``, or from outside through the
control folder (strata.vllm.control), which the trimmer thread reads every ``POLL_S`` seconds.
"""

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
import weakref

import strata
import strata.kv
from strata import _lib

from . import control
from .trimmer import Trimmer, trim

# A child of vLLM's logger: its lines go wherever vLLM sends its own.
log = logging.getLogger("vllm.strata")

# The open ElasticKv instances of this process, oldest first, by weak reference: a space lives
# as long as its engine (the block pool holds it) and leaves when the engine shuts down.
_SPACES = []
_SERIALS = itertools.count()


def _env_number(name, default, parse, expected):
    """``parse`` of the environment's ``name`` (non-negative and finite), or ``default`` when it
    is unset or empty; a ValueError naming the variable otherwise."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        x = parse(value)
    except ValueError:
        x = None
    if x is None or not x >= 0 or math.isinf(x):
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return x


def _env_float(name, default):
    return _env_number(name, default, float, "a non-negative number of seconds")


def _env_int(name, default):
    return _env_number(name, default, int, "a non-negative integer")


class ElasticKv:
    """One KV space behind all of a model runner's attention layers, and its group map."""

    def __init__(
        self,
        num_layers,
        num_blocks,
        block_bytes,
        device=0,
        spare_groups=None,
        owner=None,
        trim_delay=None,
    ):
        self.device = device
        # The vLLM config of the model runner the space was made for: the scheduler built with
        # the same config object attaches its block pool to this space, and to no other.
        self.owner = owner
        self.label = str(next(_SERIALS))  # the metrics' engine label, never reused
        self.closed = False
        page = strata.stats(device)["page_size"]
        if block_bytes % page and page % block_bytes:
            raise strata.InvalidArgument(
                f"strata.vllm: a KV block of {block_bytes} B and the strata page of {page} B "
                "must divide one another (change the block size or STRATA_HOST_GRANULARITY)"
            )
        self.page_size = page
        self.block_bytes = block_bytes
        self.token_bytes = min(block_bytes, page)
        group_bytes = max(block_bytes, page)
        self.blocks_per_group = group_bytes // block_bytes
        self.tokens_per_group = group_bytes // self.token_bytes
        self.num_blocks = num_blocks
        self.num_groups = math.ceil(num_blocks / self.blocks_per_group)
        self.num_layers = num_layers
        self.tensors_per_group = 2 * math.ceil(num_layers / 2)
        self.group_bytes = group_bytes * self.tensors_per_group
        self.spare_groups = (
            _env_int("STRATA_VLLM_SPARE_GROUPS", 2) if spare_groups is None else spare_groups
        )
        self.trim_delay = (
            _env_float("STRATA_VLLM_TRIM_DELAY", 2.0) if trim_delay is None else trim_delay
        )
        limit = os.environ.get("STRATA_VLLM_KV_LIMIT", "")
        try:
            self.limit_bytes = control.parse_limit(limit) if limit else None
        except control.ControlError as e:
            raise ValueError(f"STRATA_VLLM_KV_LIMIT={limit!r}: {e}") from None
        self.space = strata.kv.KvSpace(
            layers=self.tensors_per_group // 2,
            kv_heads=1,
            head_dim=self.token_bytes,
            dtype="int8",
            max_requests=self.num_groups,
            max_tokens=self.tokens_per_group,
            zero_page=True,
            host_bytes=0,
            device=device,
        )
        self._lock = threading.Lock()  # the group map (short holds, never around vLLM calls)
        # Held by the scheduler over each call that reads or changes vLLM's block pool, and by
        # whoever else changes that pool (the trimmer, a peer engine short of pages, sleep).
        self.engine_lock = threading.RLock()
        # Every slot is held by a request for the space's life (slot i = group i), so the slot a
        # group lands in never depends on strata's choice; a group is mapped when its request
        # holds tokens_per_group tokens and empty otherwise.
        self._requests = [self._admit(g) for g in range(self.num_groups)]
        self._groups = set()  # mapped groups
        self._mapped_blocks = 0  # blocks of the mapped groups
        self._free_since = {}  # mapped group whose blocks are all free -> since (monotonic s)
        self._pinned = {0}  # vLLM's null block lives in group 0
        self.block_pool = None  # the scheduler's BlockPool, once it exists
        # (force) -> groups unmapped: unmaps the free groups beyond the spares whose delay is
        # over (all of them with force). Set with block_pool; call it under engine_lock.
        self.trim = None
        # () -> the freed blocks a KV connector may still read or write (its stores of them
        # may not have run yet): their groups stay mapped until it is done with them.
        self.busy_blocks = None
        self.unmaps_deferred = 0
        self.maps = 0
        self.unmaps = 0
        self.peak_mapped_groups = 0
        self._last_log = None  # the first allocation logs at once
        self._ranges = []  # (first, end) addresses of the layer tensors handed out
        self._pool_stats = _lib.Stats()
        self._control = None
        directory = control.folder()
        if directory:
            try:
                self._control = control.Endpoint(directory, self.label)
            except (control.ControlError, OSError) as e:
                log.error(
                    "strata.vllm: KV space %s runs without a control folder: %s", self.label, e
                )
        _SPACES.append(weakref.ref(self))
        if self._control is not None:
            self.poll_control()
            _TRIMMER.start_polling()

    def layer_tensor(self, index):
        """Layer ``index``'s raw bytes: a flat int8 CPU/CUDA tensor over its strata tensor."""
        import torch

        kind = "k" if index % 2 == 0 else "v"
        t = torch.from_dlpack(self.space.tensor(index // 2, kind)).view(-1)
        self._ranges.append((t.data_ptr(), t.data_ptr() + t.numel()))
        return t

    def holds(self, address):
        """Whether ``address`` lies in one of this space's layer tensors."""
        return any(first <= address < end for first, end in self._ranges)

    # ---- the block pool's side ------------------------------------------------------------

    def group_of(self, block_id):
        return block_id // self.blocks_per_group

    def group_blocks(self, group):
        first = group * self.blocks_per_group
        return range(first, min(first + self.blocks_per_group, self.num_blocks))

    def map_groups(self, block_ids):
        """Maps the groups of ``block_ids`` not mapped yet (every layer at once). Returns the
        groups the pool had no pages for (out of memory is an outcome, not an error)."""
        failed = set()
        with self._lock:
            for g in sorted({self.group_of(b) for b in block_ids}):
                self._free_since.pop(g, None)
                if g in self._groups:
                    continue
                if len(self._groups) >= self._limit_groups():
                    failed.add(g)
                    continue
                try:
                    self._map(g)
                except strata.OutOfMemory:
                    failed.add(g)
        return failed

    def is_mapped(self, block_id):
        return self.group_of(block_id) in self._groups

    def free_blocks(self, queued, blocks_out):
        """The blocks vLLM may take now: free blocks on mapped groups plus those the pool's free
        pages could map (never more than the ``queued`` free blocks). ``blocks_out`` counts the
        blocks not in the free queue (in use, and the null block), all on mapped groups."""
        on_mapped = self._mapped_blocks - blocks_out
        if on_mapped >= queued:
            return queued
        mappable = self._mappable_groups()
        if on_mapped + mappable * self.blocks_per_group < queued and _reclaim_for(self):
            mappable = self._mappable_groups()
        return min(queued, on_mapped + mappable * self.blocks_per_group)

    def _mappable_groups(self):
        # The scheduler asks once per request per step: one struct refilled in place, two fields
        # read (strata.stats() builds a dict of every field, most of this call's cost).
        st = self._pool_stats
        _lib.check(_lib.lib().strata_stats(self.device, st))
        # Two pages of slack: the zero page and rounding in the pool's own accounting.
        room = st.total_bytes - st.pool_in_use_bytes - 2 * self.page_size
        groups = min(self.num_groups, self._limit_groups()) - len(self._groups)
        return max(min(max(room, 0) // self.group_bytes, groups), 0)

    def _limit_groups(self):
        """The most groups the limit allows (at least the null block's)."""
        limit = self.limit_bytes
        return self.num_groups if limit is None else max(limit // self.group_bytes, 1)

    def set_limit(self, limit_bytes):
        """Caps the bytes this space maps (None: no cap but the device's room). Free groups
        beyond it are unmapped now (waiting for the engine's current scheduler call, if any);
        groups in use stay until their blocks fall free. Returns the groups unmapped."""
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or limit_bytes < 0):
            raise strata.InvalidArgument(
                f"strata.vllm: KV limit {limit_bytes!r}: expected a byte count >= 0 or None"
            )
        with self.engine_lock:  # not between a scheduler's count of free blocks and its take
            self.limit_bytes = limit_bytes
            unmapped = trim(self)
        log.info(
            "strata.vllm: KV space %s limit %s (%d free groups unmapped)",
            self.label,
            "none" if limit_bytes is None else f"{limit_bytes} B",
            unmapped,
        )
        return unmapped

    def poll_control(self):
        """Reads the control folder's limit for this space (applied if it changed) and
        publishes the space's figures there. Runs on the trimmer thread."""
        if self._control is None or self.closed:
            return
        try:
            changed, limit = self._control.read_limit()
            if changed:
                self.set_limit(limit)
        except (OSError, ValueError) as e:
            log.error("strata.vllm: KV space %s: control file not applied: %s", self.label, e)
        s = self.stats()
        self._control.publish(
            {
                "pid": os.getpid(),
                "label": self.label,
                **{k: s[k] for k in ("virtual_bytes", "mapped_bytes", "limit_bytes")},
                **{k: s[k] for k in ("groups_mapped", "groups_total", "group_bytes")},
            }
        )

    def _admit(self, group):
        r = self.space.admit()
        if r.slot != group:
            # Only one slot is free whenever this runs (every other one is held).
            r.release()
            raise strata.InvalidState(f"strata.vllm: strata gave slot {r.slot} for group {group}")
        return r

    def _map(self, group):
        self._requests[group].append(self.tokens_per_group)
        self._groups.add(group)
        self._mapped_blocks += len(self.group_blocks(group))
        self.maps += 1
        self.peak_mapped_groups = max(self.peak_mapped_groups, len(self._groups))

    def used(self, block_ids):
        """Blocks taken out of the free state without get_new_blocks (prefix-cache hits)."""
        with self._lock:
            for b in block_ids:
                self._free_since.pop(self.group_of(b), None)

    def maybe_free(self, blocks_by_id=None, force=False):
        """Called after blocks were freed (after each engine step and by the trimmer, with
        none): the groups all of whose blocks are free become candidates; beyond
        ``spare_groups`` of them, those free for ``trim_delay`` seconds (any, with ``force``)
        are unmapped, highest first, except those holding a block a KV transfer may still read
        (``busy_blocks``: they wait for a later call). Returns the groups to unmap (the caller
        takes their blocks out of the prefix cache first) and asks the trimmer to come back
        when the next delay is over."""
        now = time.monotonic()
        with self._lock:
            for g, blocks in (blocks_by_id or {}).items():
                if g in self._groups and g not in self._pinned and all(
                    b.ref_cnt == 0 for b in blocks
                ):
                    self._free_since.setdefault(g, now)
            excess = len(self._free_since) - self.spare_groups
            over = len(self._groups) - self._limit_groups()
            if over > 0:  # spares and delays give way to the limit
                excess, force = max(excess, min(over, len(self._free_since))), True
            if excess <= 0:
                return []
            due = self.trim_delay if not force else 0.0
            ripe = sorted((g for g, t in self._free_since.items() if now - t >= due), reverse=True)
            waiting = [t + due for g, t in self._free_since.items() if now - t < due]
        if len(ripe) < excess and waiting:
            _TRIMMER.wake(min(waiting))
        if not ripe:
            return []
        busy = self._busy()
        out = [g for g in ripe if busy.isdisjoint(self.group_blocks(g))][:excess]
        self.unmaps_deferred += min(excess, len(ripe)) - len(out)
        return out

    def still_free(self, group, blocks):
        """Whether ``group`` (a maybe_free answer) has all ``blocks`` free (else it is forgotten)
        and none a KV transfer may still read."""
        busy = self._busy()
        with self._lock:
            if not all(b.ref_cnt == 0 for b in blocks):
                self._free_since.pop(group, None)
                return False
        return busy.isdisjoint(self.group_blocks(group))

    def _busy(self):
        return self.busy_blocks() if self.busy_blocks is not None else frozenset()

    def unmap(self, group):
        with self._lock:
            self._requests[group].truncate(0)  # a failure here leaves the group mapped, counted
            self._groups.discard(group)
            self._free_since.pop(group, None)
            self._mapped_blocks -= len(self.group_blocks(group))
            self.unmaps += 1

    def close(self):
        """The engine shut down: every group's pages go back to the pool (its tensors read
        zeros from now on), the space leaves this process's list (and the metrics), and the
        KV space itself is destroyed once the last tensor over it is released. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            requests, self._requests = self._requests, []
            self._groups.clear()
            self._free_since.clear()
            self._mapped_blocks = 0
        _SPACES[:] = [w for w in _SPACES if w() not in (None, self)]
        self.block_pool = None
        self.trim = None
        if self._control is not None:
            self._control.remove()
        for r in requests:
            r.truncate(0)
            r.release()
        self.space.close_when_released()
        log.info("strata.vllm: KV space %s closed (its engine shut down)", self.label)

    # ---- operator view ---------------------------------------------------------------------

    def mapped_group_list(self):
        with self._lock:
            return sorted(self._groups)

    def mapped_groups(self):
        with self._lock:
            return len(self._groups)

    def stats(self):
        """Groups and bytes mapped, with the KV space's own figures (tiers, bytes moved)."""
        s = self.space.stats()
        with self._lock:
            mapped = len(self._groups)
        return {
            "virtual_blocks": self.num_blocks,
            "blocks_per_group": self.blocks_per_group,
            "groups_total": self.num_groups,
            "groups_mapped": mapped,
            "group_bytes": self.group_bytes,
            "limit_bytes": self.limit_bytes,
            "groups_spare": len(self._free_since),
            "mapped_bytes": mapped * self.group_bytes,
            "virtual_bytes": self.num_groups * self.group_bytes,
            "peak_mapped_bytes": self.peak_mapped_groups * self.group_bytes,
            "maps": self.maps,
            "unmaps": self.unmaps,
            "unmaps_deferred": self.unmaps_deferred,
            "pool_in_use_bytes": s["pool_in_use_pages"] * s["page_size"],
            "host_used_bytes": s["host_used_bytes"],
            "disk_used_bytes": s["disk_used_bytes"],
            "bytes_to_device": s["bytes_to_device"],
            "bytes_from_device": s["bytes_from_device"],
            "prefetch_hits": s["prefetch_hits"],
        }

    def maybe_log(self):
        """One INFO line at the first allocation, then at most one per STRATA_VLLM_LOG_INTERVAL
        seconds (default 10; 0: never)."""
        interval = _env_int("STRATA_VLLM_LOG_INTERVAL", 10)
        now = time.monotonic()
        if interval == 0 or (self._last_log is not None and now - self._last_log < interval):
            return
        self._last_log = now
        s = self.stats()
        log.info(
            "strata KV: %d/%d groups mapped (%.1f MiB of %.1f MiB virtual), %d spare, "
            "%d maps, %d unmaps, pool %.1f MiB in use, host tier %.1f MiB, moved %.1f MiB",
            s["groups_mapped"],
            s["groups_total"],
            s["mapped_bytes"] / 2**20,
            s["virtual_bytes"] / 2**20,
            s["groups_spare"],
            s["maps"],
            s["unmaps"],
            s["pool_in_use_bytes"] / 2**20,
            s["host_used_bytes"] / 2**20,
            (s["bytes_to_device"] + s["bytes_from_device"]) / 2**20,
        )


def _reclaim_for(kv):
    """``kv`` is short of pages: the other engines of this process give back, at once, the
    free groups they keep only for their delay (not their spares; not an engine that is
    stepping now). Returns whether any group came back."""
    return sum(trim(peer, force=True, blocking=False) for peer in spaces() if peer is not kv) > 0




def spaces():
    """The open ElasticKv instances of this process, oldest first."""
    live = [w() for w in _SPACES]
    return [kv for kv in live if kv is not None and not kv.closed]


_TRIMMER = Trimmer(spaces)


def newest():
    live = spaces()
    return live[-1] if live else None


def owner_of(tensor):
    """The open ElasticKv whose memory ``tensor`` views, or None."""
    address = tensor.data_ptr()
    return next((kv for kv in reversed(spaces()) if kv.holds(address)), None)


def space_for(vllm_config, num_blocks):
    """The open ElasticKv made for the model runner of ``vllm_config`` (the same object) with
    ``num_blocks`` blocks, the newest if several (a profiling run's KV comes first), or None."""
    return next(
        (
            kv
            for kv in reversed(spaces())
            if kv.owner is vllm_config and kv.num_blocks == num_blocks
        ),
        None,
    )


def layer_views(
    kv_cache_config, layout, kernel_block_sizes, views_fn, shape_fn, dims, device=0, owner=None
):
    """The per-layer views vLLM's ``allocate_kv_cache`` would return, over a new ElasticKv.

    ``views_fn`` is vLLM's ``create_kv_cache_views`` and ``shape_fn`` its
    ``compute_layer_kv_cache_shape_bytes``; ``dims`` = (_DIM_B, _DIM_H, _DIM_N, _DIM_C);
    ``device`` the strata device (vLLM's device index); ``owner`` the model runner's vLLM
    config (ElasticKv.owner)."""
    order = layout.value
    b, rest = dims[0], dims[1:]
    if any(order.index(b) > order.index(d) for d in rest):
        raise strata.Unsupported(
            f"strata.vllm: KV layout {layout.name} does not keep a block's bytes together; "
            "set VLLM_KV_CACHE_LAYOUT to a layout with B before H, N and C (e.g. LBHNC)"
        )
    groups = kv_cache_config.kv_cache_groups
    entries = []  # (tensor, layer name, spec, kernel block size)
    for tensor in kv_cache_config.kv_cache_tensors:
        gid = next(i for i, g in enumerate(groups) if tensor.layers[0] in g.layer_names)
        spec = groups[gid].kv_cache_spec
        if hasattr(spec, "kv_cache_specs"):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        if not spec.has_layer_views or getattr(spec, "page_size_padded", None) is not None:
            raise strata.Unsupported(
                f"strata.vllm: KV spec {type(spec).__name__} of {tensor.layers[0]} is not a "
                "plain attention cache (raw or padded pages)"
            )
        kbs = None
        if kernel_block_sizes and gid < len(kernel_block_sizes):
            kbs = kernel_block_sizes[gid]
        for name in tensor.layers:
            entries.append((tensor, name, spec, kbs))
    num_blocks = {kv_cache_config.num_blocks_of(t) for t, *_ in entries}
    block_bytes = {math.prod(shape_fn(spec, 1, kbs)) for _, _, spec, kbs in entries}
    if len(num_blocks) != 1 or len(block_bytes) != 1:
        raise strata.Unsupported(
            "strata.vllm: layers with different block counts or page sizes "
            f"({sorted(num_blocks)} blocks, {sorted(block_bytes)} B)"
        )
    (blocks,), (page,) = num_blocks, block_bytes
    kv = ElasticKv(len(entries), blocks, page, device=device, owner=owner)
    views = {}
    for index, (tensor, name, spec, kbs) in enumerate(entries):
        raw = kv.layer_tensor(index)
        one = dataclasses.replace(
            tensor, layers=[name], offset=0, layer_stride=raw.numel(), block_stride=page
        )
        (views[name],) = views_fn(raw, spec, blocks, layout, one, kernel_block_size=kbs)
    # Block 0 is vLLM's null block: its group stays mapped (padding may read or write it).
    if kv.map_groups([0]):
        raise strata.OutOfMemory("strata.vllm: no pages for the null block's group")
    log.info(
        "strata.vllm: %d layers, %d blocks of %d B in %d groups of %d blocks (%.1f MiB virtual)",
        len(entries),
        blocks,
        page,
        kv.num_groups,
        kv.blocks_per_group,
        kv.num_groups * kv.group_bytes / 2**20,
    )
    return kv, views


# ---- the block pool's side: trimming vLLM's BlockPool (patches.py's block-pool patch) ----


def unmap_free_group(pool, group):
    """Unmaps ``group`` if all its blocks are free: they leave the prefix cache and move to the
    back of the free queue (reused after every block of a mapped group). Returns whether it did."""
    kv = pool._strata_kv
    members = [pool.blocks[i] for i in kv.group_blocks(group)]
    if not kv.still_free(group, members):
        return False
    for b in members:
        pool.free_block_queue.remove(b)
        pool._maybe_evict_cached_block(b)
    if pool._reuse_watchers:
        pool._notify_reuse(members)
    try:
        kv.unmap(group)
    finally:
        pool.free_block_queue.append_n(members)
    return True


def first_unmapped(pool):
    """The first block of the free queue whose group is not mapped (the queue's fake tail if
    none): every block before it lies on a mapped group. Kept on the pool and checked, not
    trusted: when the blocks ahead of it were handed out (their groups now mapped), the walk
    from the head passes at most the rest of those groups."""
    kv, queue = pool._strata_kv, pool.free_block_queue
    tail = queue.fake_free_list_tail
    if kv.mapped_groups() == kv.num_groups:
        return tail
    block = pool._strata_first_unmapped
    stale = block is None or block is tail or block.prev_free_block is None
    if stale or kv.is_mapped(block.block_id):
        block = queue.fake_free_list_head.next_free_block
        while block is not tail and kv.is_mapped(block.block_id):
            block = block.next_free_block
        pool._strata_first_unmapped = block
    return block


def keep_mapped_ahead(pool, freed):
    """vLLM's free_blocks put the freed blocks that hold cached KV at the tail of the free
    queue (reused last, LRU), behind the blocks of unmapped groups, so the next request would
    map a new group while these sit mapped. They move to just before the first unmapped block,
    in order: free blocks of mapped groups are handed out first (uncached ones, at the head,
    then cached ones, oldest first), unmapped groups' blocks last."""
    queue = pool.free_block_queue
    tail = queue.fake_free_list_tail
    # (in the queue, holding cached KV: the ones vLLM appended)
    moved = [b for b in freed if b.next_free_block is not None and b.block_hash is not None]
    if not moved:
        return
    first = first_unmapped(pool)
    if first is tail:
        return
    for b in moved:
        queue.remove(b)
        # FreeKVCacheBlockQueue has no insert: link b in before ``first`` (vLLM 0.32's fields).
        before = first.prev_free_block
        before.next_free_block, b.prev_free_block = b, before
        b.next_free_block, first.prev_free_block = first, b
        queue.num_free_blocks += 1


def trim_pool(pool, blocks=(), force=False):
    """After ``blocks`` of ``pool`` fell free (or with none, to retry): unmaps the groups
    ElasticKv.maybe_free answers. Call it under the space's engine lock. Returns how many."""
    kv = pool._strata_kv
    if kv is None:
        return 0
    groups = {kv.group_of(b.block_id) for b in blocks if b.pool is None or b.pool is pool}
    candidates = {g: [pool.blocks[i] for i in kv.group_blocks(g)] for g in groups}
    return sum(unmap_free_group(pool, g) for g in kv.maybe_free(candidates, force=force))
