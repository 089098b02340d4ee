"""The patches strata.vllm applies to vLLM. Each names the vLLM versions it was written against
and checks, before touching anything, that its targets exist with the signatures it expects: on
any other version, or a target that changed, it refuses with UnsupportedVllm instead of patching
something it does not understand (the machinery: _patching.py; the block pool's trim helpers:
elastic.py).

Patches (all in the process that runs the model runner and the scheduler):
  kv-tensors  vllm.v1.worker.gpu_model_runner.allocate_kv_cache: the KV tensors become views of
              one strata KV space (strata.vllm.elastic) instead of one torch.zeros buffer;
              GPUModelRunner.initialize_kv_cache_tensors tells it whose (the runner's config).
  block-pool  vllm.v1.core.sched.scheduler.Scheduler (__init__, shutdown, update_from_output):
              the scheduler's block pool attaches to the KV space made for the model runner of
              the same vLLM config (several engines may be built in any order), the engine's
              shutdown closes that space (pages back to the pool, out of the metrics), and
              free groups whose blocks vLLM's OffloadingConnector may still store stay mapped
              until it is done (retried after each step; other KV connectors are refused);
              Scheduler (schedule, update_from_output, finish_requests, add_request,
              reset_prefix_cache, shutdown) run under the space's engine lock, so that the
              trimmer thread and peer engines change the block pool only between them;
              vllm.v1.core.block_pool.BlockPool (get_new_blocks, get_num_free_blocks,
              reset_prefix_cache, touch, free_blocks, unpin_blocks): blocks handed out map
              their group's pages; groups whose blocks all fell free are unmapped beyond
              STRATA_VLLM_SPARE_GROUPS once free for STRATA_VLLM_TRIM_DELAY seconds
              (hysteresis; elastic.py), their blocks leaving the prefix cache and moving to the
              back of the free queue; freed blocks that hold cached KV go ahead of those (not
              behind them, as vLLM would put them), so mapped groups' blocks are used first;
              the free count vLLM schedules by is bounded by the pages the pool can still map
              (and the engine's KV limit), and blocks of groups it could not map are swapped
              for free blocks of mapped groups, so a small pool makes vLLM queue and preempt
              instead of failing (reset_prefix_cache still sees the plain count).
  cpu-sleep   vllm.v1.worker.cpu_worker.CPUWorker.sleep (a no-op in vLLM's CPU build): level >= 1
              unmaps every KV group of that worker's KV space whose blocks are free; wake needs
              nothing.
  gpu-sleep   vllm.v1.worker.gpu_worker.Worker.sleep: the stock sleep (weights, through the
              sleep-mode backend), then the same unmapping (strata's KV is not in the CuMem pool
              vLLM passes as kv_cache_allocation_context). Written from vLLM's code, run only on
              a GPU: not tested yet.
"""

import contextvars
import functools

import strata

from . import elastic
from ._patching import Patch, UnsupportedVllm
from .elastic import keep_mapped_ahead, trim_pool, unmap_free_group


# ---- kv-tensors -----------------------------------------------------------------------------


# The model runner allocating its KV cache now (this thread / task).
_ALLOCATING_FOR = contextvars.ContextVar("strata_vllm_allocating_for", default=None)


def _apply_kv_tensors():
    import vllm.v1.worker.gpu_model_runner as runner
    from vllm.v1 import kv_cache_interface as kci
    from vllm.v1 import kv_cache_layout as layout_mod

    stock = runner.allocate_kv_cache
    if getattr(stock, "_strata", False):
        return
    dims = (layout_mod._DIM_B, layout_mod._DIM_H, layout_mod._DIM_N, layout_mod._DIM_C)
    stock_tensors = runner.GPUModelRunner.initialize_kv_cache_tensors

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, *args, **kwargs):
        # allocate_kv_cache learns whose KV it makes: the scheduler built with this config
        # attaches to that space (block-pool), whatever other engines do meanwhile.
        token = _ALLOCATING_FOR.set(self)
        try:
            return stock_tensors(self, kv_cache_config, kernel_block_sizes, *args, **kwargs)
        finally:
            _ALLOCATING_FOR.reset(token)

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        if not kv_cache_config.kv_cache_tensors:
            return stock(kv_cache_config, device, layout, kernel_block_sizes)
        _refuse_connector_pool()
        runner_now = _ALLOCATING_FOR.get()
        kv, views = elastic.layer_views(
            kv_cache_config,
            layout,
            kernel_block_sizes,
            kci.create_kv_cache_views,
            kci.compute_layer_kv_cache_shape_bytes,
            dims,
            device=device.index or 0,
            owner=getattr(runner_now, "vllm_config", None),
        )
        if runner_now is not None:
            # The space lives as long as the model runner (or the block pool) holds it.
            runner_now._strata_kv = kv
        got = next(iter(views.values())).device
        if got.type != device.type:
            raise UnsupportedVllm(
                f"strata.vllm: the KV space's tensors are {got.type} tensors, vLLM runs on "
                f"{device} (strata's backend and vLLM's device must agree)"
            )
        return views

    allocate_kv_cache._strata = True
    runner.allocate_kv_cache = allocate_kv_cache
    runner.GPUModelRunner.initialize_kv_cache_tensors = initialize_kv_cache_tensors


def _refuse_connector_pool():
    """GPU workers allocate the KV inside ``kv_cache_allocation_context``: CuMemAllocator's
    "kv_cache" pool (sleep mode; strata handles sleep itself, see gpu-sleep) or a KV connector's
    own pool, which the connector registers for transfers. strata's KV cannot live in the
    latter: refuse instead of handing the connector memory it did not place."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group() and get_kv_transfer_group().get_mem_pool_context() is not None:
        name = type(get_kv_transfer_group()).__name__
        raise UnsupportedVllm(
            f"strata.vllm: KV connector {name} places the KV cache in its own memory pool; "
            "strata's elastic KV cannot (unset STRATA_VLLM or use another connector)"
        )


# ---- block-pool -----------------------------------------------------------------------------


def attach(scheduler, vllm_config, kv_cache_config):
    """Attaches the scheduler's block pool to the KV space made for the model runner of the
    same ``vllm_config`` (identity, not creation order). Without one, the pool stays stock when
    the engine has no KV tensors; otherwise the model runner lives in another process, where
    strata's KV would never be mapped: refused."""
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    if pool is None:
        raise UnsupportedVllm(
            "strata.vllm: vLLM's scheduler has no kv_cache_manager.block_pool; refusing to run "
            "on a block pool strata does not map"
        )
    kv = elastic.space_for(vllm_config, pool.num_gpu_blocks)
    if kv is None:
        if kv_cache_config.kv_cache_tensors:
            raise UnsupportedVllm(
                "strata.vllm: the scheduler's block pool has no strata KV space of "
                f"{pool.num_gpu_blocks} blocks made for its engine in this process (the model "
                "runner must run in the scheduler's process: one worker, no multiprocessing "
                "executor)"
            )
        return
    if kv.block_pool is not None:
        raise UnsupportedVllm(f"strata.vllm: KV space {kv.label} already has a block pool")
    kv.busy_blocks = connector_busy_blocks(scheduler)
    pool._strata_kv = kv
    kv.block_pool = pool
    kv.trim = lambda force=False: trim_pool(pool, force=force)


def connector_busy_blocks(scheduler):
    """The scheduler's KV connector may read blocks after vLLM freed them: vLLM's
    OffloadingConnector stores a preempted or finished request's blocks in a later step and
    fences them only against their reuse, while strata unmaps a free group at once. Returns a
    function giving those blocks (its pending stores' source blocks, and the blocks of finished
    requests whose stores are not built yet), or None without a connector; another connector
    is refused."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return None
    side = getattr(connector, "connector_scheduler", None)
    if (
        type(connector).__name__ != "OffloadingConnector"
        or not hasattr(side, "_jobs")
        or not hasattr(side, "_req_status")
    ):
        raise UnsupportedVllm(
            f"strata.vllm: KV connector {type(connector).__name__} may read KV blocks after "
            "vLLM frees them, and strata unmaps free blocks; with the elastic KV, only vLLM's "
            "OffloadingConnector is supported (unset STRATA_VLLM or use it)"
        )

    def busy():
        out = set()
        for job in side._jobs.values():
            if job.is_store:
                out.update(job.deferred_fence_block_ids or ())
                out.update(job.fenced_block_ids or ())
        for state in side._req_status.values():
            if state.req.is_finished():
                for group in state.group_states:
                    out.update(group.block_ids)
        return out

    return busy


def _apply_block_pool():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(BlockPool, "_strata", False):
        return
    get_new, get_free, touch, free, unpin, reset = (
        BlockPool.get_new_blocks,
        BlockPool.get_num_free_blocks,
        BlockPool.touch,
        BlockPool.free_blocks,
        BlockPool.unpin_blocks,
        BlockPool.reset_prefix_cache,
    )
    init_scheduler, shutdown_scheduler = Scheduler.__init__, Scheduler.shutdown
    update_scheduler = Scheduler.update_from_output
    for name in _LOCKED:
        setattr(Scheduler, name, _under_engine_lock(getattr(Scheduler, name)))

    def scheduler_init(self, vllm_config, kv_cache_config, *args, **kwargs):
        init_scheduler(self, vllm_config, kv_cache_config, *args, **kwargs)
        attach(self, vllm_config, kv_cache_config)

    def scheduler_update_from_output(self, scheduler_output, model_runner_output):
        out = update_scheduler(self, scheduler_output, model_runner_output)
        # Transfers that finished this step may release groups whose unmap waited for them.
        pool = self.kv_cache_manager.block_pool
        if pool._strata_kv is not None and pool._strata_kv.busy_blocks is not None:
            trim_pool(pool)
        return out

    def scheduler_shutdown(self):
        shutdown_scheduler(self)
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        kv = getattr(pool, "_strata_kv", None)
        if kv is not None:
            pool._strata_kv = None
            kv.close()

    def get_num_free_blocks(self):
        kv = self._strata_kv
        if kv is None or self._strata_all_free_check:
            return get_free(self)
        queued = self.free_block_queue.num_free_blocks
        return kv.free_blocks(queued, self.num_gpu_blocks - queued)

    def reset_prefix_cache(self):
        # It asks get_num_free_blocks whether every block is free, not how many it may take.
        self._strata_all_free_check = True
        try:
            return reset(self)
        finally:
            self._strata_all_free_check = False

    def get_new_blocks(self, num_blocks):
        blocks = get_new(self, num_blocks)
        kv = self._strata_kv
        if kv is None:
            return blocks
        try:
            failed = kv.map_groups([b.block_id for b in blocks])
            if failed:
                blocks = _swap_for_mapped(self, blocks, failed)
        except BaseException:
            free(self, blocks)
            raise
        kv.maybe_log()
        return blocks

    def _swap_for_mapped(self, blocks, failed):
        """The pool ran out of pages: blocks of groups it could not map go back to the free
        queue, replaced by free blocks of mapped groups (get_num_free_blocks promised enough;
        cached ones leave the prefix cache)."""
        kv = self._strata_kv
        bad = [b for b in blocks if kv.group_of(b.block_id) in failed]
        queue = self.free_block_queue
        spare, block = [], queue.fake_free_list_head.next_free_block
        while block is not queue.fake_free_list_tail and len(spare) < len(bad):
            if kv.is_mapped(block.block_id):
                spare.append(block)
            block = block.next_free_block
        if len(spare) < len(bad):
            raise strata.OutOfMemory(
                f"strata.vllm: {len(bad)} KV blocks need pages the pool does not have"
            )
        kv.used([b.block_id for b in spare])
        for b in spare:
            queue.remove(b)
            self._maybe_evict_cached_block(b)
            b.ref_cnt += 1
        for b in bad:
            b.ref_cnt -= 1
        queue.append_n(bad)
        swap = dict(zip((b.block_id for b in bad), spare))
        return [swap.get(b.block_id, b) for b in blocks]

    def _touch(self, blocks):
        touch(self, blocks)
        if self._strata_kv is not None:
            self._strata_kv.used([b.block_id for b in blocks])

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        free(self, blocks)
        if self._strata_kv is not None:
            keep_mapped_ahead(self, [b for b in blocks if b.pool is None or b.pool is self])
            trim_pool(self, blocks)

    def unpin_blocks(self, blocks, on_reuse):
        blocks = list(blocks)
        unpin(self, blocks, on_reuse)
        trim_pool(self, blocks)

    # Pools no scheduler attached (no strata KV) behave as stock.
    BlockPool._strata_kv = None
    BlockPool._strata_all_free_check = False
    BlockPool._strata_first_unmapped = None
    BlockPool.get_new_blocks = get_new_blocks
    BlockPool.get_num_free_blocks = get_num_free_blocks
    BlockPool.reset_prefix_cache = reset_prefix_cache
    BlockPool.touch = _touch
    BlockPool.free_blocks = free_blocks
    BlockPool.unpin_blocks = unpin_blocks
    BlockPool._strata = True
    Scheduler.__init__ = scheduler_init
    Scheduler.shutdown = _under_engine_lock(scheduler_shutdown)
    Scheduler.update_from_output = _under_engine_lock(scheduler_update_from_output)


# The Scheduler calls that read or change the block pool (the stock ones in 0.32; shutdown and
# update_from_output are wrapped again around strata's versions of them).
_LOCKED = ("schedule", "finish_requests", "add_request", "reset_prefix_cache")


def _under_engine_lock(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        kv = getattr(pool, "_strata_kv", None)
        if kv is None:
            return method(self, *args, **kwargs)
        with kv.engine_lock:
            return method(self, *args, **kwargs)

    return run


# ---- cpu-sleep, gpu-sleep ---------------------------------------------------------------------


def release_kv(worker, level):
    """Unmaps every KV group of ``worker``'s model runner whose blocks are all free (sleep
    level >= 1 discards the KV cache: the engine paused and reset the prefix cache first).
    Returns the number of groups unmapped, or None if the worker's KV is not strata's."""
    caches = getattr(worker.model_runner, "kv_caches", None)
    kv = elastic.owner_of(caches[0]) if caches else None
    pool = getattr(kv, "block_pool", None)
    if level < 1 or pool is None:
        return None
    with kv.engine_lock:
        released = sum(unmap_free_group(pool, g) for g in kv.mapped_group_list() if g)
    elastic.log.info("strata.vllm: sleep level %d unmapped %d KV groups", level, released)
    return released


def _apply_cpu_sleep():
    from vllm.v1.worker.cpu_worker import CPUWorker

    if "_strata" in CPUWorker.__dict__:
        return
    stock = CPUWorker.sleep

    def sleep(self, level=1):
        """vLLM's CPU worker ignores sleep; with strata, level >= 1 returns the KV pages. Wake
        needs nothing: groups map again as blocks are handed out."""
        if release_kv(self, level) is None:
            stock(self, level)

    CPUWorker.sleep = sleep
    CPUWorker._strata = True


def _apply_gpu_sleep():
    from vllm.v1.worker.gpu_worker import Worker

    if "_strata" in Worker.__dict__:
        return
    stock = Worker.sleep

    def sleep(self, level=1):
        """vLLM's GPU worker sleeps through its sleep-mode backend (CuMemAllocator's pools,
        entered as ``kv_cache_allocation_context``); strata's KV tensors were never allocated
        inside that pool, so after the stock sleep (weights) the KV pages go back to strata's
        pool here. ``wake_up`` needs nothing for them (groups map again on demand; vLLM treats
        a woken KV cache as discarded either way)."""
        stock(self, level)
        release_kv(self, level)

    Worker.sleep = sleep
    Worker._strata = True


V0_32 = (0, 32, 0)
V0_33 = (0, 33, 0)

PATCHES = [
    Patch(
        "kv-tensors",
        V0_32,
        V0_33,
        {
            "vllm.v1.worker.gpu_model_runner:allocate_kv_cache": [
                "kv_cache_config",
                "device",
                "layout",
                "kernel_block_sizes",
            ],
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors": [
                "self",
                "kv_cache_config",
                "kernel_block_sizes",
            ],
            "vllm.v1.kv_cache_interface:create_kv_cache_views": [
                "raw",
                "spec",
                "num_blocks",
                "layout",
                "kv_cache_tensor",
                "kernel_block_size",
            ],
            "vllm.v1.kv_cache_interface:compute_layer_kv_cache_shape_bytes": [
                "spec",
                "num_blocks",
                "kernel_block_size",
            ],
        },
        _apply_kv_tensors,
        attributes={"vllm.v1.kv_cache_layout": ["_DIM_B", "_DIM_H", "_DIM_N", "_DIM_C"]},
    ),
    Patch(
        "block-pool",
        V0_32,
        V0_33,
        {
            "vllm.v1.core.sched.scheduler:Scheduler.__init__": [
                "self",
                "vllm_config",
                "kv_cache_config",
            ],
            "vllm.v1.core.sched.scheduler:Scheduler.shutdown": ["self"],
            "vllm.v1.core.sched.scheduler:Scheduler.schedule": ["self"],
            "vllm.v1.core.sched.scheduler:Scheduler.finish_requests": [
                "self",
                "request_ids",
                "finished_status",
            ],
            "vllm.v1.core.sched.scheduler:Scheduler.add_request": ["self", "request"],
            "vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache": ["self"],
            "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": [
                "self",
                "scheduler_output",
                "model_runner_output",
            ],
            "vllm.v1.core.block_pool:BlockPool.__init__": ["self", "num_gpu_blocks"],
            "vllm.v1.core.block_pool:BlockPool.get_new_blocks": ["self", "num_blocks"],
            "vllm.v1.core.block_pool:BlockPool.touch": ["self", "blocks"],
            "vllm.v1.core.block_pool:BlockPool.free_blocks": ["self", "ordered_blocks"],
            "vllm.v1.core.block_pool:BlockPool.unpin_blocks": ["self", "blocks", "on_reuse"],
            "vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block": ["self", "block"],
            "vllm.v1.core.block_pool:BlockPool._notify_reuse": ["self", "blocks"],
            "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": ["self"],
            "vllm.v1.core.block_pool:BlockPool.reset_prefix_cache": ["self"],
            "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove": ["self", "block"],
            "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.append_n": ["self", "blocks"],
        },
        _apply_block_pool,
        attributes={
            "vllm.v1.core.block_pool:BlockPool": ["_reuse_watchers"],
            # connector_busy_blocks reads the OffloadingConnector's pending stores
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "OffloadingConnectorScheduler": ["_jobs", "_req_status"],
        },
    ),
]


PATCHES.append(
    Patch(
        "cpu-sleep",
        V0_32,
        V0_33,
        {"vllm.v1.worker.cpu_worker:CPUWorker.sleep": ["self", "level"]},
        _apply_cpu_sleep,
    )
)
PATCHES.append(
    Patch(
        "gpu-sleep",
        V0_32,
        V0_33,
        {"vllm.v1.worker.gpu_worker:Worker.sleep": ["self", "level"]},
        _apply_gpu_sleep,
    )
)


def install(version):
    """Checks every patch against ``version`` first, then applies them all (idempotent)."""
    for p in PATCHES:
        p.check(version)
    for p in PATCHES:
        p.apply()
