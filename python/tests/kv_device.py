"""Where the torch tests run: the torch device of strata's memory here, and how its pages compare
with the 64 KiB pages the host-backend runs use (ffi/tests/python_transformers.rs sets them).

On the host backend outside strict mode strata memory is CPU memory torch reads; on the CUDA
backend it is CUDA memory, usable when torch has CUDA (a GPU; not the emulated driver, which CI
pairs with a CPU torch). The torch tests put their models and inputs on `torch_device()` and skip
with `NO_DEVICE` where it is None (the strict host backend, or no torch)."""

import functools

import strata
from strata import kv

NO_DEVICE = "needs torch and strata memory it can use: CPU-accessible (the host backend outside strict mode) or CUDA with a CUDA torch"
# The host-backend runs' page size: the tests' models are sized so that sequences cross pages.
HOST_TEST_PAGE = 64 << 10


@functools.cache
def _probe():
    with kv.KvSpace(layers=1, kv_heads=1, head_dim=16, dtype="float32", max_requests=1, max_tokens=8) as s:
        return s.tensor(0, "k").dlpack_device_type, s.stats()["page_size"]


@functools.cache
def torch_device():
    """"cpu" or "cuda": where torch reads strata memory here; None where it cannot."""
    kind = _probe()[0]
    if kind not in (1, 2):
        return None
    try:
        import torch
    except ImportError:
        return None
    if kind == 2 and not torch.cuda.is_available():
        return None
    return "cpu" if kind == 1 else "cuda"


def page_scale():
    """How many times larger than `HOST_TEST_PAGE` strata's pages are here (1 on the host runs,
    32 on a GPU's 2 MiB pages): a test multiplies its per-token and per-layer sizes by it, so that
    a page holds as many tokens and a layer fills as many pages as in the host runs."""
    return max(1, _probe()[1] // HOST_TEST_PAGE)


def second_device():
    """None when strata has a second device here, else why a test that needs one skips (a
    one-GPU machine: gpu-run lists the skip)."""
    n = strata.device_count()
    return None if n >= 2 else f"needs a second device (this machine has {n})"
