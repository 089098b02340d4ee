"""PyTorch integration. Imports torch lazily: `import strata` never needs it.

Two routes (see the README's "C and Python" section):

- MemPool route (recommended): `with strata.torch.pool("weights"): ...` — PyTorch's caching
  allocator stays in front (stats, OOM retry, CUDA graphs keep working) and asks strata for
  segments; strata tags them, so `strata.sleep("weights")` releases exactly them. One pool per
  (tag, device), kept alive here (pytorch#146431), so blocks of two tags never mix
  (torch_memory_saver#85).
- Global route: `strata.torch.use_globally()` before any CUDA allocation — every allocation goes
  straight to strata (no caching in front; torch.cuda.memory_stats and snapshots do not work on
  this route in PyTorch).
"""

import contextlib
import threading

from . import _lib

_lock = threading.Lock()
_allocator = None
_pools = {}  # (tag, device) -> torch.cuda.MemPool, kept alive for the process lifetime

# PyTorch setter -> our export (CUDAPluggableAllocator's optional hooks; probed with hasattr,
# since the names changed across versions).
HOOKS = (
    ("set_init_fn", "strata_init"),
    ("set_reset_fn", "strata_empty_cache"),
    ("set_memory_fraction_fn", "strata_set_memory_fraction"),
    ("set_record_stream_fn", "strata_record_stream"),
)


def _torch():
    try:
        import torch  # noqa: PLC0415 (lazy on purpose)
    except ImportError as e:
        raise ImportError("strata.torch needs PyTorch (pip install torch)") from e
    return torch


def allocator():
    """The process's strata CUDAPluggableAllocator (created once), with the optional hooks this
    PyTorch offers set to strata's exports. Returns (allocator, hooks set)."""
    global _allocator
    with _lock:
        if _allocator is None:
            torch = _torch()
            path = _lib.loaded_path()
            alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "strata_malloc", "strata_free")
            inner = alloc.allocator()
            hooked = []
            for setter, export in HOOKS:
                if hasattr(inner, setter):
                    getattr(inner, setter)(_lib.function_pointer(export))
                    hooked.append(setter)
            alloc.strata_hooks = tuple(hooked)
            _allocator = alloc
        return _allocator


def _device_index(device):
    torch = _torch()
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


def mem_pool(tag, device=None):
    """The MemPool of (tag, device), created on first use and kept alive."""
    torch = _torch()
    index = _device_index(device)
    key = (tag, index)
    with _lock:
        pool = _pools.get(key)
    if pool is None:
        alloc = allocator()
        with _lock:
            pool = _pools.get(key)
            if pool is None:
                with torch.cuda.device(index):
                    pool = torch.cuda.MemPool(alloc.allocator())
                _pools[key] = pool
    return pool


@contextlib.contextmanager
def pool(tag, device=None):
    """Routes this thread's CUDA allocations in the block to strata, tagged `tag` (MemPool route).

        with strata.torch.pool("kv_cache"):
            kv = torch.empty(..., device="cuda")
        strata.sleep("kv_cache", keep_host_copy=False)
    """
    torch = _torch()
    index = _device_index(device)
    p = mem_pool(tag, index)
    _lib.check(_lib.lib().strata_tag_push(_lib.encode(tag)))
    try:
        with torch.cuda.use_mem_pool(p, device=index):
            yield p
    finally:
        _lib.check(_lib.lib().strata_tag_pop())


def use_globally():
    """Makes strata PyTorch's CUDA allocator for the whole process (global route). Call before
    any CUDA allocation; PyTorch refuses to switch afterwards."""
    torch = _torch()
    alloc = allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc
