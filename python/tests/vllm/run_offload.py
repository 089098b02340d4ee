"""Runs run_engine.py's tiny Llama with a KV budget that forces preemption, with vLLM's
OffloadingConnector on strata's tiers (--offload) or stock vLLM (recompute), and prints one
JSON line: the greedy outputs, the tokens the model computed (summed over the scheduler's
steps), the tokens it had to compute at least, the preemptions, and strata's offload figures.

    python run_offload.py MODEL_DIR [--offload] [--blocks 20] [--requests 8] [--max-tokens 48]
        [--host-bytes N] [--disk-bytes N --disk-dir DIR]

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
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_engine import prompts, write_model  # noqa: E402  (also sets the V1 multiprocessing off)

BLOCK = 32  # tokens per vLLM block; one block of one layer is 32 KiB for this model


def spread_weights(model):
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)


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
    args = ap.parse_args()

    write_model(args.model)
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
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.requests)
    outputs = {}
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    generated = sum(len(v) for v in outputs.values())
    needed = sum(len(p) for p in batch) + generated - len(batch)
    result = {
        "offload": args.offload,
        "outputs": [outputs[str(i)] for i in range(args.requests)],
        "computed_tokens": counts["computed"],
        "needed_tokens": needed,
        "recomputed_tokens": counts["computed"] - needed,
        "preemptions": counts["preemptions"],
        "partial_block_tokens": counts["partial_block_tokens"],
        "steps": counts["steps"],
        "tokens_per_s": generated / elapsed,
        "elapsed_s": elapsed,
        "strata": None,
    }
    if args.offload:
        result["strata"] = offload.stats()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's interpreter-exit teardown (slow on CPU); nothing is left to flush


if __name__ == "__main__":
    main()
