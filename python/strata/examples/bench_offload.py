"""Tiered offload (`OffloadedStrataCache`) against `StrataCache` without offload, side by side in
one process: the slowdown when everything fits the budget, tokens/s when the KV is 2x and 4x
the device budget, and the same with a host tier too small for what is off the device (the rest
on disk), with and without TierKV's lookahead (the disk hop ahead of need). Every offload
configuration runs Pie's swapping (`swap="pie"`); `bench_cache --offload` measures the default
layer streaming.

    python -m strata.examples.bench_offload              # BENCHMARKS.md's table
    python -m strata.examples.bench_offload --quick      # a smoke run
    STRATA_HOST_LINK=1GB,10us python -m strata.examples.bench_offload   # copies pay a link

Model: bench_cache's random-initialised Llama (`--layers`, hidden 256, 8 heads over 4 KV heads,
float32), batch 4, 64-token prompts, greedy, `--new-tokens` tokens. Budgets and host tiers are
fractions of the KV pages the run ends with; "disk" configurations give the host tier half of
what must be off the device. Each round runs every configuration once (rounds alternate them);
the table gives each round's seconds, the medians, and the figures of the median round. Under
`STRATA_HOST_LINK` the host backend's copies take the modelled link's time (disk I/O is the
machine's own).
"""

import argparse
import math
import tempfile

from ._bench import alternate, median, model_and_prompts, rounds_line, setting, timed_generate


def configs(kv, layers):
    """(name, device budget, host bytes, disk bytes, lookahead); None budget: no offload."""
    off2, off4 = kv - kv // 2, kv - kv // 4  # what must be off the device
    return [
        ("no offload", None, None, 0, False),
        ("fits (budget 2x KV)", 2 * kv, None, 0, True),
        ("KV 2x budget", kv // 2, None, 0, True),
        ("KV 4x budget", kv // 4, None, 0, True),
        ("KV 2x budget, disk", kv // 2, off2 // 2, 2 * kv, False),
        ("KV 2x budget, disk, lookahead", kv // 2, off2 // 2, 2 * kv, True),
        ("KV 4x budget, disk", kv // 4, off4 // 2, 2 * kv, False),
        ("KV 4x budget, disk, lookahead", kv // 4, off4 // 2, 2 * kv, True),
    ]


def run(model, ids, config, new_tokens, max_len, disk_parent):
    from strata.transformers import OffloadedStrataCache, StrataCache

    _, budget, host, disk, lookahead = config
    with tempfile.TemporaryDirectory(prefix="strata-bench-", dir=disk_parent) as d:
        if budget is None:
            cache = StrataCache(model.config, max_cache_len=max_len)
        else:
            tiers = dict(disk_bytes=disk, disk_dir=d) if disk else {}
            cache = OffloadedStrataCache(
                model.config,
                max_cache_len=max_len,
                device_budget=budget,
                host_bytes=host,
                lookahead=lookahead,
                swap="pie",
                **tiers,
            )
        elapsed, out = timed_generate(model, ids, cache, new_tokens)
        s = cache.stats()
        cache.close()
    return elapsed, s, out


def figures(s):
    off = s.get("offload") or {}
    if not off:
        return " | ".join(["-"] * 6)
    mb = 1e6
    return (
        f"{off['stalls']} ({off['stall_seconds']:.2f} s) | {off['swap_ins']} ({off['two_hop_swap_ins']} two-hop) | "
        f"{off['swap_ins_early']} ({off['swap_ins_early_hidden']}) | {off['stages']} ({s['staged_objects']}, "
        f"{s['staged_evicted']}, {off['stages_hidden']}) | "
        f"{s['disk_read_bytes'] / mb:.0f} / {s['disk_write_bytes'] / mb:.0f} | "
        f"{(s['bytes_to_device'] + s['bytes_from_device']) / mb:.0f}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.bench_offload")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every configuration once")
    p.add_argument("--disk-dir", default=None, help="where the disk tiers' files go (default: the temp dir)")
    p.add_argument("--only", nargs="*", help="configurations whose name contains one of these words")
    p.add_argument("--quick", action="store_true", help="32 new tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    model, ids = model_and_prompts(args.batch, args.prompt, layers=args.layers)
    max_len = args.prompt + args.new_tokens
    # The KV pages the run ends with: K and V, every layer and row, whole pages.
    _, full, _ = run(model, ids, ("probe", None, None, 0, False), 2, max_len, args.disk_dir)
    pages = math.ceil((max_len - 1) / full["tokens_per_block"])
    kv = 2 * args.layers * args.batch * pages * full["page_size"]
    wanted = lambda name: not args.only or name == "no offload" or any(w in name for w in args.only)  # noqa: E731
    chosen = [c for c in configs(kv, args.layers) if wanted(c[0])]
    print(f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, {args.layers} layers, hidden 256, "
          f"float32; final KV {kv:,} bytes in {full['page_size']}-byte pages; {setting()}")
    for c in chosen:
        run(model, ids, c, 2, max_len, args.disk_dir)  # warm-up
    by_name = {c[0]: c for c in chosen}
    results, loads = alternate(
        list(by_name), args.rounds, lambda name: run(model, ids, by_name[name], args.new_tokens, max_len, args.disk_dir)
    )
    print(rounds_line(loads))
    base = median([r[0] for r in results["no offload"]])
    print("| configuration | budget | host tier | s, each round | median s | tok/s | vs no offload | "
          "median round: stalls (s waited) | swap-ins (two-hop) | predicted hidden by Eq. 1 (and hidden) | "
          "stages (objects moved up, of those evicted unread, layers then one-hop) | disk MB read / written | "
          "MB over the link |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, budget, host, _, _ in chosen:
        times = [r[0] for r in results[name]]
        mid = sorted(results[name], key=lambda r: r[0])[len(times) // 2]
        m = median(times)
        print(f"| {name} | {budget or '-'} | {host or 'all'} | {', '.join(f'{t:.2f}' for t in times)} | {m:.2f} | "
              f"{args.batch * args.new_tokens / m:.1f} | {m / base:.3f}x | {figures(mid[1])} |", flush=True)
    ref = results["no offload"][0][2]
    same = all(bool((r[2] == ref).all()) for rs in results.values() for r in rs)
    print(f"same tokens in every configuration and round: {same}")


if __name__ == "__main__":
    main()
