"""strata.mirage end to end with real transformers models on the CPU: two random-initialised
models in one process with their decoder layers in strata parameter memory. In a squeezed pool
the serving model's StrataCache runs out of pages while it decodes, the idle model's layer pages
become KV pages and generation goes on with DynamicCache's tokens; the idle model then runs from
its remapped layers (streamed back through the forward hooks, each loaded ahead while the layer
before it computes) and after `revert()`, with DynamicCache's tokens. Batch 3 with different
prompt lengths (left padding), 512 new tokens, a Llama and a Qwen2 (grouped-query attention) in
both roles, with one slot (Eq. 4) and with two (Eq. 5). Then dynamic reversion: once the KV
pages are gone, even back to the driver, the layers come back when the idle model serves.
ffi/tests/python_transformers.rs runs this module in its own process outside strict mode
(64 KiB pages, one torch thread); in the strict run of the whole suite it skips. On a GPU the
models run on `cuda`, sized by test_transformers.tiny for its 2 MiB pages."""

import unittest

import strata
from kv_device import NO_DEVICE
from test_transformers import DEVICE, NEW_TOKENS, PROMPTS, batch, generate, tiny, transformers

if transformers is not None:
    import torch
    from transformers import DynamicCache

    from strata import mirage
    from strata.transformers import StrataCache

# The serving model's KV: 2 layers x 2 KV heads x 16 dims of float32, 512 tokens a 64 KiB page;
# a block of 512 tokens is 2 layers x K/V x 3 rows = 12 pages. PROMPTS + NEW_TOKENS cross it.
PAGES_PER_BLOCK = 2 * 2 * len(PROMPTS)
# The idle model: 4 layers of 16 pages (hidden 128).
IDLE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
# The idle model's first run, before anything is remapped (a prefix of its full run).
FIRST_TOKENS = 16
# Rows that cross the 512-token page within a few tokens (the reversion test's short run).
LONG_PROMPTS = (500, 470, 490)


def squeeze_pool(spare_pages):
    """Caps device 0's pool at the pages in use now plus `spare_pages` (and half a page, so the
    fraction's rounding cannot cost one). The cap counts the pool's free pages too: they go back
    to the driver first (its worker trims them later, on a busy machine too late)."""
    strata.empty_cache()
    s = strata.stats(0)
    limit = s["pool_in_use_bytes"] + (spare_pages + 0.5) * s["page_size"]
    strata.set_memory_fraction(limit / s["total_bytes"], 0)


def lift_pool_limit():
    strata.set_memory_fraction(1.0, 0)


def addresses(model):
    return [next(layer.parameters()).data_ptr() for layer in model.model.layers]


@unittest.skipUnless(transformers, f"needs transformers; {NO_DEVICE}")
class MirageTest(unittest.TestCase):
    def setUp(self):
        self.addCleanup(lift_pool_limit)

    def two_models(self, serving_name, idle_name, new_tokens=NEW_TOKENS, prompts=PROMPTS):
        """The two models with DynamicCache's tokens, then in strata memory: the serving one never
        remapped (cap 0), the idle one up to 3 of its 4 layers at 50 ms of compute a layer (the
        budget T_T * N <= T_compute then allows that whatever this machine's timings; the budget
        has its own tests in tiers/tests/mirage.rs)."""
        serving, idle = tiny(serving_name), tiny(idle_name, **IDLE)
        expected = (generate(serving, DynamicCache(), new_tokens, prompts), generate(idle, DynamicCache(), new_tokens))
        params = (mirage.ModelParams(serving, cap=0), mirage.ModelParams(idle, cap=3, compute_per_layer=0.05))
        return (serving, idle), expected, params

    def idle_tokens(self, idle, idle_params, new_tokens=NEW_TOKENS):
        with idle_params.serving():
            return generate(idle, DynamicCache(), new_tokens)

    def serve_until_the_idle_model_gives_a_layer(self, serving, serving_params, expected, new_tokens, prompts):
        """The serving model decodes in a pool squeezed to its first block of pages plus one: at
        the 512th token its cache takes the idle model's layer pages and still gives
        DynamicCache's tokens. Returns the open cache."""
        squeeze_pool(PAGES_PER_BLOCK + 1)
        with serving_params.serving():
            cache = StrataCache(
                serving.config, max_cache_len=max(prompts) + new_tokens, on_out_of_memory=mirage.reclaim
            )
            got = generate(serving, cache, new_tokens, prompts)
        self.assertTrue(torch.equal(got, expected), f"{(got != expected).sum()} tokens differ")
        self.assertEqual(cache.stats()["tokens"], max(prompts) + new_tokens - 1)
        self.assertGreater(cache.stats()["pool_adopted_pages"], 0)
        cache.space.check()
        self.assertEqual(serving_params.stats()["remapped_layers"], 0)
        return cache

    def reclaim_stream_and_revert(self, serving_name, idle_name, slots):
        (serving, idle), (serving_expected, idle_expected), (serving_params, idle_params) = self.two_models(
            serving_name, idle_name
        )
        if slots == 2:
            # T_c between 3/4 and 1 of T_T: one remapped layer of 4 fails Eq. 4 (2 T_T <= 2 T_c)
            # and passes Eq. 5 (3 T_T <= 4 T_c), two pass neither: double buffering.
            idle_params.compute_per_layer = 0.9 * idle_params.stats()["transfer_ns"] / 1e9

        # From strata memory, before any remapping, at the layers' own addresses: the first of
        # DynamicCache's tokens (greedy, so a prefix of the full run).
        first = self.idle_tokens(idle, idle_params, FIRST_TOKENS)
        self.assertTrue(torch.equal(first, idle_expected[:, : first.shape[1]]))
        resident = addresses(idle)
        self.assertEqual(resident, [idle_params._model.layer_ptr(i) for i in range(idle_params.layers)])

        cache = self.serve_until_the_idle_model_gives_a_layer(
            serving, serving_params, serving_expected, NEW_TOKENS, PROMPTS
        )
        self.assertGreater(serving_params.stats()["measured_prefill"], 0)
        s = idle_params.stats()
        self.assertEqual((s["remapped_layers"], s["slots"], s["streamed_layers"]), (1, slots, 1 + slots), s)

        # The idle model runs from its remapped layers, streamed through its slots; the pool is
        # still squeezed, so becoming active brings nothing back. Each streamed layer but the
        # very first was loaded ahead, while the layers before it computed.
        seen = set()
        hooks = [
            layer.register_forward_hook(lambda m, a, o: seen.add(next(m.parameters()).data_ptr()))
            for layer in idle.model.layers
        ]
        try:
            got = self.idle_tokens(idle, idle_params)
        finally:
            for h in hooks:
                h.remove()
        self.assertTrue(torch.equal(got, idle_expected), f"{(got != idle_expected).sum()} tokens differ")
        after = idle_params.stats()
        self.assertEqual(after["remapped_layers"], 1)
        slot_addresses = {resident[0] + after["layer_bytes"] * (idle_params.layers + i) for i in range(slots)}
        self.assertEqual(slot_addresses, seen - set(resident), "streamed layers ran from the slots")
        runs = after["streamed_runs"] - s["streamed_runs"]
        self.assertEqual(runs, NEW_TOKENS * after["streamed_layers"])
        self.assertEqual(after["found_prepared"] - s["found_prepared"], runs - 1, after)
        self.assertGreaterEqual(after["loads_ahead"] - s["loads_ahead"], runs - 1, after)

        # The KV pages come back: the layers are resident again, the tokens the same.
        cache.close()
        mirage.revert()
        self.assertEqual(idle_params.stats()["remapped_layers"], 0)
        self.assertEqual(addresses(idle), resident)
        self.assertTrue(torch.equal(self.idle_tokens(idle, idle_params), idle_expected))

    def test_llama_serves_on_a_qwen2_models_layers_streamed_through_one_slot(self):
        self.reclaim_stream_and_revert("Llama", "Qwen2", slots=1)

    def test_qwen2_serves_on_a_llama_models_layers_streamed_through_two_slots(self):
        self.reclaim_stream_and_revert("Qwen2", "Llama", slots=2)

    def test_layers_come_back_when_pressure_falls_even_after_the_pool_let_its_pages_go(self):
        (serving, idle), (serving_expected, idle_expected), (serving_params, idle_params) = self.two_models(
            "Llama", "Llama", new_tokens=24, prompts=LONG_PROMPTS
        )
        self.assertTrue(torch.equal(self.idle_tokens(idle, idle_params, 24), idle_expected))
        resident = addresses(idle)
        cache = self.serve_until_the_idle_model_gives_a_layer(
            serving, serving_params, serving_expected, 24, LONG_PROMPTS
        )
        self.assertEqual(idle_params.stats()["remapped_layers"], 1)
        # The requests finish: their pages go back to the pool, which gives its free pages back
        # to the driver (as its worker does above its high watermark; empty_cache does it now).
        # Nothing is free in the pool, but the device has room again under the same cap.
        cache.close()
        strata.empty_cache()
        self.assertEqual(strata.stats(0)["pool_free_bytes"], 0)
        with idle_params.serving():  # a controller step without a shortage: dynamic reversion
            self.assertEqual(idle_params.stats()["remapped_layers"], 0)
            self.assertEqual(addresses(idle), resident)
            got = generate(idle, DynamicCache(), 24)
        self.assertTrue(torch.equal(got, idle_expected))

    def test_bad_use_is_a_typed_error(self):
        serving = tiny("Llama")
        params = mirage.ModelParams(serving, cap=0)
        for name in ("compute_per_layer", "prefill"):
            with self.assertRaisesRegex(strata.InvalidArgument, name):
                setattr(params, name, float("nan"))
            self.assertIsNone(getattr(params, name))
        with self.assertRaisesRegex(strata.InvalidState, "already"):
            mirage.ModelParams(serving)
        with self.assertRaisesRegex(strata.InvalidArgument, "layers"):
            mirage.ModelParams(torch.nn.Linear(4, 4))
        asked = []

        def reclaim(pages_short, device):
            asked.append(pages_short)
            return False

        ids, mask = batch((8, 5, 3))
        with StrataCache(serving.config, max_cache_len=10, on_out_of_memory=reclaim) as cache:
            with self.assertRaisesRegex(strata.InvalidArgument, "max_cache_len"):
                generate(serving, cache, 6, (8, 5, 3))
        self.assertEqual(asked, [])
        cache = StrataCache(serving.config, max_cache_len=64, on_out_of_memory=reclaim)
        cache.close()
        with self.assertRaisesRegex(strata.InvalidState, "closed"):
            generate(serving, cache, 2, (8, 5, 3))

        # Out of pages with nothing to reclaim: OutOfMemory, and the cache keeps its tokens.
        with StrataCache(serving.config, max_cache_len=1024, on_out_of_memory=reclaim) as cache:
            with torch.no_grad():
                serving(input_ids=ids, attention_mask=mask, past_key_values=cache)
            held = cache.stats()["kv_bytes"]
            squeeze_pool(0)
            with self.assertRaises(strata.OutOfMemory):
                with torch.no_grad():
                    serving(input_ids=torch.ones(3, 600, dtype=torch.long, device=DEVICE), past_key_values=cache)
            lift_pool_limit()
            self.assertEqual(len(asked), 1)
            self.assertGreater(asked[0], 0)
            self.assertEqual(cache.get_seq_length(), ids.shape[1])
            self.assertEqual(cache.stats()["kv_bytes"], held)


if __name__ == "__main__":
    unittest.main()
