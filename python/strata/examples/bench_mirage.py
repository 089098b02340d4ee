"""MIRAGE's streamed layers with and without the look-ahead, side by side in one process: the
idle model's decode time per token when `alpha` of its layers were reclaimed as KV pages and
`m = alpha + beta` of them stream back through `beta` slots.

    STRATA_HOST_LINK=1GB,10us python -m strata.examples.bench_mirage    # BENCHMARKS.md's table
    python -m strata.examples.bench_mirage --quick                       # a smoke run

Model: a random-initialised Llama (`--layers` 8, `--hidden` 128, 4 heads over 2 KV heads,
float32, one torch thread), batch 4, 32-token prompts, greedy. Its layers live in strata
parameter memory (`strata.mirage.ModelParams`); a controller step with a shortage of `--remap`
layers' pages takes them, a KV space (standing for another model's cache) maps every page left
under a pool cap, so the layers stay remapped, and the model then decodes from its slots. Rounds
alternate the look-ahead on (`prepare_next` in the layer hooks: the next streamed layer loads
while the layers before it compute) and off (each streamed layer loads when its pre-hook asks
for it); each round checks the tokens against the run before any remapping. Under
`STRATA_HOST_LINK` every load pays the modelled link on strata's copy thread while torch computes
on the main thread, so the overlap shows in wall time; without it a load is a memcpy.
"""

import argparse
import os
import time


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m strata.examples.bench_mirage", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--remap", type=int, default=3, help="layers whose pages become KV pages (alpha)")
    p.add_argument("--slots", type=int, default=1, choices=[1, 2], help="beta: 1 (Eq. 4) or 2 (Eq. 5)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 round of 8 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.new_tokens = 1, 8
    # Before the library loads: pages small enough that one layer spans several.
    os.environ.setdefault("STRATA_HOST_GRANULARITY", "64KiB")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import strata
    from strata import kv, mirage

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.prompt + args.new_tokens + 1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt))

    def decode():
        start = time.perf_counter()
        with params.serving(), torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
            )
        return out, (time.perf_counter() - start) / args.new_tokens

    params = mirage.ModelParams(model, cap=args.remap, compute_per_layer=0.05)
    t_t = params.stats()["transfer_ns"] / 1e9
    if args.slots == 2:
        # Eq. 4 fails and Eq. 5 holds for alpha of n layers: T_c between
        # T_T (alpha + 2) / n and T_T (alpha + 1) / (n - alpha - 1).
        low = t_t * (args.remap + 2) / args.layers
        high = t_t * (args.remap + 1) / (args.layers - args.remap - 1)
        params.compute_per_layer = (low + high) / 2
    expected, resident = decode()

    s = params.stats()
    mirage.reclaim(args.remap * s["pages_per_layer"])
    pool = strata.stats(0)
    strata.set_memory_fraction((pool["pool_in_use_bytes"] + pool["pool_free_bytes"]) / pool["total_bytes"], 0)
    space = kv.KvSpace(layers=1, kv_heads=1, head_dim=64, dtype="uint8", max_requests=1, max_tokens=1 << 24)
    holder = space.admit()
    per_block = space.stats()["tokens_per_block"]
    try:
        while True:
            holder.append(per_block)
    except strata.OutOfMemory:
        pass
    s = params.stats()
    print(
        f"model      {args.layers} layers of {s['layer_bytes'] / 2**20:.2f} MiB, hidden {args.hidden}, batch "
        f"{args.batch}, {args.prompt}-token prompts, {args.new_tokens} new tokens; "
        f"STRATA_HOST_LINK={os.environ.get('STRATA_HOST_LINK', '(none)')}"
    )
    print(
        f"remapped   {s['remapped_layers']} layers; {s['streamed_layers']} stream through {s['slots']} slots; "
        f"T_T measured {t_t * 1e3:.2f} ms; resident decode {resident * 1e3:.2f} ms/token"
    )
    if s["remapped_layers"] != args.remap or s["slots"] != args.slots:
        raise SystemExit(f"the plan is not the one asked for: {s}")

    rows = []
    for r in range(args.rounds):
        for look_ahead in (True, False):
            params.look_ahead = look_ahead
            before = params.stats()
            out, per_token = decode()
            after = params.stats()
            if not torch.equal(out, expected):
                raise SystemExit("the streamed model's tokens changed")
            if after["remapped_layers"] != args.remap:
                raise SystemExit(f"the layers came back during the run: {after}")
            delta = {k: after[k] - before[k] for k in ("streamed_runs", "found_prepared", "load_waits")}
            rows.append((r, look_ahead, per_token, delta))
            print(
                f"round {r}  look-ahead {'on ' if look_ahead else 'off'}  {per_token * 1e3:7.2f} ms/token  "
                f"runs {delta['streamed_runs']}, found prepared {delta['found_prepared']}, "
                f"waited on a load {delta['load_waits']}"
            )
    for r in range(args.rounds):
        on, off = (next(x[2] for x in rows if x[0] == r and x[1] == la) for la in (True, False))
        print(f"round {r}  off / on = {off / on:.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    holder.release()
    space.close()
    strata.set_memory_fraction(1.0, 0)
    mirage.revert()


if __name__ == "__main__":
    main()
