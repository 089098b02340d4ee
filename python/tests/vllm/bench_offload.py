"""Throughput and recomputed tokens under a KV budget that forces preemption: stock vLLM
(recompute) vs vLLM's OffloadingConnector on strata's tiers, side by side (BENCHMARKS.md).

    STRATA_LIB=target/release/libstrata.so PYTHONPATH=python \\
        target/venv-vllm/bin/python python/tests/vllm/bench_offload.py [--rounds 2]

Each round runs run_offload.py once without offload and once with it (fresh processes,
alternating, so machine noise hits both), with test_offload.py's settings (12 blocks of 32
tokens, 8 requests, 64 new tokens each, a 256 KiB host tier and a 16 MiB disk tier); prints
every run and the medians as a Markdown table.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_offload  # noqa: E402  (run_offload's subprocess setup and settings)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama")
        for i in range(args.rounds):
            for offload in (False, True):
                disk = os.path.join(tmp, f"disk{i}")
                os.makedirs(disk, exist_ok=True)
                r = test_offload.run_offload(model, offload, disk)
                runs[offload].append(r)
                print(
                    f"offload={offload}: {r['tokens_per_s']:.1f} tok/s, "
                    f"{r['recomputed_tokens']} recomputed tokens, "
                    f"{r['preemptions']} preemptions",
                    flush=True,
                )
    print("\n| run | tokens/s (median) | recomputed tokens (median) | preemptions | each tok/s |")
    print("|---|---|---|---|---|")
    for offload, name in ((False, "stock vLLM (recompute)"), (True, "strata offload")):
        rs = runs[offload]
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rec = statistics.median(r["recomputed_tokens"] for r in rs)
        pre = ", ".join(str(r["preemptions"]) for r in rs)
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in rs)
        print(f"| {name} | {tps:.1f} | {rec:.0f} | {pre} | {each} |")
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[False], runs[True]))
    print(f"\ngreedy outputs identical: {same}")
    s = runs[True][-1]["strata"]
    print(
        f"strata (last run): {s['stored_chunks']} chunks stored, {s['loaded_chunks']} loaded, "
        f"{s['hinted_chunks']} hinted, {s['prefetch_hits']} prefetch hits, "
        f"disk written {s['disk_write_bytes']} B, read {s['disk_read_bytes']} B"
    )


if __name__ == "__main__":
    main()
