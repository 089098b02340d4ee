"""strata.mirage end to end with real transformers models on the CPU: two random-initialised
Llamas in one process with their decoder layers in strata parameter memory; the serving model's
StrataCache runs out of pages in a squeezed pool, the idle model's layer pages become KV pages
and generation goes on with DynamicCache's tokens; the idle model then runs from its remapped
layers (streamed back through the forward pre-hooks) and after reversion, with its tokens
unchanged. ffi/tests/python_transformers.rs runs this module in its own process outside strict
mode (64 KiB pages); in the strict run of the whole suite it skips."""

import unittest

import strata
from test_transformers import batch, generate, tiny, transformers

if transformers is not None:
    import torch
    from transformers import DynamicCache

    from strata import mirage
    from strata.transformers import StrataCache

PROMPTS = (500, 470, 490)  # the serving model crosses its 512-token page while it decodes
NEW_TOKENS = 48
IDLE_PROMPTS = (24, 9, 16)
IDLE_NEW_TOKENS = 32


def squeeze_pool(spare_pages):
    """Caps device 0's pool at the pages in use now plus `spare_pages` (and half a page, so the
    fraction's rounding cannot cost one)."""
    s = strata.stats(0)
    limit = s["pool_in_use_bytes"] + (spare_pages + 0.5) * s["page_size"]
    strata.set_memory_fraction(limit / s["total_bytes"], 0)


def lift_pool_limit():
    strata.set_memory_fraction(1.0, 0)


@unittest.skipUnless(transformers, "needs torch, transformers and CPU-accessible (non-strict) KV memory")
class MirageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # The serving model: small layers, KV of 2 layers x 2 KV heads x 16 dims (512 tokens a
        # page). The idle one: 4 layers of 16 pages each.
        cls.serving = tiny("Llama")
        cls.idle = tiny("Llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4)
        cls.serving_expected = generate(cls.serving, DynamicCache(), NEW_TOKENS, PROMPTS)
        cls.idle_expected = generate(cls.idle, DynamicCache(), IDLE_NEW_TOKENS, IDLE_PROMPTS)
        cls.serving_params = mirage.ModelParams(cls.serving)
        # The idle model states its compute time: the controller's budget (T_T * N <= T_compute)
        # then allows remapping whatever this machine's timings are; the budget has its own
        # tests in tiers/tests/mirage.rs.
        cls.idle_params = mirage.ModelParams(cls.idle, cap=3, compute_per_layer=0.05)

    def idle_tokens(self):
        with self.idle_params.serving():
            return generate(self.idle, DynamicCache(), IDLE_NEW_TOKENS, IDLE_PROMPTS)

    def test_idle_layers_become_kv_pages_and_stream_back_unchanged(self):
        # From strata memory, before any remapping: the same tokens as from torch's memory.
        idle, serving = self.idle_params, self.serving_params
        self.assertTrue(torch.equal(self.idle_tokens(), self.idle_expected))
        self.assertGreater(idle.stats()["measured_compute_per_layer"], 0)
        resident = [next(layer.parameters()).data_ptr() for layer in self.idle.model.layers]
        self.assertEqual(resident, [idle._model.layer_ptr(i) for i in range(idle.layers)])

        per_block = 2 * 2 * len(PROMPTS)  # pages of one 512-token block: layers x K/V x rows
        squeeze_pool(per_block + 1)
        try:
            with serving.serving():
                cache = StrataCache(
                    self.serving.config, max_cache_len=max(PROMPTS) + NEW_TOKENS, on_out_of_memory=mirage.reclaim
                )
                got = generate(self.serving, cache, NEW_TOKENS, PROMPTS)
            self.assertTrue(torch.equal(got, self.serving_expected), f"{(got != self.serving_expected).sum()} differ")
            self.assertEqual(cache.stats()["tokens"], max(PROMPTS) + NEW_TOKENS - 1)
            self.assertGreater(cache.stats()["pool_adopted_pages"], 0)
            cache.space.check()
            s = idle.stats()
            self.assertGreaterEqual(s["remapped_layers"], 1, s)
            self.assertGreaterEqual(s["streamed_layers"], s["remapped_layers"] + 1, s)
            self.assertEqual(serving.stats()["remapped_layers"], 0)

            # The idle model runs from its remapped layers: streamed through its slots.
            seen = set()
            hooks = [
                layer.register_forward_hook(lambda m, a, o: seen.add(next(m.parameters()).data_ptr()))
                for layer in self.idle.model.layers
            ]
            try:
                self.assertTrue(torch.equal(self.idle_tokens(), self.idle_expected))
            finally:
                for h in hooks:
                    h.remove()
            self.assertEqual(idle.stats()["remapped_layers"], s["remapped_layers"])
            slots = {resident[0] + idle._model.stats()["layer_bytes"] * (idle.layers + i) for i in range(s["slots"])}
            self.assertEqual(slots, seen - set(resident), "streamed layers ran from the slots")

            # The KV pages come back: the layers are resident again, the tokens the same.
            cache.close()
            mirage.revert()
            self.assertEqual(idle.stats()["remapped_layers"], 0)
            self.assertEqual([next(layer.parameters()).data_ptr() for layer in self.idle.model.layers], resident)
            self.assertTrue(torch.equal(self.idle_tokens(), self.idle_expected))
        finally:
            lift_pool_limit()

    def test_bad_use_is_a_typed_error(self):
        with self.assertRaisesRegex(strata.InvalidState, "already"):
            mirage.ModelParams(self.idle)
        with self.assertRaisesRegex(strata.InvalidArgument, "layers"):
            mirage.ModelParams(torch.nn.Linear(4, 4))
        asked = []

        def reclaim(pages_short, device):
            asked.append(pages_short)
            return False

        ids, mask = batch((8, 5, 3))
        with StrataCache(self.serving.config, max_cache_len=10, on_out_of_memory=reclaim) as cache:
            with self.assertRaisesRegex(strata.InvalidArgument, "max_cache_len"):
                generate(self.serving, cache, 6, (8, 5, 3))
        self.assertEqual(asked, [])
        cache = StrataCache(self.serving.config, max_cache_len=64, on_out_of_memory=reclaim)
        cache.close()
        with self.assertRaisesRegex(strata.InvalidState, "closed"):
            generate(self.serving, cache, 2, (8, 5, 3))

        # Out of pages with nothing to reclaim: OutOfMemory, and the cache keeps its tokens.
        with StrataCache(self.serving.config, max_cache_len=1024, on_out_of_memory=reclaim) as cache:
            with torch.no_grad():
                self.serving(input_ids=ids, attention_mask=mask, past_key_values=cache)
            held = cache.stats()["kv_bytes"]
            squeeze_pool(0)
            try:
                with self.assertRaises(strata.OutOfMemory):
                    with torch.no_grad():
                        self.serving(input_ids=torch.ones(3, 600, dtype=torch.long), past_key_values=cache)
            finally:
                lift_pool_limit()
            self.assertEqual(len(asked), 1)
            self.assertGreater(asked[0], 0)
            self.assertEqual(cache.get_seq_length(), ids.shape[1])
            self.assertEqual(cache.stats()["kv_bytes"], held)


if __name__ == "__main__":
    unittest.main()
