"""Two vLLM engines in one process on one strata device too small for both KV caches as stock
vLLM holds them (each engine's whole capacity, all the time): engine A runs a batch and goes idle
(its KV groups back to the pool), engine B starts and runs the same batch, A sleeps and wakes
(its own KV unmapped, B's kept) and runs again.
Prints one JSON line for test_vllm.py. Needs STRATA_VLLM=1 and STRATA_HOST_DEVICES.

    python run_two_engines.py MODEL_DIR [--requests N] [--max-tokens N] [--kv-bytes N]
"""

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from run_engine import block_pool, make_llm, prompts, write_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kv-bytes", type=int, default=8 << 20)
    args = ap.parse_args()

    write_model(args.model)
    import strata
    from strata.vllm import patches
    from vllm import SamplingParams

    def engine():
        llm = make_llm(args.model, args.requests, args.kv_bytes, log_stats=False)
        return llm, block_pool(llm)._strata_kv

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    spaces = []
    mapped_sums = []

    def run(llm, prefix):
        engine_ = llm.llm_engine
        outputs = {}
        for i, p in enumerate(prompts(args.requests)):
            engine_.add_request(f"{prefix}{i}", {"prompt_token_ids": p}, sp)
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            mapped_sums.append(sum(kv.stats()["mapped_bytes"] for kv in spaces))
        return [outputs[f"{prefix}{i}"] for i in range(args.requests)]

    device_bytes = strata.stats(0)["total_bytes"]
    llm_a, kv_a = engine()
    spaces.append(kv_a)
    outputs_a = run(llm_a, "a")
    idle_a = kv_a.stats()["mapped_bytes"]
    llm_b, kv_b = engine()
    spaces.append(kv_b)
    outputs_b = run(llm_b, "b")
    # A sleeps: its own KV goes back to the pool, B's (spare groups) stays; A wakes and runs.
    mapped_b = kv_b.stats()["mapped_bytes"]
    llm_a.sleep(level=1)
    asleep = [kv_a.stats()["mapped_bytes"], kv_b.stats()["mapped_bytes"]]
    llm_a.wake_up()
    outputs_a_again = run(llm_a, "c")

    # Stock vLLM's accounting on the same device: each engine's whole KV mapped at once.
    failed_a = kv_a.map_groups(range(kv_a.num_blocks))
    failed_b = kv_b.map_groups(range(kv_b.num_blocks))
    stock_pool_bytes = strata.stats(0)["pool_in_use_bytes"]
    for kv in (kv_a, kv_b):
        for g in kv.mapped_group_list():
            if g:
                patches.unmap_free_group(kv.block_pool, g)

    print("RESULT " + json.dumps({
        "device_bytes": device_bytes,
        "virtual_bytes": [kv_a.stats()["virtual_bytes"], kv_b.stats()["virtual_bytes"]],
        "group_bytes": kv_a.group_bytes,
        "outputs_a": outputs_a,
        "outputs_b": outputs_b,
        "outputs_a_again": outputs_a_again,
        "idle_a": idle_a,
        "idle_b": mapped_b,
        "a_asleep": asleep,
        "peak_mapped_sum": max(mapped_sums),
        "stock_failed_groups_a": len(failed_a),
        "stock_failed_groups_b": len(failed_b),
        "stock_pool_bytes": stock_pool_bytes,
        "mapped_after": [kv_a.stats()["mapped_bytes"], kv_b.stats()["mapped_bytes"]],
    }), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
