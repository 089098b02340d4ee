"""Throughput and time to first token, stock vLLM vs strata.vllm, side by side (BENCHMARKS.md).

    STRATA_LIB=target/release/libstrata.so PYTHONPATH=python \\
        target/venv-vllm/bin/python python/tests/vllm/bench.py \\
        [--rounds 5] [--requests 16] [--max-tokens 32]

Each round runs run_engine.py --bench (one wave, no per-step probes) once without the plugin and
once with it (fresh processes, alternating, the first of each round chosen by round parity, so
machine noise and warm caches hit both alike); prints every run, the medians as a Markdown
table, and the median of the per-round ratios. Memory is ample (64 MiB of KV for a two-layer
model): this measures the plugin's overhead.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_vllm  # noqa: E402  (run_engine's subprocess setup)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    test_vllm.REQUESTS, test_vllm.MAX_TOKENS = args.requests, args.max_tokens
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama")
        for round_ in range(args.rounds):
            for plugin in (False, True) if round_ % 2 == 0 else (True, False):
                r, _ = test_vllm.run_engine(plugin, model, "--bench")
                runs[plugin].append(r)
                print(
                    f"plugin={plugin}: {r['tokens_per_s']:.1f} tok/s, "
                    f"{r['tokens_per_cpu_s']:.1f} tok/CPU-s, "
                    f"TTFT {r['mean_ttft_s'] * 1e3:.0f} ms, {r['minor_faults']} minor faults",
                    flush=True,
                )
    print(
        "\n| run | tokens/s | tokens per CPU-s | mean TTFT ms | minor faults | each run, tokens/s |"
    )
    print("|---|---|---|---|---|---|")
    for plugin, name in ((False, "stock vLLM"), (True, "strata.vllm")):
        tps = statistics.median(r["tokens_per_s"] for r in runs[plugin])
        ttft = statistics.median(r["mean_ttft_s"] for r in runs[plugin]) * 1e3
        tpc = statistics.median(r["tokens_per_cpu_s"] for r in runs[plugin])
        faults = statistics.median(r["minor_faults"] for r in runs[plugin])
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs[plugin])
        print(f"| {name} | {tps:.1f} | {tpc:.1f} | {ttft:.0f} | {faults:.0f} | {each} |")
    print("\nmedians; strata/stock ratios per round, then their median:")
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        ratios = [b[key] / a[key] for a, b in zip(runs[False], runs[True])]
        each = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"{key}: {each} -> median {statistics.median(ratios):.3f}")
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[False], runs[True]))
    print(f"\ngreedy outputs identical: {same}")


if __name__ == "__main__":
    main()
