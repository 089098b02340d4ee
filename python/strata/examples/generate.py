"""A random-initialised small Llama (built from a config; nothing downloaded) generating with
`strata.transformers.StrataCache`, with a progress bar, then tokens/s, the KV bytes held, the
pages mapped and the tier traffic.

    python -m strata.examples.generate --batch 4 --prompt 64 --new-tokens 512
    python -m strata.examples.generate --device-budget 4MiB   # tiered offload (Pie's swapping)

On a machine without a GPU strata runs its host backend; torch reads the KV tensors there only
outside strict mode (STRATA_HOST_STRICT unset or 0). STRATA_HOST_GRANULARITY sets its page size.
"""

import argparse
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the longest row")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-cache-len", type=int, default=None, help="default: prompt + new tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device-budget",
        type=size,
        default=None,
        help="offload: device bytes for the KV (e.g. 4MiB); layers beyond it swap to host memory",
    )
    p.add_argument("--expand", action="store_true", help="offload: Pie's adaptive expansion above the budget's floor")
    return p.parse_args(argv)


def size(text):
    """Bytes from `123`, `64KiB`, `4MiB`, `1GiB`."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1, "": 1}
    t = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            number = t[: len(t) - len(unit)] if unit else t
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"{text!r}: bytes, e.g. 4MiB")


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def main(argv=None):
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    from strata.transformers import OffloadedStrataCache, StrataCache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new_tokens + 1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()

    # Rows of different lengths, left-padded: row i has prompt - 8*i tokens (at least 1).
    ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(args.batch):
        n = max(1, args.prompt - 8 * row)
        ids[row, -n:] = torch.randint(3, args.vocab, (n,))
        mask[row, -n:] = 1
    ids, mask = ids.to(device), mask.to(device)

    max_len = args.max_cache_len or args.prompt + args.new_tokens
    if args.device_budget is None:
        cache = StrataCache(model.config, max_cache_len=max_len)
    else:
        cache = OffloadedStrataCache(model.config, max_cache_len=max_len, device_budget=args.device_budget, expand=args.expand)
    bar = tqdm(total=args.new_tokens, unit="tok", desc="generate")
    peak = {"kv_bytes": 0}

    class Progress(LogitsProcessor):
        def __call__(self, input_ids, scores):
            bar.update(1)
            peak["kv_bytes"] = max(peak["kv_bytes"], cache.stats()["kv_bytes"])
            return scores

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([Progress()]),
        )
    elapsed = time.perf_counter() - start
    bar.close()

    s = cache.stats()
    new = out.shape[1] - ids.shape[1]
    print(f"model      {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, {args.dtype}, {device}")
    print(f"generated  {args.batch} x {new} tokens in {elapsed:.2f} s: {args.batch * new / elapsed:.1f} tokens/s")
    print(f"tokens     {s['tokens']} held per row of {max_len} reserved")
    print(f"KV held    {human(s['token_bytes'])} of tokens in {human(s['kv_bytes'])} of pages (peak {human(peak['kv_bytes'])}); "
          f"a full reservation would be {human(s['token_bytes'] * max_len // max(s['tokens'], 1))}")
    print(f"pages      {s['pages']} mapped ({human(s['page_size'])} each, {s['tokens_per_block']} tokens per page)")
    print(f"tiers      {human(s['bytes_from_device'])} down, {human(s['bytes_to_device'])} up, "
          f"{s['spills']} blocks spilled, {s['restores']} restored, host {human(s['host_used_bytes'])}, "
          f"disk {human(s['disk_used_bytes'])}")
    off = s.get("offload")
    if off:
        print(f"offload    budget {human(off['device_budget'])}: {off['layers_on_device']} of {args.layers} layers on the device "
              f"now ({off['cpu_layers']} aimed at the CPU, floor {off['floor']}); {off['swap_ins']} swap-ins, "
              f"{off['swap_outs']} swap-outs; {off['prefetch_hits']} prefetch hits, {off['stalls']} stalls "
              f"({off['stall_seconds']:.2f} s waited); {s['clean_spills']} pages swapped out without a copy")
    cache.close()


if __name__ == "__main__":
    main()
