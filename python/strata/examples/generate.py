"""A random-initialised small Llama (built from a config; nothing downloaded) generating with
`strata.transformers.StrataCache`, with a progress bar, then tokens/s, the KV bytes held, the
pages mapped and the tier traffic.

    python -m strata.examples.generate --batch 4 --prompt 64 --new-tokens 512
    python -m strata.examples.generate --device-budget 4MiB   # offload (layers streamed from host)
    python -m strata.examples.generate --device-budget 4MiB --swap pie   # Pie's swapping
    python -m strata.examples.generate --device-budget 4MiB --host-bytes 2MiB --disk-bytes 64MiB
                                        # host memory too small: the rest on disk (TierKV's lookahead)

On a machine without a GPU strata runs its host backend; torch reads the KV tensors there only
outside strict mode (STRATA_HOST_STRICT unset or 0). STRATA_HOST_GRANULARITY sets its page size.
"""

import argparse
import os
import tempfile

from ._generation import generate_with_progress, human


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
    p.add_argument("--swap", choices=("stream", "pie"), default=None,
                   help="offload: how layers move (default: stream, or pie with --expand or a disk tier)")
    p.add_argument("--expand", action="store_true", help="offload: Pie's adaptive expansion above the budget's floor")
    p.add_argument("--host-bytes", type=size, default=None, help="offload: the host tier (default: all of the KV)")
    p.add_argument("--disk-bytes", type=size, default=0, help="offload: a disk tier for what host memory cannot hold")
    p.add_argument("--disk-dir", default=None, help="offload: the disk tier's directory (default: a temporary one)")
    p.add_argument(
        "--no-lookahead", action="store_true", help="offload: no disk hop ahead of need (TierKV's lookahead off)"
    )
    p.add_argument(
        "--mirage",
        action="store_true",
        help="two models: an idle one's layer pages become the KV pages this one runs out of "
        "(strata.examples.mirage_demo; 64 KiB host pages unless STRATA_HOST_GRANULARITY is set)",
    )
    p.add_argument(
        "--idle-layer-ms",
        type=float,
        default=50.0,
        help="--mirage: the idle model's compute per layer the remapping budget uses "
        "(default 50, a large model's; 0: the time measured here)",
    )
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


def main(argv=None):
    args = parse_args(argv)
    if args.mirage:
        # Before the library loads: pages small enough that the demo's KV spans several.
        os.environ.setdefault("STRATA_HOST_GRANULARITY", "64KiB")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from strata.transformers import ATTENTION, OffloadedStrataCache, StrataCache

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
    model.set_attn_implementation(ATTENTION)  # "sdpa", but CPU decode reads strata's KV rows whole

    # Rows of different lengths, left-padded: row i has prompt - 8*i tokens (at least 1).
    ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(args.batch):
        n = max(1, args.prompt - 8 * row)
        ids[row, -n:] = torch.randint(3, args.vocab, (n,))
        mask[row, -n:] = 1
    ids, mask = ids.to(device), mask.to(device)

    if args.mirage:
        from . import mirage_demo

        return mirage_demo.run(args, model, ids, mask, device)

    max_len = args.max_cache_len or args.prompt + args.new_tokens
    with tempfile.TemporaryDirectory(prefix="strata-generate-") as scratch:
        if args.device_budget is None:
            cache = StrataCache(model.config, max_cache_len=max_len)
        else:
            disk = dict(disk_bytes=args.disk_bytes, disk_dir=args.disk_dir or scratch) if args.disk_bytes else {}
            cache = OffloadedStrataCache(
                model.config,
                max_cache_len=max_len,
                device_budget=args.device_budget,
                host_bytes=args.host_bytes,
                expand=args.expand,
                lookahead=not args.no_lookahead,
                swap=args.swap,
                **disk,
            )
        try:
            report(args, model, ids, mask, cache, max_len, device)
        finally:
            cache.close()


def report(args, model, ids, mask, cache, max_len, device):
    """Generates with `cache` and prints what it cost."""
    peak = {"kv_bytes": 0}
    cpu_layers = [0]

    def watch():
        s = cache.stats()
        peak["kv_bytes"] = max(peak["kv_bytes"], s["kv_bytes"])
        if s.get("offload"):
            cpu_layers.append(s["offload"]["floor" if cache.swap == "stream" else "cpu_layers"])

    out, elapsed = generate_with_progress(model, ids, mask, cache, args.new_tokens, "generate", watch)

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
          f"disk {human(s['disk_used_bytes'])} ({human(s['disk_read_bytes'])} read, "
          f"{human(s['disk_write_bytes'])} written)")
    off = s.get("offload")
    if off and cache.swap == "stream":
        print(f"offload    budget {human(off['device_budget'])}: {off['layers_on_device']} of {args.layers} layers "
              f"on the device, {off['floor']} streamed through {off['slots']} slots from "
              f"{human(off['host_buffer_bytes'])} of host buffers; {off['swap_ins']} fetches "
              f"({off['prefetch_hits']} queued ahead, {off['stalls']} at their own layer), {off['swap_outs']} "
              f"write-backs, {off['demotions']} layers moved off the device")
    elif off:
        print(f"offload    budget {human(off['device_budget'])}: {off['layers_on_device']} of {args.layers} layers "
              f"on the device now ({off['cpu_layers']} aimed at the CPU, floor {off['floor']}, at most "
              f"{max(cpu_layers)} during the run); {off['swap_ins']} swap-ins ({off['two_hop_swap_ins']} from disk), "
              f"{off['swap_outs']} swap-outs; {off['prefetch_hits']} prefetch hits, {off['stalls']} stalls "
              f"({off['stall_seconds']:.2f} s waited); {s['clean_spills']} pages swapped out without a copy")
        print(f"lookahead  Eq. 1 predicted {off['swap_ins_early']} swap-ins hidden ({off['swap_ins_early_hidden']} "
              f"were); {off['stages']} disk hops ahead of need ({off['stages_hidden']} layers then came back from "
              f"host memory alone); last lookahead asked: {off['lookahead_host_layers']} layers from host memory, "
              f"{off['lookahead_disk_layers']} from disk (-1: none hides it, or not measured)")

if __name__ == "__main__":
    main()
