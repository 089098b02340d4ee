"""StrataCache against transformers' DynamicCache and StaticCache, side by side in one process:
decode time per token and peak KV bytes at a short and a long context.

    python -m strata.examples.bench_cache                 # BENCHMARKS.md's table (contexts 256, 2048)
    python -m strata.examples.bench_cache --quick         # a smoke run
    python -m strata.examples.bench_cache --compile       # decode steps compiled (static caches)
    python -m strata.examples.bench_cache --device cuda --compile   # on a GPU (CUDA backend)
    python -m strata.examples.bench_cache --layouts       # StrataCache's two layouts side by side

StrataCache runs twice: with transformers' "sdpa" attention, as the other caches, and with
"strata_sdpa" (decode steps read adjacent heads' rows together; `strata._row_attention`).
Model: a random-initialised Llama (4 layers, hidden 256, 8 heads over 4 KV heads, float32),
batch 4, 64-token prompts, greedy. Decode time per token is (generate(N) - generate(1)) / (N - 1)
per configuration, so the prefill is not counted. Each round runs every cache once (rounds
alternate the caches); the table gives every round and the median. Peak KV bytes: DynamicCache's
tensors at the end (its largest), StaticCache's reservation, StrataCache's mapped pages (largest
seen).

`--compile`: generate() compiles the decode step (torch.compile, inductor, fullgraph) of the
compileable caches, StaticCache and `StrataCache(compileable=True)`, on any device
(`compile_config`); DynamicCache is not compileable and runs eagerly, as generate() runs it.
`--device cuda` runs the model on the GPU (strata's CUDA backend for StrataCache). The warm-up
run of each cache compiles; the timed runs reuse the compiled step.

StrataCache takes its default `layout="auto"` ("token" for this model: a page holds a token
range of every row and layer, so the views' token stride spans them all); `--layouts` adds
StrataCache with `layout="request"` (a page per row, layer and K/V; the token stride is one
row's heads) beside each StrataCache configuration, to measure what the strides cost.
"""

import argparse

from ._bench import alternate, median, model_and_prompts, rounds_line, setting, timed_generate

NAMES = ("dynamic", "static", "strata", "strata_rows")
REQUEST = "@request"  # a StrataCache name with this suffix: layout="request"
LABEL = {
    "dynamic": "DynamicCache",
    "static": "StaticCache",
    "strata": "StrataCache",
    "strata_rows": 'StrataCache, "strata_sdpa"',
    "strata" + REQUEST: 'StrataCache, layout="request"',
    "strata_rows" + REQUEST: 'StrataCache, "strata_sdpa", layout="request"',
}


def compile_config():
    """generate()'s settings to compile the decode step of a compileable cache on any device."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config


def run(model, ids, name, new_tokens, max_len, compiled=False):
    """(seconds, peak KV bytes, output ids) of one generation with the `name` cache. Every cache
    runs with transformers' "sdpa" attention except "strata_rows": StrataCache with
    "strata_sdpa" (`strata._row_attention`)."""
    from transformers import DynamicCache, StaticCache

    from strata.transformers import ATTENTION, StrataCache

    model.set_attn_implementation(ATTENTION if name.startswith("strata_rows") else "sdpa")
    if name == "dynamic":
        cache = DynamicCache()
    elif name == "static":
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        layout = "request" if name.endswith(REQUEST) else "auto"
        cache = StrataCache(model.config, max_cache_len=max_len, compileable=compiled, layout=layout)
    kw = {"compile_config": compile_config()} if compiled and name != "dynamic" else {"disable_compile": True}
    elapsed, out = timed_generate(model, ids, cache, new_tokens, **kw)
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
    p.add_argument("--compile", action="store_true", help="compile the decode step of StaticCache and StrataCache")
    p.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda)")
    p.add_argument("--layouts", action="store_true", help='each StrataCache also with layout="request"')
    args = p.parse_args(argv)
    if args.quick:
        args.short, args.long, args.rounds = 32, 128, 1
    model, ids = model_and_prompts(args.batch, args.prompt, device=args.device)
    names = NAMES[:3] if args.compile else NAMES  # "strata_sdpa" is an eager CPU path
    if args.layouts:
        names = tuple(n for name in names for n in ((name, name + REQUEST) if name.startswith("strata") else (name,)))
    c = model.config
    bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    compiled = "compiled decode steps (StaticCache, StrataCache)" if args.compile else "eager"
    print(f"batch {args.batch}, prompt {args.prompt}, 4 layers, hidden 256, float32, {args.device}, {compiled}; "
          f"StaticCache and StrataCache reserve {args.static_len} tokens; {setting()}")
    for name in names:
        run(model, ids, name, 2, args.static_len, args.compile)  # warm-up (and compilation)
    contexts = {"short": args.short, "long": args.long}
    for which, new in contexts.items():
        if args.only and which != args.only:
            continue
        context = args.prompt + new

        def one(name, new=new):
            first, _, _ = run(model, ids, name, 1, args.static_len, args.compile)
            total, held, out = run(model, ids, name, new, args.static_len, args.compile)
            return (total - first) / (new - 1) * 1e3, total, held, out

        results, loads = alternate(names, args.rounds, one)
        tokens = args.batch * (context - 1) * bytes_per_token
        print(f"\ncontext {context}; {rounds_line(loads)}")
        print("| context | cache | decode ms/token, each round | median | vs DynamicCache (median) | "
              "peak KV bytes | / KV bytes of the tokens held |")
        print("|---|---|---|---|---|---|---|")
        base = median([r[0] for r in results["dynamic"]])
        for name in names:
            per = [r[0] for r in results[name]]
            held = max(r[2] for r in results[name])
            print(f"| {context} | {LABEL[name]} | {', '.join(f'{x:.2f}' for x in per)} | {median(per):.2f} | "
                  f"{median(per) / base:.3f}x | {held:,} | {held / tokens:.4f}x of {tokens:,} |", flush=True)
        same = all(bool((r[3] == results["dynamic"][0][3]).all()) for n in names for r in results[n])
        print(f"same tokens in every cache and round: {same}")


if __name__ == "__main__":
    main()
