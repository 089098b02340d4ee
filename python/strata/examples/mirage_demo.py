"""`python -m strata.examples.generate --mirage`: MIRAGE with two models in one process.

Both models' decoder layers live in strata parameter memory (`strata.mirage.ModelParams`). The
idle model (twice the serving model's layers) runs first: its greedy tokens are the reference.
Then strata's pool is capped at what the parameters hold plus the KV of the serving model's
first page of tokens, so the serving model's `StrataCache` runs out while it decodes and the
remapping controller gives it the idle model's layer pages (`strata.mirage.reclaim`). The idle
model then runs from its remapped layers, streamed back through the forward hooks: with the
look-ahead (the next streamed layer loads while the layers before it compute) and without. Last,
the KV cache closes and the cap is lifted: when the idle model serves again its layers come back
(dynamic reversion). Its tokens must stay the same throughout; the counters say what moved.
"""

import time

import strata

from ._generation import generate_with_progress, human

IDLE_TOKENS = 32


def run(args, model, ids, mask, device):
    import torch
    from transformers import LlamaForCausalLM

    from strata import mirage
    from strata.transformers import StrataCache

    torch.manual_seed(args.seed + 1)
    config = model.config.to_dict()
    config["num_hidden_layers"] = 2 * args.layers
    idle = LlamaForCausalLM(type(model.config)(**config)).to(device=device, dtype=model.dtype).eval()

    def idle_run(look_ahead=True):
        """The idle model serving IDLE_TOKENS tokens: its tokens, seconds and counters moved."""
        idle_params.look_ahead = look_ahead
        before = idle_params.stats()
        start = time.perf_counter()
        with idle_params.serving(), torch.no_grad():
            out = idle.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=IDLE_TOKENS,
                min_new_tokens=IDLE_TOKENS,
                do_sample=False,
            )
        seconds = time.perf_counter() - start
        after = idle_params.stats()
        counters = ("streamed_runs", "slot_loads", "loads_ahead", "found_prepared", "load_waits")
        moved = {k: after[k] - before[k] for k in counters}
        return out, seconds, after, moved

    serving_params = mirage.ModelParams(model, cap=0)  # the serving model is never remapped
    per_layer = args.idle_layer_ms / 1e3 if args.idle_layer_ms > 0 else None
    idle_params = mirage.ModelParams(idle, compute_per_layer=per_layer)
    expected, resident_seconds, _, _ = idle_run()

    max_len = args.max_cache_len or args.prompt + args.new_tokens
    cache = StrataCache(model.config, max_cache_len=max_len, on_out_of_memory=mirage.reclaim)
    with torch.no_grad():  # one token: the space exists and knows its page size
        model(input_ids=ids[:, :1], attention_mask=mask[:, :1], past_key_values=cache)
    first_page = cache.stats()["pages"]
    cache.reset()
    s = strata.stats(0)
    limit = s["pool_in_use_bytes"] + (first_page + 0.5) * s["page_size"]
    strata.set_memory_fraction(min(1.0, limit / s["total_bytes"]), 0)
    reclaims = []  # (token, layers remapped) whenever the idle model gave more layers

    def watch():
        remapped = idle_params.stats()["remapped_layers"]
        if remapped > (reclaims[-1][1] if reclaims else 0):
            reclaims.append((watch.token, remapped))
        watch.token += 1

    watch.token = 1
    try:
        with serving_params.serving():
            out, elapsed = generate_with_progress(
                model, ids, mask, cache, args.new_tokens, "generate (serving model)", watch
            )
    except strata.OutOfMemory as e:
        strata.set_memory_fraction(1.0, 0)
        raise SystemExit(
            f"out of KV pages and nothing to reclaim ({e.message}); the idle model's measured "
            f"compute ({idle_params.stats()['measured_compute_per_layer']} s a layer) may not cover "
            "reloading its layers: try --idle-layer-ms"
        ) from None
    remapped = idle_params.stats()
    kv = cache.stats()
    new = out.shape[1] - ids.shape[1]
    print(f"generated  {args.batch} x {new} tokens in {elapsed:.2f} s: {args.batch * new / elapsed:.1f} tokens/s")
    print(f"pool       capped at {human(limit)}; KV {human(kv['kv_bytes'])} in {kv['pages']} pages, "
          f"{kv['pool_adopted_pages']} of them the idle model's parameter pages")
    print("reclaim    " + ", ".join(f"token {t}: {n} layer{'s' * (n != 1)} remapped" for t, n in reclaims)
          + f" (the KV cache ran out; {human(remapped['layer_bytes'])} a layer, T_T "
          f"{remapped['transfer_ns'] / 1e6:.2f} ms)")
    print(f"idle model {remapped['remapped_layers']} of {remapped['layers']} layers remapped, "
          f"{remapped['streamed_layers']} streamed through {remapped['slots']} slot(s)")

    runs = {}
    for look_ahead in (True, False):
        got, seconds, _, moved = idle_run(look_ahead)
        runs[look_ahead] = (torch.equal(got, expected), seconds, moved)
        print(f"streamed   look-ahead {'on ' if look_ahead else 'off'}: {IDLE_TOKENS} tokens in {seconds:.2f} s, "
              f"tokens {'unchanged' if runs[look_ahead][0] else 'CHANGED'}; {moved['streamed_runs']} streamed layer "
              f"runs, {moved['slot_loads']} loads ({human(moved['slot_loads'] * remapped['layer_bytes'])}), "
              f"{moved['loads_ahead']} ahead; {moved['found_prepared']} found their layer loaded, "
              f"{moved['load_waits']} waited on a load")

    cache.close()
    strata.set_memory_fraction(1.0, 0)
    back, back_seconds, after, _ = idle_run()
    same = torch.equal(back, expected)
    print(f"reverted   pressure fell: {after['remapped_layers']} layers remapped when the idle model "
          f"served again (dynamic reversion), tokens {'unchanged' if same else 'CHANGED'}")
    print(f"idle model {IDLE_TOKENS} tokens, seconds: {resident_seconds:.2f} resident, {runs[True][1]:.2f} streamed "
          f"with look-ahead, {runs[False][1]:.2f} without, {back_seconds:.2f} reverted "
          "(STRATA_HOST_LINK models a link; without it a load is a memcpy)")
    if not (same and runs[True][0] and runs[False][0]):
        raise SystemExit("the idle model's tokens changed")
    if after["remapped_layers"]:
        raise SystemExit("the idle model's layers did not come back")
