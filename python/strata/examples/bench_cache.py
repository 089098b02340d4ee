"""StrataCache against transformers' DynamicCache and StaticCache, side by side in one process:
decode time per token and peak KV bytes at a short and a long context.

    python -m strata.examples.bench_cache                 # BENCHMARKS.md's table (contexts 256, 2048)
    python -m strata.examples.bench_cache --quick         # a smoke run

StrataCache runs twice: with transformers' "sdpa" attention, as the other caches, and with
"strata_sdpa" (decode steps read adjacent heads' rows together; `strata._row_attention`).
Model: a random-initialised Llama (4 layers, hidden 256, 8 heads over 4 KV heads, float32),
batch 4, 64-token prompts, greedy. Decode time per token is (generate(N) - generate(1)) / (N - 1)
per configuration, so the prefill is not counted. Each round runs every cache once (rounds
alternate the caches); the table gives every round and the median. Peak KV bytes: DynamicCache's
tensors at the end (its largest), StaticCache's reservation, StrataCache's mapped pages (largest
seen).
"""

import argparse

from ._bench import alternate, median, model_and_prompts, rounds_line, setting, timed_generate

NAMES = ("dynamic", "static", "strata", "strata_rows")
LABEL = {
    "dynamic": "DynamicCache",
    "static": "StaticCache",
    "strata": "StrataCache",
    "strata_rows": 'StrataCache, "strata_sdpa"',
}


def run(model, ids, name, new_tokens, max_len):
    """(seconds, peak KV bytes, output ids) of one generation with the `name` cache. Every cache
    runs with transformers' "sdpa" attention except "strata_rows": StrataCache with
    "strata_sdpa" (`strata._row_attention`)."""
    from transformers import DynamicCache, StaticCache

    from strata.transformers import ATTENTION, StrataCache

    model.set_attn_implementation(ATTENTION if name == "strata_rows" else "sdpa")
    if name == "dynamic":
        cache = DynamicCache()
    elif name == "static":
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        cache = StrataCache(model.config, max_cache_len=max_len)
    elapsed, out = timed_generate(model, ids, cache, new_tokens)
    if name.startswith("strata"):
        held = cache.stats()["kv_bytes"]
        cache.close()
    else:
        held = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers if l.is_initialized)
    return elapsed, held, out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.bench_cache")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--short", type=int, default=192, help="new tokens of the short run (context 256)")
    p.add_argument("--long", type=int, default=1984, help="new tokens of the long run (context 2048)")
    p.add_argument("--static-len", type=int, default=4096, help="StaticCache's and StrataCache's max_cache_len")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every cache once")
    p.add_argument("--only", choices=("short", "long"), help="one context only")
    p.add_argument("--quick", action="store_true", help="short 32 and long 128 new tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.short, args.long, args.rounds = 32, 128, 1
    model, ids = model_and_prompts(args.batch, args.prompt)
    c = model.config
    bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    print(f"batch {args.batch}, prompt {args.prompt}, 4 layers, hidden 256, float32; StaticCache and "
          f"StrataCache reserve {args.static_len} tokens; {setting()}")
    for name in NAMES:
        run(model, ids, name, 2, args.static_len)  # warm-up
    contexts = {"short": args.short, "long": args.long}
    for which, new in contexts.items():
        if args.only and which != args.only:
            continue
        context = args.prompt + new

        def one(name, new=new):
            first, _, _ = run(model, ids, name, 1, args.static_len)
            total, held, out = run(model, ids, name, new, args.static_len)
            return (total - first) / (new - 1) * 1e3, total, held, out

        results, loads = alternate(NAMES, args.rounds, one)
        tokens = args.batch * (context - 1) * bytes_per_token
        print(f"\ncontext {context}; {rounds_line(loads)}")
        print("| context | cache | decode ms/token, each round | median | vs DynamicCache (median) | "
              "peak KV bytes | / KV bytes of the tokens held |")
        print("|---|---|---|---|---|---|---|")
        base = median([r[0] for r in results["dynamic"]])
        for name in NAMES:
            per = [r[0] for r in results[name]]
            held = max(r[2] for r in results[name])
            print(f"| {context} | {LABEL[name]} | {', '.join(f'{x:.2f}' for x in per)} | {median(per):.2f} | "
                  f"{median(per) / base:.3f}x | {held:,} | {held / tokens:.4f}x of {tokens:,} |", flush=True)
        same = all(bool((r[3] == results["dynamic"][0][3]).all()) for n in NAMES for r in results[n])
        print(f"same tokens in every cache and round: {same}")


if __name__ == "__main__":
    main()
