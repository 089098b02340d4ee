"""Two vLLM engines in one process on one strata device too small for both KV caches as stock
vLLM holds them (each engine's whole capacity, all the time): engine A runs a batch and goes idle
(its KV groups back to the pool), engine B runs the same batch, A sleeps and wakes (its own KV
unmapped, B's kept) and runs again; then A shuts down (its space closed, its pages back in the
pool, out of the metrics; B's untouched).

The engines are built out of order: B is built entirely inside A's construction, between A's
KV allocation and A's scheduler (a wrapper around vLLM's Scheduler.__init__), so the newest KV
space when A's block pool is made is B's. Each pool must still attach to its own engine's.
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
    import functools
    import gc

    import strata
    import strata.vllm
    from strata.vllm import elastic, metrics, patches
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    strata.vllm.enable()  # now, so that the wrapper below goes around strata's
    strata_init = Scheduler.__init__
    nested = {}

    @functools.wraps(strata_init)  # strata's version check sees vLLM's signature
    def scheduler_init(self, *a, **k):
        if not nested:  # A's scheduler: build all of B first (its KV space is newer than A's)
            nested["b"] = None
            nested["b"] = make_llm(args.model, args.requests, args.kv_bytes, log_stats=False)
        strata_init(self, *a, **k)

    Scheduler.__init__ = scheduler_init
    llm_a = make_llm(args.model, args.requests, args.kv_bytes, log_stats=False)
    Scheduler.__init__ = strata_init
    llm_b = nested["b"]

    def runner_kv(llm):
        """The space behind the model runner's own KV tensors (by address)."""
        core = llm.llm_engine.engine_core.engine_core
        return elastic.owner_of(core.model_executor.driver_worker.worker.model_runner.kv_caches[0])

    kv_a, kv_b = block_pool(llm_a)._strata_kv, block_pool(llm_b)._strata_kv
    built_order = [kv.label for kv in elastic.spaces()]  # oldest first: A's KV, then B's
    spaces_ab = [kv_a, kv_b]
    own_space = [runner_kv(llm_a) is kv_a, runner_kv(llm_b) is kv_b, kv_a is not kv_b]

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
    spaces.extend([kv_a, kv_b])
    outputs_a = run(llm_a, "a")
    idle_a = kv_a.stats()["mapped_bytes"]
    unmaps_a = kv_a.stats()["unmaps"]
    outputs_b = run(llm_b, "b")
    a_after_b = kv_a.stats()["mapped_bytes"]
    a_unmaps_during_b = kv_a.stats()["unmaps"] - unmaps_a
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
    mapped_after = [kv_a.stats()["mapped_bytes"], kv_b.stats()["mapped_bytes"]]
    virtual = [kv_a.stats()["virtual_bytes"], kv_b.stats()["virtual_bytes"]]
    group_bytes = kv_a.group_bytes

    # A shuts down: its pages go back to the pool and it leaves the metrics; B runs on.
    def labels():
        return sorted(
            {s.labels["engine"] for m in metrics.Collector().collect() for s in m.samples}
        )

    labels_before = labels()
    pool_before = strata.stats(0)["pool_in_use_bytes"]
    llm_a.llm_engine.engine_core.shutdown()
    shut = {
        "labels_before": labels_before,
        "labels_after": labels(),
        "spaces_after": [kv.label for kv in elastic.spaces()],
        "pool_before": pool_before,
        "pool_after": strata.stats(0)["pool_in_use_bytes"],
        "b_mapped": kv_b.stats()["mapped_bytes"],
        "a_closed": kv_a.closed,
    }
    # (vLLM's EngineCore.shutdown also tears down the process's distributed state, so no
    # engine of this process can step after it: B is checked, not run.)
    # Once nothing holds A's tensors any more, A's KV space itself is destroyed.
    space_a = kv_a.space
    del llm_a, kv_a, spaces_ab, spaces
    gc.collect()
    shut["a_destroyed"] = space_a.handle is None

    print("RESULT " + json.dumps({
        "device_bytes": device_bytes,
        "virtual_bytes": virtual,
        "group_bytes": group_bytes,
        "outputs_a": outputs_a,
        "outputs_b": outputs_b,
        "outputs_a_again": outputs_a_again,
        "idle_a": idle_a,
        "idle_b": mapped_b,
        "a_after_b": a_after_b,
        "a_unmaps_during_b": a_unmaps_during_b,
        "a_asleep": asleep,
        "peak_mapped_sum": max(mapped_sums),
        "stock_failed_groups_a": len(failed_a),
        "stock_failed_groups_b": len(failed_b),
        "stock_pool_bytes": stock_pool_bytes,
        "mapped_after": mapped_after,
        "built_order": built_order,
        "labels": [kv_b.label],
        "own_space": own_space,
        "shutdown": shut,
    }), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
