"""What `bench_cache` and `bench_offload` share: the benchmark model, a timed greedy
`generate()`, rounds that alternate the configurations (so that load which comes and goes hits
all of them), and the figures every table states (the load average, the link model).

Timings on a shared machine are only comparable side by side within one run: each round runs
every configuration once, and the tables give every round, not only the best.
"""

import os
import time


def model_and_prompts(batch, prompt, layers=4, hidden=256, heads=8, kv_heads=4, vocab=1024, seed=0, device="cpu"):
    """A random-initialised Llama (float32, on `device`) and `batch` prompts of `prompt` tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval().to(device)
    ids = torch.randint(3, vocab, (batch, prompt)).to(device)
    return model, ids


def timed_generate(model, ids, cache, new_tokens, **generate_kw):
    """(seconds, output ids) of a greedy generation of exactly `new_tokens` tokens (on CUDA the
    clock stops after the device finished)."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **generate_kw,
        )
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - start, out


def alternate(names, rounds, run):
    """`run(name)` for every name once per round, `rounds` times, each round starting one name
    later (so no configuration always follows the same one); returns {name: [result of each
    round]} and the 1-minute load average at the start of each round."""
    results = {name: [] for name in names}
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        start = r % len(names)
        for name in names[start:] + names[:start]:
            results[name].append(run(name))
    return results, loads


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def setting():
    """The environment the numbers depend on, for the table's heading."""
    keys = ("STRATA_BACKEND", "STRATA_HOST_GRANULARITY", "STRATA_HOST_LINK", "OMP_NUM_THREADS")
    return ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in keys)


def rounds_line(loads):
    return "load average (1 min) at each round's start: " + ", ".join(f"{x:.1f}" for x in loads)
