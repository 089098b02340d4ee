"""One decode step's attention per layer, in microseconds: transformers' "sdpa" over contiguous K/V
(DynamicCache's layout), "sdpa" over token-major views (StrataCache's "request" layout: a token's
heads of one row and layer, `[batch, tokens, heads, dim]` memory) and "strata_sdpa" over the same
views, and both over StrataCache's "token" layout (`[tokens, layers, batch, heads, dim]` memory: the
token stride spans every layer and row), at several contexts. Where
`strata._row_attention.FOLD_FROM_BYTES` comes from.

    python -m strata.examples.bench_attention [--contexts 64,256,512,1024,2048] [--rounds 40]

Plain torch tensors (no strata memory), shaped as `bench_cache`'s model (batch 4, 8 query heads over
4 KV heads of 32, float32) unless told otherwise. Each round runs every variant over `--layers`
layers' K/V in turn with a matrix product over `--weights` bytes before each attention, as a
model's other layers would, so K/V come from memory as in a generation rather than from the
CPU's caches. The table gives the medians over the rounds; "strata_sdpa" below FOLD_FROM_BYTES
is "sdpa" itself, so the fold is also timed forced on (FOLD_FROM_BYTES = 0).
"""

import argparse
import time

from ._bench import median, setting


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.bench_attention")
    p.add_argument("--contexts", default="64,256,512,1024,2048")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--weights", type=int, default=16 << 20, help="bytes of the product between attentions")
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from strata import _row_attention as rows

    class Attention:  # what transformers' attention functions read of the module
        num_key_value_groups = args.heads // args.kv_heads
        is_causal = True

    dtype = getattr(torch, args.dtype)
    module = Attention()
    side = int((args.weights // 4) ** 0.5)
    weights, x = torch.randn(side, side), torch.randn(8, side)
    b, h, d = args.batch, args.kv_heads, args.head_dim
    scale = d**-0.5

    def strata_sdpa_forced(*a, **kw):
        saved, rows.FOLD_FROM_BYTES = rows.FOLD_FROM_BYTES, 0
        try:
            return rows.row_attention_forward(*a, **kw)
        finally:
            rows.FOLD_FROM_BYTES = saved

    variants = {
        "sdpa, contiguous": (sdpa_attention_forward, "contiguous"),
        "sdpa, token-major": (sdpa_attention_forward, "request"),
        "strata_sdpa, token-major": (rows.row_attention_forward, "request"),
        "strata_sdpa forced, token-major": (strata_sdpa_forced, "request"),
        'sdpa, "token" layout': (sdpa_attention_forward, "token"),
        'strata_sdpa, "token" layout': (rows.row_attention_forward, "token"),
    }
    print(f"batch {b}, {args.heads} query heads over {h} KV heads of {d}, {args.dtype}; {args.layers} layers; "
          f"{args.weights >> 20} MiB product between attentions; FOLD_FROM_BYTES {rows.FOLD_FROM_BYTES}; "
          f"{args.rounds} rounds; {setting()}")
    print("| context | bytes of one request's keys | " + " | ".join(f"{v} µs" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for n in (int(c) for c in args.contexts.split(",")):
        # Token-major memory reserved past the context, as StrataCache's rows are.
        mem = [[torch.randn(b, n + 64, h, d, dtype=dtype) for _ in "kv"] for _ in range(args.layers)]
        token_major = [[t[:, :n].transpose(1, 2) for t in kv] for kv in mem]
        contiguous = [[t.contiguous() for t in kv] for kv in token_major]
        # The "token" layout: one tensor per K/V, a token's row holds every layer and batch row.
        shared = [torch.randn(n + 64, args.layers, b, h, d, dtype=dtype) for _ in "kv"]
        token_layout = [[t[:n, layer].permute(1, 2, 0, 3) for t in shared] for layer in range(args.layers)]
        memory = {"contiguous": contiguous, "request": token_major, "token": token_layout}
        q = torch.randn(b, args.heads, 1, d, dtype=dtype)
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, (forward, layout) in variants.items():
                total = 0.0
                for k, v in memory[layout]:
                    x @ weights
                    start = time.perf_counter()
                    forward(module, q, k, v, None, scaling=scale)
                    total += time.perf_counter() - start
                times[name].append(total / args.layers * 1e6)
        cells = " | ".join(f"{median(times[v]):.0f}" for v in variants)
        print(f"| {n} | {n * h * d * q.element_size():,} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
