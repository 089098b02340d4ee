"""Runs a tiny random-initialised Llama in vLLM (CPU build) on a fixed batch of token-id prompts
and prints one JSON line: the greedy outputs, and per engine step the blocks in use and (with
strata.vllm on) the KV bytes mapped. test_vllm.py runs it with STRATA_VLLM=1 and without.

    python run_engine.py MODEL_DIR [--requests N] [--max-tokens N] [--kind llama|mixtral]
        [--bench [--waves N]]
"""

import argparse
import contextlib
import itertools
import json
import os
import resource
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# A small Llama: GQA (4 query heads, 2 KV heads), head_dim 64, two layers.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# The same with a mixture of experts in place of the MLP (4 experts, 2 per token).
MIXTRAL = dict(
    LLAMA,
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    num_local_experts=4,
    num_experts_per_tok=2,
)
MODELS = {"llama": LLAMA, "mixtral": MIXTRAL}


def write_model(path, kind="llama"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MODELS[kind], f)


@contextlib.contextmanager
def livelier_dummy_weights():
    """vLLM's dummy loader draws every tensor in +-1e-3 from one seed: such a model hardly reads
    its context (each output follows the last token). Zeroing the whole KV cache after the second
    step (what a group unmapped too early reads) changed none of 8 outputs with those weights.
    Inside this, each tensor gets its own seed (in load order: the same weights for every engine
    built) and +-0.1: the same zeroing changed all 8."""
    from vllm.model_executor.model_loader import dummy_loader

    current = dummy_loader.initialize_single_dummy_weight
    # vLLM's own, even when an engine is built inside another's construction (nested)
    stock = getattr(current, "stock", current)
    seeds = itertools.count(1)

    def initialize(param, *args, **kwargs):
        stock(param, low=-0.1, high=0.1, seed=next(seeds))

    initialize.stock = stock
    dummy_loader.initialize_single_dummy_weight = initialize
    try:
        yield
    finally:
        dummy_loader.initialize_single_dummy_weight = current


def make_llm(model, requests, kv_bytes, log_stats):
    """The engine every script here runs: fp32, block size 32, 512 tokens per request at most,
    ``kv_bytes`` of KV cache; ``log_stats`` makes LLM.get_metrics() work."""
    from vllm import LLM

    with livelier_dummy_weights():
        return LLM(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            block_size=32,
            max_model_len=512,
            max_num_seqs=requests,
            kv_cache_memory_bytes=kv_bytes,
            seed=0,
            disable_log_stats=not log_stats,
        )


def prompts(n, salt=0):
    """n prompts of different lengths (17, 40, 63, ... tokens), deterministic token ids; another
    ``salt`` gives other tokens (no prefix-cache hits between them)."""
    out = []
    for i in range(n):
        length = 17 + 23 * i
        out.append([(7 * i + 13 * t + salt) % 1000 + 3 for t in range(length)])
    return out


def run_batch(engine, prefix, batch, sp, outputs, first_token, on_step=None):
    """Submits the token-id prompts of ``batch`` as requests ``prefix0``, ``prefix1``, ... at
    once and steps ``engine`` until none is unfinished: each request's output tokens go to
    ``outputs``, the seconds from the submit to its first output token to ``first_token``;
    ``on_step()`` runs after each step. Returns the outputs in request order."""
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": p}, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid = out.request_id
            if rid not in first_token and out.outputs and out.outputs[0].token_ids:
                first_token[rid] = time.perf_counter() - start
            if out.finished:
                outputs[rid] = list(out.outputs[0].token_ids)
        if on_step is not None:
            on_step()
    return [outputs[f"{prefix}{i}"] for i in range(len(batch))]


def block_pool(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool


def grace(args, plugin, outputs, timed_wave, mapped):
    """After the first wave: a second of the same shape (other tokens) at once, then idle until
    the KV groups beyond the spares are unmapped (STRATA_VLLM_TRIM_DELAY), or 30 s."""
    import strata.vllm

    kv = strata.vllm.elastic.newest()
    after_a = strata.vllm.stats()
    timed_wave("g", salt=1)
    after_g = strata.vllm.stats()
    ended = time.monotonic()
    floor = (kv.spare_groups + 1) * kv.group_bytes  # the spares and the null block's group
    while mapped() > floor and time.monotonic() - ended < 30:
        time.sleep(0.02)
    fell_after = time.monotonic() - ended
    print("RESULT " + json.dumps({
        "plugin": plugin,
        "outputs": [outputs[f"a{i}"] for i in range(args.requests)],
        "after_a": after_a,
        "after_g": after_g,
        "idle": strata.vllm.stats(),
        "fell_after_s": fell_after,
        "trim_delay_s": kv.trim_delay,
        "spare_groups": kv.spare_groups,
        "group_bytes": kv.group_bytes,
    }), flush=True)
    os._exit(0)


def limit_from_outside(args, outputs, run_wave, mapped, steps):
    """After the first wave (its free groups kept mapped: a long STRATA_VLLM_TRIM_DELAY), an
    operator's process halves the engine's KV limit through the control folder; the idle engine
    applies it; the same prompts run under it; then bad requests and the limit lifted."""
    import subprocess

    import strata.vllm

    kv = strata.vllm.elastic.newest()
    name = f"{os.getpid()}-{kv.label}"
    cli = [sys.executable, "-m", "strata.vllm.control"]

    def ctl(*argv):
        return subprocess.run(cli + list(argv), capture_output=True, text=True, timeout=60)

    def wait_for(done):
        start = time.monotonic()
        while not done() and time.monotonic() - start < 10:
            time.sleep(0.02)
        return time.monotonic() - start

    peak = max(s["mapped"] for s in steps)
    held = mapped()
    limit = peak // 2 // kv.group_bytes * kv.group_bytes
    set_rc = ctl("limit", name, str(limit)).returncode
    applied_after = wait_for(lambda: kv.limit_bytes == limit and mapped() <= limit)
    idle_limited = mapped()
    listed = json.loads(ctl("list", "--json").stdout)
    del steps[:]
    run_wave("l")
    limited = [s["mapped"] for s in steps]
    unknown = ctl("limit", "1-99", "1MiB")
    bad_size = ctl("limit", name, "12 parsecs")
    lift_rc = ctl("limit", name, "none").returncode
    lifted_after = wait_for(lambda: kv.limit_bytes is None)
    print("RESULT " + json.dumps({
        "outputs": [outputs[f"a{i}"] for i in range(args.requests)],
        "outputs_limited": [outputs[f"l{i}"] for i in range(args.requests)],
        "name": name,
        "group_bytes": kv.group_bytes,
        "peak": peak,
        "held": held,
        "limit": limit,
        "set_rc": set_rc,
        "applied_after_s": applied_after,
        "idle_limited": idle_limited,
        "listed": listed,
        "limited_steps": limited,
        "unknown": [unknown.returncode, unknown.stderr],
        "bad_size": [bad_size.returncode, bad_size.stderr],
        "lift_rc": lift_rc,
        "lifted": kv.limit_bytes is None,
        "lifted_after_s": lifted_after,
    }), flush=True)
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    ap.add_argument("--kind", choices=sorted(MODELS), default="llama")
    ap.add_argument("--waves", type=int, default=1, help="with --bench: waves to time")
    ap.add_argument(
        "--bench", action="store_true", help="one wave, no per-step probes (bench.py)"
    )
    ap.add_argument(
        "--grace",
        action="store_true",
        help="a second wave right after the first, then idle until the KV is trimmed",
    )
    ap.add_argument(
        "--limit",
        action="store_true",
        help="after the first wave, halve the KV limit through the control CLI and run again",
    )
    args = ap.parse_args()

    write_model(args.model, args.kind)
    from vllm import SamplingParams

    llm = make_llm(args.model, args.requests, args.kv_bytes, log_stats=not args.bench)
    plugin = os.environ.get("STRATA_VLLM", "0") not in ("", "0")
    if plugin:
        import strata.vllm

    pool = block_pool(llm)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def in_use():
        return pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # less the null block

    def mapped():
        return strata.vllm.stats()["mapped_bytes"] if plugin else None

    steps = [{"blocks": in_use(), "mapped": mapped()}]
    outputs = {}
    first_token = {}

    def record_step():
        if not args.bench:
            steps.append({"blocks": in_use(), "mapped": mapped()})

    def run_wave(prefix, salt=0):
        wave = prompts(args.requests, salt)
        run_batch(engine, prefix, wave, sp, outputs, first_token, record_step)

    def timed_wave(prefix, salt=0):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.process_time()
        start = time.perf_counter()
        run_wave(prefix, salt)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu  # every thread's CPU time: the wave's cost, queueing aside
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        rids = [f"{prefix}{i}" for i in range(args.requests)]
        generated = sum(len(outputs[r]) for r in rids)
        return {
            "tokens_per_s": generated / elapsed,
            "tokens_per_cpu_s": generated / cpu,
            "mean_ttft_s": sum(first_token[r] for r in rids) / len(rids),
            "minor_faults": faults,
        }

    first = timed_wave("a")
    if args.grace:
        grace(args, plugin, outputs, timed_wave, mapped)
    if args.limit:
        limit_from_outside(args, outputs, run_wave, mapped, steps)
    if args.bench:
        # later waves: other tokens, the same shape; the KV pages were mapped before
        warm = [timed_wave(f"w{n}", salt=n) for n in range(1, args.waves)]
        print("RESULT " + json.dumps({
            "plugin": plugin,
            "outputs": [outputs[f"a{i}"] for i in range(args.requests)],
            **first,
            "warm": warm,
            "stats": strata.vllm.stats() if plugin else None,
        }), flush=True)
        os._exit(0)
    # The same prompts again: prefix-cache hits on blocks whose groups stayed mapped, recompute
    # for the others (their hashes left the cache when their group was unmapped).
    run_wave("b")
    # strata's figures among vLLM's metrics, read back as an operator would (LLM.get_metrics)
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:strata_"):
            metrics[m.name] = m.value
    stats_now = strata.vllm.stats() if plugin else None
    # Sleep (strata: KV groups back to the pool), wake, and the same prompts once more.
    llm.sleep(level=1)
    asleep = mapped()
    llm.wake_up()
    run_wave("c")
    result = {
        "plugin": plugin,
        "outputs": [outputs[f"a{i}"] for i in range(args.requests)],
        "outputs_again": [outputs[f"b{i}"] for i in range(args.requests)],
        "outputs_after_sleep": [outputs[f"c{i}"] for i in range(args.requests)],
        "mapped_asleep": asleep,
        "metrics": metrics,
        "stats_with_metrics": stats_now,
        "steps": steps,
        "tokens_per_s": first["tokens_per_s"],
        "mean_ttft_s": first["mean_ttft_s"],
        "stats": strata.vllm.stats() if plugin else None,
        "block_bytes_all_layers": None,
    }
    if plugin:
        kv = strata.vllm.elastic.newest()
        result["block_bytes_all_layers"] = kv.group_bytes // kv.blocks_per_group
        result["group_bytes"] = kv.group_bytes
        result["blocks_per_group"] = kv.blocks_per_group
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's interpreter-exit teardown (slow on CPU); nothing is left to flush


if __name__ == "__main__":
    main()
