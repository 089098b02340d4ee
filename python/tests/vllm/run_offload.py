"""Runs run_engine.py's tiny Llama with a KV budget that forces preemption, with vLLM's
OffloadingConnector on strata's tiers (--offload) or stock vLLM (recompute), and prints one
JSON line: the greedy outputs, the tokens the model computed (summed over the scheduler's
steps), the tokens it had to compute at least, the preemptions, and strata's offload figures.

    python run_offload.py MODEL_DIR [--offload] [--blocks 20] [--requests 8] [--max-tokens 48]
        [--host-bytes N] [--disk-bytes N --disk-dir DIR] [--warmup] [--waves N] [--again]
        [--hold-stores N]

Recomputed tokens = computed - (prompt tokens + generated tokens - 1 per request): every
token is computed once without preemption (the prompts share no prefix); a preempted request
computes again what neither vLLM's prefix cache nor the offload tier gives back.

Partial-block tokens = the tokens in the last, partly filled block of each request when it was
preempted. vLLM's OffloadingConnector (0.32) keys offloaded chunks by the hashes of full
blocks: a partial block has no hash, so it is never stored nor looked up (its partial-tail
store covers only prompt boundaries of hybrid-state groups), and a resumed request recomputes
it. With the offload, recomputed tokens == partial-block tokens: everything else came back.
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_engine import prompts, run_batch, write_model  # noqa: E402  (V1 multiprocessing off)

BLOCK = 32  # tokens per vLLM block; one block of one layer is 32 KiB for this model


def spread_weights(model):
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)


def check_store_sources(worker, kv, counts):
    """With the elastic plugin: counts the stores that were about to read a block whose group
    was unmapped (its bytes gone: such a store would offload zeros or another request's KV)."""
    real_store = worker._store

    def checked_store(job):
        if not all(kv.is_mapped(b) for b in job.blocks):
            counts["stores_of_unmapped_blocks"] = counts.get("stores_of_unmapped_blocks", 0) + 1
        real_store(job)

    worker._store = checked_store


def hold_stores(worker, steps, counts):
    """Makes each of ``worker``'s stores wait ``steps`` engine steps (get_finished calls) on
    its transfer thread before it copies, or until vLLM waits for stores (its flush before it
    reuses blocks): stores are then in flight while the scheduler frees their blocks."""
    cond = threading.Condition()
    state = {"step": 0, "waiting": 0}
    real_store, real_wait, real_finished = worker._store, worker.wait, worker.get_finished

    def held_store(job):
        with cond:
            until = state["step"] + steps
            cond.wait_for(lambda: state["step"] >= until or state["waiting"] > 0)
            counts["held_stores"] = counts.get("held_stores", 0) + 1
        real_store(job)

    def get_finished():
        with cond:
            state["step"] += 1
            cond.notify_all()
        return real_finished()

    def wait(job_ids):
        with cond:
            state["waiting"] += 1
            cond.notify_all()
        try:
            real_wait(job_ids)
        finally:
            with cond:
                state["waiting"] -= 1

    worker._store, worker.get_finished, worker.wait = held_store, get_finished, wait


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--blocks-per-chunk", type=int, default=2)
    ap.add_argument("--host-bytes", type=int, default=16 << 20)
    ap.add_argument("--disk-bytes", type=int, default=0)
    ap.add_argument("--disk-dir")
    ap.add_argument("--again", action="store_true", help="then the same prompts once more")
    ap.add_argument("--warmup", action="store_true", help="first a wave of other prompts")
    ap.add_argument("--waves", type=int, default=1, help="measured waves (others: other tokens)")
    ap.add_argument(
        "--hold-stores",
        type=int,
        default=0,
        help="with --offload: each store waits this many engine steps before it copies "
        "(or until vLLM waits for it), so stores are in flight while blocks are freed",
    )
    args = ap.parse_args()

    write_model(args.model)
    import strata.vllm
    from vllm import LLM, SamplingParams

    extra = {}
    if args.offload:
        import strata.vllm.offload as offload

        extra["kv_transfer_config"] = offload.kv_transfer_config(
            host_bytes=args.host_bytes,
            disk_bytes=args.disk_bytes,
            disk_dir=args.disk_dir,
            blocks_per_chunk=args.blocks_per_chunk,
        )
    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=256,
        max_num_seqs=args.requests,
        kv_cache_memory_bytes=64 << 20,
        num_gpu_blocks_override=args.blocks,
        seed=0,
        **extra,
    )
    # vLLM's dummy weights (uniform in +-1e-3) make attention nearly uniform; weights with a
    # larger spread make the tokens depend on the KV they attend to.
    llm.apply_model(spread_weights)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    counts = {"computed": 0, "preemptions": 0, "steps": 0, "partial_block_tokens": 0}
    computed = {}  # request id -> tokens computed after the last step that scheduled it
    schedule = scheduler.schedule

    def counting_schedule(*a, **k):
        out = schedule(*a, **k)
        counts["computed"] += out.total_num_scheduled_tokens
        counts["steps"] += 1
        for rid in out.preempted_req_ids or ():
            counts["preemptions"] += 1
            # Tokens of the preempted request's last, partial block: it has no block hash, so
            # vLLM's OffloadingConnector can neither store nor look it up (see module doc).
            counts["partial_block_tokens"] += computed.pop(rid, 0) % BLOCK
        for rid in out.num_scheduled_tokens:
            computed[rid] = scheduler.requests[rid].num_computed_tokens
        return out

    scheduler.schedule = counting_schedule
    plugin = os.environ.get("STRATA_VLLM", "0") not in ("", "0")
    pool = scheduler.kv_cache_manager.block_pool
    mapped = []  # with the elastic plugin, per step: (blocks in use, KV bytes mapped)
    if args.offload and plugin:
        (worker,) = offload._WORKERS.values()  # this engine's
        check_store_sources(worker, pool._strata_kv, counts)
    if args.offload and args.hold_stores:
        (worker,) = offload._WORKERS.values()
        hold_stores(worker, args.hold_stores, counts)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.requests)
    outputs = {}
    first_token = {}  # request id -> seconds from its wave's start to its first output token

    def record_step():
        if plugin:
            in_use = pool.num_gpu_blocks - pool.free_block_queue.num_free_blocks - 1
            mapped.append((in_use, strata.vllm.stats()["mapped_bytes"]))

    def run_wave(prefix, wave=batch):
        return run_batch(engine, prefix, wave, sp, outputs, first_token, record_step)

    if args.warmup:
        # One wave of other tokens first (kernels, pages, tiers warm), then the counts restart.
        run_wave("warmup", prompts(args.requests, salt=500))
        counts.update(computed=0, preemptions=0, steps=0, partial_block_tokens=0)
        mapped.clear()
    waves = []
    for k in range(args.waves):
        # The first measured wave is the tests' batch; the others the same shapes, other tokens.
        counts.update(computed=0, preemptions=0, steps=0, partial_block_tokens=0)
        wave = batch if k == 0 else prompts(args.requests, salt=100 * k)
        prefix = "" if k == 0 else f"w{k}-"
        start = time.perf_counter()
        outs = run_wave(prefix, wave)
        elapsed = time.perf_counter() - start
        generated = sum(len(o) for o in outs)
        needed = sum(len(p) for p in wave) + generated - len(wave)
        waves.append({
            "outputs": outs,
            "computed_tokens": counts["computed"],
            "needed_tokens": needed,
            "recomputed_tokens": counts["computed"] - needed,
            "preemptions": counts["preemptions"],
            "partial_block_tokens": counts["partial_block_tokens"],
            "steps": counts["steps"],
            "tokens_per_s": generated / elapsed,
            "mean_ttft_s": sum(first_token[f"{prefix}{i}"] for i in range(len(wave))) / len(wave),
            "elapsed_s": elapsed,
        })
    # The same prompts again: what vLLM's prefix cache and the offload tier give back is not
    # computed again (a repeated prefix), and must be the KV the first wave wrote.
    counts["computed"] = 0
    again = run_wave("again") if args.again else None
    result = {
        "offload": args.offload,
        **waves[0],
        "waves": [{k: v for k, v in w.items() if k != "outputs"} for w in waves],
        "outputs_again": again,
        "computed_again": counts["computed"],
        "strata": None,
        "held_stores": counts.get("held_stores", 0),
        "stores_of_unmapped_blocks": counts.get("stores_of_unmapped_blocks", 0),
        "elastic": None,
    }
    if args.offload:
        result["strata"] = offload.stats()
    if plugin:
        kv = strata.vllm.elastic.newest()
        result["elastic"] = dict(
            strata.vllm.stats(), steps=mapped, group_bytes=kv.group_bytes,
            blocks_per_group=kv.blocks_per_group, spare_groups=kv.spare_groups,
        )
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's interpreter-exit teardown (slow on CPU); nothing is left to flush


if __name__ == "__main__":
    main()
