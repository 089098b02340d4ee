"""strata.vllm against stock vLLM on the CPU, side by side in one run (BENCHMARKS.md):

1. Memory ample (64 MiB of KV for a two-layer model): throughput and time to first token with
   the elastic KV plugin (STRATA_VLLM=1) and without; the plugin's overhead (target: within 5%).
2. A KV budget that forces preemption (test_offload.py's settings): throughput, time to first
   token and recomputed tokens with strata's tiered offload and with stock vLLM's recompute.

    STRATA_LIB=target/release/libstrata.so PYTHONPATH=python \\
        target/venv-vllm/bin/python python/tests/vllm/bench.py [--rounds 5] [--waves 4] \\
        [--spare-groups N] [--trim-delay S] [--offload-rounds 5] [--offload-waves 3] [--requests 16] [--max-tokens 32]

Every run is a fresh process. In each round the two settings run one after the other, the
first of the pair alternating with the round, so machine noise hits both alike; the figure that
counts is the per-round ratio (strata / stock), reported with its median and spread (min, max)
over the rounds, beside the load average (1 min) when each run started. Part 1: each process
runs ``--waves`` waves of the same shape with other tokens; the first (cold: kernels warm up,
strata maps its pages) is reported apart; the others (warm) are the headline. Part 2: each
process runs one warm-up wave of other tokens, then ``--offload-waves`` measured waves (the
first the tests' prompts, the others other tokens) whose medians it reports, with the
recomputed tokens summed over them. Time to first token is
the mean over a wave's requests of the time from the wave's start to the request's first output
token (the whole batch is submitted at once). Tokens per CPU-second divide by the process's CPU
time over the wave, which waiting for a core on a shared machine inflates less than wall time.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_offload  # noqa: E402  (run_offload's subprocess setup and settings)
import test_vllm  # noqa: E402  (run_engine's subprocess setup)


def load():
    return os.getloadavg()[0]


def warm(run, key):
    return statistics.median(w[key] for w in run["warm"]) if run["warm"] else float("nan")


def ratio_line(label, ratios):
    each = ", ".join(f"{x:.3f}" for x in ratios)
    return (
        f"{label}: {each} -> median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


def alternate(rounds, first, second, run):
    """``run(setting)`` for each setting, ``rounds`` times, the pair's order flipped each round.
    Returns {setting: [result, ...]}."""
    out = {first: [], second: []}
    for r in range(rounds):
        for setting in (first, second) if r % 2 == 0 else (second, first):
            out[setting].append(run(setting))
    return out


def plugin_vs_stock(args, tmp):
    test_vllm.REQUESTS, test_vllm.MAX_TOKENS = args.requests, args.max_tokens
    model = os.path.join(tmp, "llama")

    def run(plugin):
        before = load()
        knobs = {"STRATA_VLLM_TRIM_DELAY": args.trim_delay}  # None: the plugin's default
        if args.spare_groups is not None:
            knobs["STRATA_VLLM_SPARE_GROUPS"] = str(args.spare_groups)
        r, _ = test_vllm.run_engine(plugin, model, "--bench", "--waves", str(args.waves), **knobs)
        r["load"] = before
        mapping = ""
        if r["stats"]:
            mapping = f"; {r['stats']['maps']} maps, {r['stats']['unmaps']} unmaps"
        print(
            f"plugin={plugin} (load {before:.1f}): cold {r['tokens_per_s']:.1f} tok/s, "
            f"TTFT {r['mean_ttft_s'] * 1e3:.0f} ms; warm {warm(r, 'tokens_per_s'):.1f} tok/s, "
            f"{warm(r, 'tokens_per_cpu_s'):.1f} tok/CPU-s, "
            f"TTFT {warm(r, 'mean_ttft_s') * 1e3:.0f} ms{mapping}",
            flush=True,
        )
        return r

    runs = alternate(args.rounds, False, True, run)
    print("\n### Memory ample: strata.vllm (elastic KV) vs stock vLLM\n")
    print(
        "| run | warm tokens/s | warm tokens/CPU-s | warm mean TTFT ms | cold tokens/s "
        "| cold mean TTFT ms | load average at start |"
    )
    print("|---|---|---|---|---|---|---|")
    for plugin, name in ((False, "stock vLLM"), (True, "strata.vllm")):
        rs = runs[plugin]

        def med(f):
            return statistics.median(f(r) for r in rs)

        loads = ", ".join(f"{r['load']:.1f}" for r in rs)
        print(
            f"| {name} | {med(lambda r: warm(r, 'tokens_per_s')):.1f} "
            f"| {med(lambda r: warm(r, 'tokens_per_cpu_s')):.1f} "
            f"| {med(lambda r: warm(r, 'mean_ttft_s')) * 1e3:.0f} "
            f"| {med(lambda r: r['tokens_per_s']):.1f} "
            f"| {med(lambda r: r['mean_ttft_s']) * 1e3:.0f} | {loads} |"
        )
    print("\nstrata/stock per round (TTFT: below 1 is faster with strata):")
    pairs = list(zip(runs[False], runs[True]))
    for label, get in (
        ("warm tokens/s", lambda r: warm(r, "tokens_per_s")),
        ("warm tokens/CPU-s", lambda r: warm(r, "tokens_per_cpu_s")),
        ("warm TTFT", lambda r: warm(r, "mean_ttft_s")),
        ("cold tokens/s", lambda r: r["tokens_per_s"]),
        ("cold TTFT", lambda r: r["mean_ttft_s"]),
    ):
        print(ratio_line(label, [get(b) / get(a) for a, b in pairs]))
    same = all(a["outputs"] == b["outputs"] for a, b in pairs)
    print(f"greedy outputs identical in every pair: {same}")


def offload_vs_recompute(args, tmp):
    model = os.path.join(tmp, "llama-offload")
    n = {"disk": 0}

    def run(offload):
        disk = os.path.join(tmp, f"disk{n['disk']}")
        n["disk"] += 1
        os.makedirs(disk)
        before = load()
        r = test_offload.result_of(
            test_offload.start_offload(
                model, offload, disk, args=["--warmup", "--waves", str(args.offload_waves)]
            )
        )
        waves = r["waves"]
        r.update(
            load=before,
            tps=statistics.median(w["tokens_per_s"] for w in waves),
            ttft=statistics.median(w["mean_ttft_s"] for w in waves),
            recomputed=sum(w["recomputed_tokens"] for w in waves),
            partial=sum(w["partial_block_tokens"] for w in waves),
            preempted=sum(w["preemptions"] for w in waves),
        )
        each = ", ".join(f"{w['tokens_per_s']:.0f}" for w in waves)
        print(
            f"offload={offload} (load {before:.1f}): {r['tps']:.1f} tok/s, "
            f"TTFT {r['ttft'] * 1e3:.0f} ms (medians of {len(waves)} waves: {each} tok/s), "
            f"{r['recomputed']} recomputed tokens ({r['partial']} in partial blocks), "
            f"{r['preempted']} preemptions",
            flush=True,
        )
        return r

    test_offload.write_model(model)
    runs = alternate(args.offload_rounds, False, True, run)
    print("\n### KV budget forcing preemption: strata offload vs stock vLLM recompute\n")
    print(
        "| run | tokens/s | mean TTFT ms | recomputed tokens, each run "
        "| of which in partial blocks | preemptions | load average at start |"
    )
    print("|---|---|---|---|---|---|---|")
    for offload, name in ((False, "stock vLLM (recompute)"), (True, "strata offload")):
        rs = runs[offload]
        tps = statistics.median(r["tps"] for r in rs)
        ttft = statistics.median(r["ttft"] for r in rs)
        rec = ", ".join(str(r["recomputed"]) for r in rs)
        partial = ", ".join(str(r["partial"]) for r in rs)
        pre = ", ".join(str(r["preempted"]) for r in rs)
        loads = ", ".join(f"{r['load']:.1f}" for r in rs)
        print(f"| {name} | {tps:.1f} | {ttft * 1e3:.0f} | {rec} | {partial} | {pre} | {loads} |")
    print("\noffload/recompute per round (TTFT: below 1 is faster with the offload):")
    pairs = list(zip(runs[False], runs[True]))
    print(ratio_line("tokens/s", [b["tps"] / a["tps"] for a, b in pairs]))
    print(ratio_line("TTFT", [b["ttft"] / a["ttft"] for a, b in pairs]))
    same = all(a["outputs"] == b["outputs"] for a, b in pairs)
    print(f"greedy outputs identical in every pair: {same}")
    s = runs[True][-1]["strata"]
    print(
        f"strata (last run): {s['stored_chunks']} chunks stored, {s['loaded_chunks']} loaded, "
        f"{s['hinted_chunks']} hinted, {s['prefetch_hits']} prefetch hits, "
        f"{s['steps_with_stores_in_flight']} steps with stores in flight, disk written "
        f"{s['disk_write_bytes']} B, read {s['disk_read_bytes']} B"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="part 1: stock/plugin pairs")
    ap.add_argument("--waves", type=int, default=4, help="part 1: waves per process")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--spare-groups",
        type=int,
        help="part 1: fully free KV groups the plugin keeps mapped for good (default: the "
        "tests' 2)",
    )
    ap.add_argument(
        "--trim-delay",
        help="part 1: seconds other free KV groups stay mapped (STRATA_VLLM_TRIM_DELAY; default: "
        "the plugin's; 0 unmaps them at once)",
    )
    ap.add_argument("--offload-rounds", type=int, default=5, help="part 2: pairs (0: skip)")
    ap.add_argument("--offload-waves", type=int, default=3, help="part 2: waves per process")
    args = ap.parse_args()
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.rounds:
            plugin_vs_stock(args, tmp)
        if args.offload_rounds:
            offload_vs_recompute(args, tmp)
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
