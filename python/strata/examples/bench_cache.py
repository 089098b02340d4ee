"""StrataCache against transformers' DynamicCache and StaticCache, side by side in one process:
decode time per token and peak KV bytes at a short and a long context.

    python -m strata.examples.bench_cache                 # BENCHMARKS.md's table
    python -m strata.examples.bench_cache --quick         # a smoke run

Model: a random-initialised Llama (4 layers, hidden 256, 8 heads over 4 KV heads, float32),
batch 4, 64-token prompts, greedy. Decode time per token is (generate(N) - generate(1)) / (N - 1)
per configuration, so the prefill is not counted; the fastest of `--rounds` interleaved rounds. Peak KV bytes: DynamicCache's tensors at the
end (its largest), StaticCache's reservation, StrataCache's mapped pages (largest seen).
"""

import argparse
import time


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 1024, (args.batch, args.prompt))
    return model, ids


def kv_bytes_of(name, cache):
    if name == "strata":
        return cache.stats()["kv_bytes"]
    return sum(l.keys.nbytes + l.values.nbytes for l in cache.layers if l.is_initialized)


def run(model, ids, name, new_tokens, max_len):
    import torch
    from transformers import DynamicCache, StaticCache

    from strata.transformers import StrataCache

    if name == "dynamic":
        cache = DynamicCache()
    elif name == "static":
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        cache = StrataCache(model.config, max_cache_len=max_len)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    elapsed = time.perf_counter() - start
    held = kv_bytes_of(name, cache)
    if name == "strata":
        cache.close()
    return elapsed, held, out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.bench_cache")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--short", type=int, default=192, help="new tokens of the short run")
    p.add_argument("--long", type=int, default=1984, help="new tokens of the long run (context 2048)")
    p.add_argument("--static-len", type=int, default=4096, help="StaticCache's max_cache_len")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the fastest counts")
    p.add_argument("--quick", action="store_true", help="short 32 and long 128 new tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.short, args.long = 32, 128
    model, ids = build(args)
    names = ("dynamic", "static", "strata")
    bpt = 2 * 4 * 4 * 32 * 4  # K+V, layers, KV heads, head dim, float32
    print(f"batch {args.batch}, prompt {args.prompt}, 4 layers, hidden 256, float32; StaticCache and "
          f"StrataCache reserve {args.static_len} tokens")
    print("| context | cache | total s | decode ms/token | peak KV bytes | KV bytes of the tokens held |")
    print("|---|---|---|---|---|---|")
    for name in names:
        run(model, ids, name, 2, args.static_len)  # warm-up
    for new in (args.short, args.long):
        context = args.prompt + new
        outs, best = {}, {}
        # Rounds interleave the caches, so load that comes and goes hits all of them; the fastest
        # round of each counts.
        for _ in range(args.rounds):
            for name in names:
                one, _, _ = run(model, ids, name, 1, args.static_len)
                total, held, outs[name] = run(model, ids, name, new, args.static_len)
                per = (total - one) / (new - 1) * 1e3
                if name not in best or per < best[name][1]:
                    best[name] = (total, per, held)
        for name in names:
            total, per, held = best[name]
            tokens = args.batch * (context - 1) * bpt
            print(f"| {context} | {name} | {total:.2f} | {per:.2f} | {held} | {tokens} |", flush=True)
        same = all(bool((outs[n] == outs["dynamic"]).all()) for n in names)
        print(f"| {context} | same tokens in all three: {same} | | | | |")


if __name__ == "__main__":
    main()
