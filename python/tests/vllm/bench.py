"""Throughput and time to first token, stock vLLM vs strata.vllm, side by side (BENCHMARKS.md).

    STRATA_LIB=target/release/libstrata.so PYTHONPATH=python \\
        target/venv-vllm/bin/python python/tests/vllm/bench.py \\
        [--rounds 2] [--requests 16] [--max-tokens 32]

Each round runs run_engine.py once without the plugin and once with it (fresh processes,
alternating, so machine noise hits both); prints every run and the medians as a Markdown table.
Memory is ample (64 MiB of KV for a two-layer model): this measures the plugin's overhead.
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
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    test_vllm.REQUESTS, test_vllm.MAX_TOKENS = args.requests, args.max_tokens
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama")
        for _ in range(args.rounds):
            for plugin in (False, True):
                r, _ = test_vllm.run_engine(plugin, model)
                runs[plugin].append(r)
                print(
                    f"plugin={plugin}: {r['tokens_per_s']:.1f} tok/s, "
                    f"TTFT {r['mean_ttft_s'] * 1e3:.0f} ms",
                    flush=True,
                )
    print("\n| run | tokens/s (median) | mean TTFT ms (median) | runs |")
    print("|---|---|---|---|")
    for plugin, name in ((False, "stock vLLM"), (True, "strata.vllm")):
        tps = statistics.median(r["tokens_per_s"] for r in runs[plugin])
        ttft = statistics.median(r["mean_ttft_s"] for r in runs[plugin]) * 1e3
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs[plugin])
        print(f"| {name} | {tps:.1f} | {ttft:.0f} | {each} |")
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[False], runs[True]))
    print(f"\ngreedy outputs identical: {same}")


if __name__ == "__main__":
    main()
