"""StrataCache against transformers' DynamicCache and StaticCache, side by side in one process:
decode time per token and peak KV bytes at a short and a long context.

    python -m strata.examples.bench_cache                 # BENCHMARKS.md's table (contexts 256, 2048)
    python -m strata.examples.bench_cache --quick         # a smoke run
    python -m strata.examples.bench_cache --compile       # decode steps compiled (static caches)
    python -m strata.examples.bench_cache --device cuda --compile   # on a GPU (CUDA backend)
    python -m strata.examples.bench_cache --layouts       # StrataCache's two layouts side by side
    python -m strata.examples.bench_cache --offload       # OffloadedStrataCache at half the KV too

StrataCache runs twice: with transformers' "sdpa" attention, as the other caches, and with
"strata_sdpa" (decode steps read adjacent heads' rows together; `strata._row_attention`).
Model: a random-initialised Llama (4 layers, hidden 256, 8 heads over 4 KV heads, float32;
`--layers`, `--hidden`, `--heads`, `--kv-heads`, `--dtype` change it), batch 4, 64-token
prompts, greedy. Decode time per token is (generate(N) - generate(1)) / (N - 1)
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

`--offload` adds `OffloadedStrataCache` with a device budget of half the KV pages the context
ends with (whole pages, every layer and row), eagerly: layers streamed from pinned host memory
through two device slots, copies on a side stream (`swap="stream"`, the default); `--offload pie`
runs Pie's swapping instead (layers spilled to strata's host tier and made resident at their
addresses), `--offload both` both. Its "peak KV bytes" are the device's.
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
    "offload_stream": "OffloadedStrataCache, half the KV on the device (stream)",
    "offload_pie": "OffloadedStrataCache, half the KV on the device (pie)",
}


def compile_config():
    """generate()'s settings to compile the decode step of a compileable cache on any device."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config


def half_kv(model, rows, tokens):
    """Half the KV pages (whole pages of every layer's and row's K and V) of `tokens` tokens: the
    device budget of the offload rows."""
    from strata import kv

    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    dtype = str(model.dtype)
    with kv.KvSpace(
        layers=1, kv_heads=c.num_key_value_heads, head_dim=head_dim, dtype=dtype, max_requests=1, max_tokens=8
    ) as s:
        per_page, page = s.stats()["tokens_per_block"], s.stats()["page_size"]
    return c.num_hidden_layers * rows * -(-tokens // per_page) * page


def run(model, ids, name, new_tokens, max_len, compiled=False, budget=None):
    """(seconds, peak KV bytes, output ids) of one generation with the `name` cache. Every cache
    runs with transformers' "sdpa" attention except "strata_rows": StrataCache with
    "strata_sdpa" (`strata._row_attention`). `budget`: the offload rows' device budget."""
    from transformers import DynamicCache, StaticCache

    from strata.transformers import ATTENTION, OffloadedStrataCache, StrataCache

    model.set_attn_implementation(ATTENTION if name.startswith("strata_rows") else "sdpa")
    if name == "dynamic":
        cache = DynamicCache()
    elif name == "static":
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    elif name.startswith("offload"):
        swap = name.split("_")[1]
        cache = OffloadedStrataCache(model.config, max_cache_len=max_len, device_budget=budget, swap=swap)
    else:
        layout = "request" if name.endswith(REQUEST) else "auto"
        cache = StrataCache(model.config, max_cache_len=max_len, compileable=compiled, layout=layout)
    compiles = compiled and name in ("static", "strata", "strata" + REQUEST)
    kw = {"compile_config": compile_config()} if compiles else {"disable_compile": True}
    elapsed, out = timed_generate(model, ids, cache, new_tokens, **kw)
    if name.startswith(("strata", "offload")):
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
    p.add_argument("--offload", nargs="?", const="stream", choices=("stream", "pie", "both"),
                   help="add OffloadedStrataCache at half the KV (stream: layer streaming, the default; pie; both)")
    p.add_argument("--names", nargs="*", choices=NAMES[1:], help="the caches besides DynamicCache (default: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--layouts", action="store_true", help='each StrataCache also with layout="request"')
    args = p.parse_args(argv)
    if args.quick:
        args.short, args.long, args.rounds = 32, 128, 1
    import torch

    model, ids = model_and_prompts(
        args.batch, args.prompt, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        device=args.device,
    )
    model.to(getattr(torch, args.dtype))
    names = NAMES[:3] if args.compile else NAMES  # "strata_sdpa" is an eager CPU path
    if args.names is not None:
        names = ("dynamic",) + tuple(n for n in names if n in args.names)
    if args.layouts:
        names = tuple(n for name in names for n in ((name, name + REQUEST) if name.startswith("strata") else (name,)))
    if args.offload:
        names += tuple(f"offload_{m}" for m in ("stream", "pie") if args.offload in (m, "both"))
    c = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * elem
    compiled = "compiled decode steps (StaticCache, StrataCache)" if args.compile else "eager"
    print(f"batch {args.batch}, prompt {args.prompt}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"over {args.kv_heads} KV heads, {args.dtype}, {args.device}, {compiled}; StaticCache and StrataCache "
          f"reserve {args.static_len} tokens; {setting()}")
    for name in names:
        budget = half_kv(model, args.batch, args.prompt + 2) if name.startswith("offload") else None
        run(model, ids, name, 2, args.static_len, args.compile, budget)  # warm-up (and compilation)
    contexts = {"short": args.short, "long": args.long}
    for which, new in contexts.items():
        if args.only and which != args.only:
            continue
        context = args.prompt + new
        budget = half_kv(model, args.batch, context - 1)

        def one(name, new=new, budget=budget):
            first, _, _ = run(model, ids, name, 1, args.static_len, args.compile, budget)
            total, held, out = run(model, ids, name, new, args.static_len, args.compile, budget)
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
