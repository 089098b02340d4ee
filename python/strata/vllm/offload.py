"""Tiered KV offload for vLLM: the blocks vLLM's OffloadingConnector offloads live in strata's
host and disk tiers and come back instead of being recomputed (after a preemption, an eviction
from vLLM's prefix cache, or a repeated prefix).

vLLM's own offload interfaces carry it: ``OffloadingConnector`` with an out-of-tree
``OffloadingSpec`` (``vllm/v1/kv_offload/base.py``), chosen by name in
``kv_connector_extra_config``; the only patch is the hint channel (two wraps that put the
lookahead hints on vLLM's connector metadata). Build the config with
:func:`kv_transfer_config`:

    from vllm import LLM
    import strata.vllm.offload as offload
    llm = LLM(..., kv_transfer_config=offload.kv_transfer_config(host_bytes=8 << 30,
                                                               disk_bytes=64 << 30,
                                                               disk_dir="/scratch/kv"))

Scheduler side, ``StrataOffloadingManager`` is vLLM's ``CPUOffloadingManager`` (its chunk pool
and eviction policy; ``eviction_policy`` "lru" or "arc") over as many chunks as strata's tiers
hold. Worker side, ``strata.vllm.offload_store.StrataOffloadWorker`` keeps each chunk as one
request of a strata KV space (``strata.kv``). Transfers are asynchronous (one transfer thread,
copies by ``strata_kv_copy_tokens`` on strata's own stream; vLLM polls ``get_finished``): a
store copies the chunk's blocks from vLLM's KV tensors into the request and spills it to the
host tier (the tier store moves the coldest objects on to the disk tier when host memory is
full); a load makes the request resident and copies it back (its host copy stays, clean, so
spilling it again copies nothing). When the
scheduler preempts a request, the manager hints that request's chunks to strata's lookahead
(``strata_kv_hint``): they come back to device memory ahead of the request's return, and the
load finds them there (``prefetch_hits``). The hints travel on vLLM's connector metadata, which
every worker receives each step, in the scheduler's process or another
(``install_hint_channel``: the two small wraps this module makes).

Supported: vLLM >=0.32.0,<0.33.0 (``INTERFACE``); any other version, or an offload interface
whose signatures changed, is refused with UnsupportedVllm when vLLM builds the spec. One KV cache
group (plain attention models); one chunk of one layer must be a whole number of strata pages
(``blocks_per_chunk``; the spec's error names the smallest that fits).
"""

import logging
import math
import sys

import strata
from strata import Status
from strata._lib import error

from ._patching import Patch, UnsupportedVllm

log = logging.getLogger("vllm.strata")

SPEC_NAME = "StrataOffloadingSpec"

# The vLLM interfaces this module builds on, with the parameters it calls them with.
INTERFACE = Patch(
    "kv-offload",
    (0, 32, 0),
    (0, 33, 0),
    {
        "vllm.v1.kv_offload.base:OffloadingSpec.__init__": ["self", "config"],
        "vllm.v1.kv_offload.base:OffloadingSpec.get_manager": ["self"],
        "vllm.v1.kv_offload.base:OffloadingSpec.get_worker": ["self", "kv_caches"],
        "vllm.v1.kv_offload.base:OffloadingWorker.submit_store": [
            "self",
            "job_id",
            "src_spec",
            "dst_spec",
        ],
        "vllm.v1.kv_offload.base:OffloadingWorker.submit_load": [
            "self",
            "job_id",
            "src_spec",
            "dst_spec",
        ],
        "vllm.v1.kv_offload.base:OffloadingWorker.get_finished": ["self"],
        "vllm.v1.kv_offload.base:OffloadingWorker.wait": ["self", "job_ids"],
        "vllm.v1.kv_offload.base:TransferResult": [
            "job_id",
            "success",
            "transfer_size",
            "transfer_time",
        ],
        "vllm.v1.kv_offload.base:GPULoadStoreSpec.__init__": [
            "self",
            "block_ids",
            "group_sizes",
            "block_indices",
        ],
        "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.__init__": [
            "self",
            "num_chunks",
            "cache_policy",
            "cache_policy_module_path",
            "enable_events",
        ],
        "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.prepare_store": [
            "self",
            "keys",
            "req_context",
        ],
        "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.on_schedule_end": [
            "self",
            "context",
        ],
        "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.on_request_finished": [
            "self",
            "req_context",
        ],
        "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.reset_cache": ["self"],
        # the hint channel (install_hint_channel)
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
        "OffloadingConnectorScheduler.build_connector_meta": ["self", "scheduler_output"],
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker:"
        "OffloadingConnectorWorker.start_kv_transfers": ["self", "metadata"],
    },
    lambda: None,
)

# The attribute of vLLM's OffloadingConnectorMetadata that carries the hints to the workers.
HINTS = "strata_hints"


def install_hint_channel():
    """Lets the chunk manager's lookahead hints ride on vLLM's connector metadata, the object
    the scheduler builds every step and every worker receives (pickled to workers in other
    processes): OffloadingConnectorScheduler.build_connector_meta sets ``strata_hints`` on it
    from a manager with ``take_hints``, and OffloadingConnectorWorker.start_kv_transfers hands
    them to a worker with ``hint`` before the step's transfers. Other specs are untouched.
    Idempotent; checked with INTERFACE."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler, worker

    side, work = scheduler.OffloadingConnectorScheduler, worker.OffloadingConnectorWorker
    if getattr(side, "_strata", False):
        return
    build, start = side.build_connector_meta, work.start_kv_transfers

    def build_connector_meta(self, scheduler_output):
        meta = build(self, scheduler_output)
        take = getattr(self.manager, "take_hints", None)
        if take is not None:
            setattr(meta, HINTS, take())
        return meta

    def start_kv_transfers(self, metadata):
        hints = getattr(metadata, HINTS, None)
        if hints and hasattr(self.worker, "hint"):
            self.worker.hint(hints)
        return start(self, metadata)

    side.build_connector_meta = build_connector_meta
    work.start_kv_transfers = start_kv_transfers
    side._strata = True


def check(version=None):
    """Raises UnsupportedVllm unless ``version`` (default: the installed vLLM's) and the offload
    interfaces are the ones this module was written for."""
    if version is None:
        import vllm

        version = vllm.__version__
    INTERFACE.check(version)


def kv_transfer_config(
    host_bytes, disk_bytes=0, disk_dir=None, blocks_per_chunk=None, device=0, **extra
):
    """``LLM(kv_transfer_config=...)``: vLLM's OffloadingConnector on strata's tiers.

    ``host_bytes`` / ``disk_bytes``: the tiers' sizes (pinned host memory is allocated at once;
    the disk tier is a file in ``disk_dir``). ``blocks_per_chunk``: vLLM blocks per offloaded
    chunk (one chunk of one layer must fill whole strata pages). Decode blocks are offloaded
    too (``offload_prompt_only`` off), so a preempted request gets all its blocks back.
    ``extra`` goes to ``kv_connector_extra_config`` as is (e.g. ``eviction_policy="arc"``, or
    ``strata_prefetch_steps``: engine steps a prefetched chunk may wait for its load before it
    goes back to the host tier, default 8)."""
    cfg = {
        "spec_name": SPEC_NAME,
        "spec_module_path": __name__,
        "strata_host_bytes": int(host_bytes),
        "strata_disk_bytes": int(disk_bytes),
        "strata_disk_dir": None if disk_dir is None else str(disk_dir),
        "strata_device": int(device),
        "offload_prompt_only": False,
    }
    if blocks_per_chunk is not None:
        cfg["blocks_per_chunk"] = int(blocks_per_chunk)
    cfg.update(extra)
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


def stats():
    """The newest offload worker's figures in this process (None before vLLM built one)."""
    worker = next(reversed(_workers().values()), None)
    return None if worker is None else worker.stats()


def _workers():
    """engine_id -> the offload worker of that engine in this process: offload_store.py keeps
    them (imported inside vLLM, with numpy); none before vLLM built one."""
    store = sys.modules.get(__package__ + ".offload_store")
    return {} if store is None else store._WORKERS


def _count(extra, key, default=0):
    value = extra.get(key, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise error(
            Status.INVALID_ARGUMENT,
            f"strata.vllm.offload: {key}={value!r}: expected an integer >= 0"
        )
    return value


def _spec_base():
    # Imported here: strata.vllm must import without vLLM (the plugin hook, the version gate).
    from vllm.v1.kv_offload.base import OffloadingSpec

    return OffloadingSpec


def _manager_base():
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager


def _make_spec_class():
    base = _spec_base()

    class StrataOffloadingSpec(base):
        """vLLM OffloadingSpec whose chunks live in a strata KV space's host and disk tiers."""

        def __init__(self, config):
            check()
            install_hint_channel()
            super().__init__(config)
            x = self.extra_config
            self.host_bytes = _count(x, "strata_host_bytes")
            self.disk_bytes = _count(x, "strata_disk_bytes")
            self.disk_dir = x.get("strata_disk_dir")
            self.device = _count(x, "strata_device")
            if self.host_bytes == 0:
                raise error(
                    Status.INVALID_ARGUMENT,
                    "strata.vllm.offload: strata_host_bytes must be > 0 (the host tier)"
                )
            if bool(self.disk_bytes) != bool(self.disk_dir):
                raise error(
                    Status.INVALID_ARGUMENT,
                    "strata.vllm.offload: strata_disk_bytes and strata_disk_dir go together"
                )
            if len(config.groups) != 1:
                raise error(
                    Status.UNSUPPORTED,
                    f"strata.vllm.offload: {len(config.groups)} KV cache groups; one is "
                    "supported (plain attention models)"
                )
            layers = len(config.groups[0].layer_names)
            per_block = config.worker_kv_bytes_per_block
            page = strata.stats(self.device)["page_size"]
            layer_block, rem = divmod(per_block, layers)
            if rem or layer_block == 0:
                raise error(
                    Status.UNSUPPORTED,
                    f"strata.vllm.offload: {per_block} B per block over {layers} layers: "
                    "layers of different sizes"
                )
            self.layer_chunk_bytes = layer_block * self.blocks_per_chunk
            if self.layer_chunk_bytes % page:
                fit = page // math.gcd(page, layer_block)
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"strata.vllm.offload: one chunk of one layer is {self.layer_chunk_bytes} B "
                    f"({self.blocks_per_chunk} blocks of {layer_block} B); it must fill whole "
                    f"strata pages of {page} B: set blocks_per_chunk to a multiple of {fit}"
                )
            self.layers = layers
            self.page = page
            # The strata space has K and V tensors per layer: vLLM layer i is strata tensor i.
            chunk_bytes = 2 * math.ceil(layers / 2) * self.layer_chunk_bytes
            self.num_chunks = self.host_bytes // chunk_bytes + self.disk_bytes // chunk_bytes
            if self.num_chunks == 0:
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"strata.vllm.offload: the tiers ({self.host_bytes} B host, "
                    f"{self.disk_bytes} B disk) hold no chunk of {chunk_bytes} B"
                )
            self.eviction_policy = x.get("eviction_policy", "lru")
            self.prefetch_steps = _count(x, "strata_prefetch_steps", default=8)
            self._manager = None
            self._worker = None

        def get_manager(self):
            if self._manager is None:
                self._manager = _make_manager(self)
            return self._manager

        def get_worker(self, kv_caches):
            if self._worker is None:
                from .offload_store import _WORKERS, StrataOffloadWorker

                self._worker = StrataOffloadWorker(kv_caches, self)
                _WORKERS[self.config.engine_id] = self._worker
            return self._worker

    return StrataOffloadingSpec


def _make_manager(spec):
    base = _manager_base()

    class StrataOffloadingManager(base):
        """vLLM's CPU chunk manager over strata's tiers, plus the lookahead: the chunks of the
        requests the scheduler preempts are hinted to the workers' strata spaces (through the
        connector metadata: install_hint_channel)."""

        def __init__(self):
            super().__init__(
                num_chunks=spec.num_chunks,
                cache_policy=spec.eviction_policy,
                cache_policy_module_path=spec.extra_config.get("cache_policy_module_path"),
                enable_events=spec.kv_events_config.enable_kv_cache_events,
            )
            if not callable(getattr(getattr(self, "_policy", None), "get", None)):
                raise UnsupportedVllm(
                    "strata.vllm.offload: vLLM's CPUOffloadingManager has no _policy.get "
                    "(chunk lookup by key); refusing to offload"
                )
            self._offered = {}  # req_id -> keys offered for storing, in order
            self._hints = []  # chunk ids for the workers, with this step's metadata

        def prepare_store(self, keys, req_context):
            keys = list(keys)
            self._offered.setdefault(req_context.req_id, []).extend(keys)
            return super().prepare_store(keys, req_context)

        def on_schedule_end(self, context):
            super().on_schedule_end(context)
            chunks = dict.fromkeys(self._hints)  # ordered, without repeats
            for req_id in context.preempted_req_ids or ():
                for key in self._offered.get(req_id, ()):
                    chunk = self._policy.get(key)
                    if chunk is not None and chunk.is_ready:
                        chunks[chunk.chunk_id] = None
            self._hints = list(chunks)

        def take_hints(self):
            """This step's hints, for the connector metadata (then forgotten here)."""
            hints, self._hints = self._hints, []
            return hints

        def on_request_finished(self, req_context):
            self._offered.pop(req_context.req_id, None)
            super().on_request_finished(req_context)

        def reset_cache(self):
            self._offered.clear()
            self._hints = []
            super().reset_cache()

    return StrataOffloadingManager()


def __getattr__(name):
    # vLLM's factory does getattr(module, "StrataOffloadingSpec"): the class derives from
    # vLLM's OffloadingSpec, so it is made on first use, after the version check.
    if name == SPEC_NAME:
        check()
        cls = _make_spec_class()
        globals()[name] = cls
        return cls
    if name == "_WORKERS":
        return _workers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "INTERFACE",
    "SPEC_NAME",
    "UnsupportedVllm",
    "check",
    "kv_transfer_config",
    "stats",
]
