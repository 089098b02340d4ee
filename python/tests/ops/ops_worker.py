"""A strata process with torch for the operators' tests (test_ops.py): allocations under two
tags, one asleep, and a KV space whose K tensor torch writes through DLPack (host backend,
outside strict mode), then allocations on request; the same protocol as ops_worker.c.

    python ops_worker.py WEIGHTS_MIB CACHE_MIB KV_TOKENS
"""

import sys

import torch

import strata
from strata import _lib, kv


def main():
    weights, cache, tokens = (int(a) for a in sys.argv[1:4])
    with strata.tag("params"):
        _lib.malloc(weights << 20)
    with strata.tag("scratch"):
        _lib.malloc(cache << 20)
    strata.sleep(["scratch"])
    space = kv.KvSpace(layers=1, kv_heads=8, head_dim=128, dtype="float16", max_requests=2, max_tokens=8192)
    request = space.admit()
    request.append(tokens)
    k = torch.from_dlpack(space.tensor(0, "k"))
    k[request.slot, :tokens].fill_(1.5)
    assert bool((k[request.slot, :tokens] == 1.5).all())
    s = strata.stats(0)
    print("ready", s["allocated_bytes"], s["reserved_bytes"], s["pool_in_use_bytes"], flush=True)
    for line in sys.stdin:
        if line.startswith("alloc "):
            try:
                _lib.malloc(int(line.split()[1]))
                print("ok", flush=True)
            except strata.StrataError as e:
                print("fail", e, flush=True)
        elif line.startswith("quit"):
            break
    space.close()


if __name__ == "__main__":
    main()
