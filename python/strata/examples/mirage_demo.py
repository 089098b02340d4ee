"""`python -m strata.examples.generate --mirage`: MIRAGE with two models in one process.

Both models' decoder layers live in strata parameter memory (`strata.mirage.ModelParams`). The
idle model runs first (its greedy tokens are the reference, and its layers' compute time is
measured), then strata's pool is capped at what the parameters hold plus the KV of the serving
model's first page of tokens, so the serving model's `StrataCache` runs out while it decodes:
the idle model (twice the serving model's layers) gives layer pages to the KV cache
(`strata.mirage.reclaim`). The idle model then runs
from its remapped layers (streamed back through the forward pre-hooks) and again after the KV
pages came back; its tokens must stay the same.
"""

import time

import strata

from .generate import generate_with_progress, human


def run(args, model, ids, mask, device):
    import torch
    from transformers import LlamaForCausalLM

    from strata import mirage
    from strata.transformers import StrataCache

    torch.manual_seed(args.seed + 1)
    config = model.config.to_dict()
    config["num_hidden_layers"] = 2 * args.layers
    idle = LlamaForCausalLM(type(model.config)(**config)).to(device=device, dtype=model.dtype).eval()

    idle_seconds = []

    def idle_tokens():
        start, cpu = time.perf_counter(), time.process_time()
        with idle_params.serving(), torch.no_grad():
            out = idle.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False
            )
        idle_seconds.append((time.perf_counter() - start, time.process_time() - cpu))
        return out

    serving_params = mirage.ModelParams(model)
    per_layer = args.idle_layer_ms / 1e3 if args.idle_layer_ms > 0 else None
    idle_params = mirage.ModelParams(idle, compute_per_layer=per_layer)
    expected = idle_tokens()

    max_len = args.max_cache_len or args.prompt + args.new_tokens
    cache = StrataCache(model.config, max_cache_len=max_len, on_out_of_memory=mirage.reclaim)
    with torch.no_grad():  # one token: the space exists and knows its page size
        model(input_ids=ids[:, :1], attention_mask=mask[:, :1], past_key_values=cache)
    first_page = cache.stats()["pages"]
    cache.reset()
    s = strata.stats(0)
    limit = s["pool_in_use_bytes"] + (first_page + 0.5) * s["page_size"]
    strata.set_memory_fraction(min(1.0, limit / s["total_bytes"]), 0)
    try:
        with serving_params.serving():
            out, elapsed = generate_with_progress(
                model, ids, mask, cache, args.new_tokens, "generate (serving model)"
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
          f"{kv['pool_adopted_pages']} pages adopted from parameters")
    print(f"idle model {remapped['remapped_layers']} of {remapped['layers']} layers remapped "
          f"({human(remapped['layer_bytes'])} each), {remapped['streamed_layers']} streamed through "
          f"{remapped['slots']} slots")
    same = torch.equal(idle_tokens(), expected)
    print(f"idle model runs from streamed layers: tokens {'unchanged' if same else 'CHANGED'}")
    cache.close()
    strata.set_memory_fraction(1.0, 0)
    mirage.revert()
    back = torch.equal(idle_tokens(), expected)
    print(f"reverted   {idle_params.stats()['remapped_layers']} layers remapped, "
          f"tokens {'unchanged' if back else 'CHANGED'}")
    (resident, resident_cpu), (streamed, streamed_cpu), (reverted, reverted_cpu) = idle_seconds
    print(f"idle model 32 tokens, wall (process CPU) seconds: {resident:.2f} ({resident_cpu:.2f}) "
          f"resident, {streamed:.2f} ({streamed_cpu:.2f}) with {remapped['streamed_layers']} layers "
          f"streamed, {reverted:.2f} ({reverted_cpu:.2f}) reverted")
    if not (same and back):
        raise SystemExit("the idle model's tokens changed")
