"""Throughput and time to first token, stock vLLM vs strata.vllm, side by side (BENCHMARKS.md).

    STRATA_LIB=target/release/libstrata.so PYTHONPATH=python \\
        target/venv-vllm/bin/python python/tests/vllm/bench.py \\
        [--rounds 5] [--waves 4] [--requests 16] [--max-tokens 32]

Each round runs run_engine.py --bench (no per-step probes) once without the plugin and once with
it (fresh processes, alternating, the first of each round chosen by round parity, so machine
noise hits both alike). Each process times ``--waves`` waves of the same shape with other
tokens: the first (cold: strata maps its KV pages as it goes) and the median of the others
(warm). Prints every run, the medians as a Markdown table, and the median of the per-round
strata/stock ratios, of tokens/s and of tokens per CPU-second (the process's CPU time over the
wave: on a shared machine wall time is mostly waiting for a core). Memory is ample (64 MiB of
KV for a two-layer model): this measures the plugin's overhead.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_vllm  # noqa: E402  (run_engine's subprocess setup)

KEYS = ("tokens_per_s", "tokens_per_cpu_s")


def warm(run, key):
    return statistics.median(w[key] for w in run["warm"]) if run["warm"] else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    test_vllm.REQUESTS, test_vllm.MAX_TOKENS = args.requests, args.max_tokens
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama")
        for round_ in range(args.rounds):
            for plugin in (False, True) if round_ % 2 == 0 else (True, False):
                r, _ = test_vllm.run_engine(plugin, model, "--bench", "--waves", str(args.waves))
                runs[plugin].append(r)
                print(
                    f"plugin={plugin}: cold {r['tokens_per_s']:.1f} tok/s, "
                    f"{r['tokens_per_cpu_s']:.1f} tok/CPU-s, TTFT {r['mean_ttft_s'] * 1e3:.0f} ms, "
                    f"{r['minor_faults']} minor faults; warm {warm(r, 'tokens_per_s'):.1f} tok/s, "
                    f"{warm(r, 'tokens_per_cpu_s'):.1f} tok/CPU-s",
                    flush=True,
                )
    print(
        "\n| run | cold tokens/s | cold tokens/CPU-s | cold mean TTFT ms | cold minor faults "
        "| warm tokens/s | warm tokens/CPU-s |"
    )
    print("|---|---|---|---|---|---|---|")
    for plugin, name in ((False, "stock vLLM"), (True, "strata.vllm")):
        rs = runs[plugin]

        def med(f):
            return statistics.median(f(r) for r in rs)

        print(
            f"| {name} | {med(lambda r: r['tokens_per_s']):.1f} "
            f"| {med(lambda r: r['tokens_per_cpu_s']):.1f} "
            f"| {med(lambda r: r['mean_ttft_s']) * 1e3:.0f} | {med(lambda r: r['minor_faults']):.0f} "
            f"| {med(lambda r: warm(r, 'tokens_per_s')):.1f} "
            f"| {med(lambda r: warm(r, 'tokens_per_cpu_s')):.1f} |"
        )
    print("\nstrata/stock per round, then the median:")
    pairs = list(zip(runs[False], runs[True]))
    for key in KEYS:
        for label, get in (("cold", lambda r: r[key]), ("warm", lambda r: warm(r, key))):
            ratios = [get(b) / get(a) for a, b in pairs]
            each = ", ".join(f"{x:.3f}" for x in ratios)
            print(f"{label} {key}: {each} -> median {statistics.median(ratios):.3f}")
    same = all(a["outputs"] == b["outputs"] for a, b in pairs)
    print(f"\ngreedy outputs identical: {same}")


if __name__ == "__main__":
    main()
