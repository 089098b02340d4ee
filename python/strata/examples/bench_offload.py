"""Tiered offload (`OffloadedStrataCache`) against `StrataCache` without offload, side by side in
one process: the slowdown when everything fits the budget, and tokens/s when the KV is 2x and
4x the device budget.

    python -m strata.examples.bench_offload              # BENCHMARKS.md's table
    python -m strata.examples.bench_offload --quick      # a smoke run

Model: bench_cache's random-initialised Llama (4 layers, hidden 256, 8 heads over 4 KV heads,
float32), batch 4, 64-token prompts, greedy, `--new-tokens` tokens. Budgets are fractions of
the KV pages the run ends with. Each configuration runs once per round, rounds interleave the
configurations, and the fastest round of each counts. Under `STRATA_HOST_LINK` the copies pay
the modelled link: the table then also gives the link time of the bytes moved, to compare with
what the run lost against no offload (the overlap).
"""

import argparse
import math
import os
import time


def run(model, ids, kind, budget, new_tokens, max_len):
    import torch

    from strata.transformers import OffloadedStrataCache, StrataCache

    if budget is None:
        cache = StrataCache(model.config, max_cache_len=max_len)
    else:
        cache = OffloadedStrataCache(model.config, max_cache_len=max_len, device_budget=budget)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    elapsed = time.perf_counter() - start
    s = cache.stats()
    cache.close()
    return elapsed, s, out


def link_seconds(stats):
    """Link time of the bytes a run moved under STRATA_HOST_LINK's bandwidth (None without)."""
    text = os.environ.get("STRATA_HOST_LINK")
    if not text:
        return None
    bw = text.split(",")[0].strip().upper()
    scale = {"GB": 1e9, "MB": 1e6, "KB": 1e3}
    for unit, factor in scale.items():
        if bw.endswith(unit):
            return (stats["bytes_to_device"] + stats["bytes_from_device"]) / (float(bw[: -len(unit)]) * factor)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.bench_offload")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the fastest counts")
    p.add_argument("--quick", action="store_true", help="32 new tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    from strata.examples.bench_cache import build

    model, ids = build(args)
    max_len = args.prompt + args.new_tokens
    # The KV pages the run ends with: K and V, 4 layers, every row, whole pages.
    _, full, _ = run(model, ids, "strata", None, 2, max_len)
    tokens = max_len - 1
    pages = math.ceil(tokens / full["tokens_per_block"])
    kv = 2 * 4 * args.batch * pages * full["page_size"]
    configs = [
        ("no offload", None),
        ("offload, fits (budget = 2x KV)", 2 * kv),
        ("offload, KV = 2x budget", kv // 2),
        ("offload, KV = 4x budget", kv // 4),
    ]
    print(f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, 4 layers, hidden 256, "
          f"float32; final KV {kv} bytes in {full['page_size']}-byte pages; "
          f"STRATA_HOST_LINK={os.environ.get('STRATA_HOST_LINK', 'unset')}")
    for _, budget in configs:
        run(model, ids, "warm-up", budget, 2, max_len)
    best, outs = {}, {}
    for _ in range(args.rounds):
        for name, budget in configs:
            elapsed, s, outs[name] = run(model, ids, name, budget, args.new_tokens, max_len)
            if name not in best or elapsed < best[name][0]:
                best[name] = (elapsed, s)
    base = best["no offload"][0]
    print("| configuration | budget bytes | s | tokens/s | vs no offload | bytes moved | swap-ins | "
          "prefetch hits | stalls (s waited) | link time of the bytes moved |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, budget in configs:
        elapsed, s = best[name]
        off = s.get("offload", {})
        moved = s["bytes_to_device"] + s["bytes_from_device"]
        link = link_seconds(s)
        print(
            f"| {name} | {budget or '-'} | {elapsed:.2f} | {args.batch * args.new_tokens / elapsed:.1f} | "
            f"{elapsed / base:.3f}x | {moved} | {off.get('swap_ins', 0)} | {off.get('prefetch_hits', 0)} | "
            f"{off.get('stalls', 0)} ({off.get('stall_seconds', 0.0):.2f}) | "
            f"{'-' if link is None else f'{link:.2f} s'} |",
            flush=True,
        )
    same = all(bool((outs[n] == outs["no offload"]).all()) for n, _ in configs)
    print(f"same tokens in all configurations: {same}")


if __name__ == "__main__":
    main()
