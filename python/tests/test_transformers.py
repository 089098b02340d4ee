"""strata.transformers with real transformers model code on the CPU: greedy generation with
StrataCache gives exactly DynamicCache's tokens, the KV tensors never move, pages follow the
tokens held, and bad use raises typed errors. Models are random-initialised from small configs
(nothing downloaded). KV tensors must be CPU-readable, so ffi/tests/python_transformers.rs runs
this module outside strict mode (STRATA_HOST_STRICT=0) and checks that the tests ran; in the
strict run of the whole suite they skip. On a GPU the models and inputs are on `cuda` and the
models' head and MLP widths grow with the page size (kv_device.page_scale), so that sequences
cross pages as they do over the host runs' 64 KiB pages."""

import contextlib
import math
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import strata
from kv_device import NO_DEVICE, page_scale, torch_device
from strata import kv

NEW_TOKENS = 512
PROMPTS = (24, 9, 16)  # tokens of each row; shorter rows are left-padded
VOCAB = 96


# Where the models run: "cpu" or "cuda", as strata's KV memory; None where torch cannot use it.
DEVICE = torch_device()
# transformers is imported only where the tests can run (it takes seconds to import).
if DEVICE:
    try:
        import torch
        import transformers
        from transformers import DynamicCache, LogitsProcessorList
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from strata import _row_attention
    except ImportError:
        transformers = None
else:
    transformers = None


def tiny(name, **extra):
    """A random-initialised small model (2 layers, GQA: 4 query heads over 2 KV heads)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(extra)
    if page_scale() > 1:  # larger pages: as many tokens a page and pages a layer as at 64 KiB
        common["head_dim"] = common.get("head_dim", common["hidden_size"] // common["num_attention_heads"]) * page_scale()
        common["intermediate_size"] *= page_scale()
    config = getattr(transformers, f"{name}Config")(**common)
    torch.manual_seed(1234)
    model = getattr(transformers, f"{name}ForCausalLM")(config).to(DEVICE).eval()
    return model


def batch(prompts=PROMPTS):
    torch.manual_seed(7)
    width = max(prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(prompts):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,))
        mask[row, width - n :] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


class Watch:
    """A logits processor, so it runs once per decoding step: records the cache's tensor
    addresses and what it maps."""

    def __init__(self, cache):
        self.cache = cache
        self.addresses = set()
        self.views_at_base = True
        self.steps = 0
        self.kv_bytes = []
        self.cpu_layers = []

    def __call__(self, input_ids, scores):
        self.steps += 1
        self.addresses.add(tuple(self.cache.data_ptrs()))
        for layer in self.cache.layers:
            self.views_at_base &= layer.keys.data_ptr() == layer._k.data_ptr()
            self.views_at_base &= layer.values.data_ptr() == layer._v.data_ptr()
        s = self.cache.stats()
        self.kv_bytes.append(s["kv_bytes"])
        self.cpu_layers.append(s.get("offload", {}).get("cpu_layers", 0))
        return scores


def generate(model, cache, new_tokens=NEW_TOKENS, prompts=PROMPTS, **kw):
    ids, mask = batch(prompts)
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **kw,
        )


@contextlib.contextmanager
def folding_from_the_first_step():
    """"strata_sdpa" folds from the first decode step (FOLD_FROM_BYTES 0: these tiny models'
    contexts stay below it); yields a list that gets one entry per call handed to SDPA (counts
    only: holding the calls' arguments would keep the KV views alive)."""
    to_sdpa = []

    def sdpa(*args, **kw):
        to_sdpa.append(None)
        return sdpa_attention_forward(*args, **kw)

    with (
        mock.patch.object(_row_attention, "sdpa_attention_forward", sdpa),
        mock.patch.object(_row_attention, "FOLD_FROM_BYTES", 0),
    ):
        yield to_sdpa


def mapped_bytes(cache):
    """What whole pages for the tokens held cost: the space's requests (rows, or one for all rows
    in the "token" layout) x blocks x block bytes."""
    s = cache.stats()
    return len(cache._requests) * math.ceil(s["tokens"] / s["tokens_per_block"]) * s["block_bytes"]


@unittest.skipUnless(transformers, f"needs transformers; {NO_DEVICE}")
class StrataCacheTest(unittest.TestCase):
    def same_tokens_as_dynamic(self, name, new_tokens=NEW_TOKENS, attention=None, prompts=PROMPTS, layout=None, **extra):
        """`attention`: the StrataCache run's attn_implementation (DynamicCache's stays "sdpa").
        `layout`: (the cache's `layout` argument, the layout's rows per page); by default "auto",
        which groups a page's tokens of every layer (2) of one row (3 rows of 128 bytes do not
        divide a page), or of every row when there are 2 or 4."""
        from strata.transformers import StrataCache

        argument, rows_per_page = layout or ("auto", len(prompts) if len(prompts) in (2, 4) else 1)
        model = tiny(name, **extra)
        expected = generate(model, DynamicCache(), new_tokens, prompts=prompts)
        if attention:
            model.set_attn_implementation(attention)
        total = max(prompts) + new_tokens
        with StrataCache(model.config, max_cache_len=total + 100, layout=argument) as cache:
            watch = Watch(cache)
            with folding_from_the_first_step() as to_sdpa:
                got = generate(
                    model, cache, new_tokens, prompts=prompts, logits_processor=LogitsProcessorList([watch])
                )
            want_layout = "request" if argument == "request" else "token"
            self.assertEqual((cache.layout, cache.stats()["rows_per_page"]), (want_layout, rows_per_page))
            if attention == "strata_sdpa":
                # Only the prefill goes to SDPA: every decode step of every layer reads rows.
                self.assertEqual(len(to_sdpa), len(model.model.layers))
            self.assertEqual(got.shape, expected.shape)
            self.assertTrue(torch.equal(got, expected), f"{name}: {(got != expected).sum()} tokens differ")
            # One set of addresses for the whole generation, and the views start at the base.
            self.assertEqual(watch.steps, new_tokens)
            self.assertEqual(len(watch.addresses), 1)
            self.assertTrue(watch.views_at_base)
            # Pages follow the tokens held: whole pages for them, never the whole reservation.
            s = cache.stats()
            self.assertEqual(s["tokens"], total - 1)  # the last token is sampled, not cached
            self.assertEqual(s["kv_bytes"], mapped_bytes(cache))
            self.assertGreaterEqual(s["kv_bytes"], s["token_bytes"])
            self.assertEqual(watch.kv_bytes, sorted(watch.kv_bytes))
            cache.space.check()
        return model

    def test_llama_greedy_matches_dynamic_cache(self):
        self.same_tokens_as_dynamic("Llama")

    def test_qwen2_greedy_matches_dynamic_cache(self):
        self.same_tokens_as_dynamic("Qwen2")

    def test_llama_every_row_in_a_page_matches_dynamic_cache(self):
        self.same_tokens_as_dynamic("Llama", prompts=PROMPTS + (5,))

    def test_qwen2_request_layout_matches_dynamic_cache(self):
        self.same_tokens_as_dynamic("Qwen2", prompts=PROMPTS + (5,), layout=("request", 1))

    def test_mixtral_moe_greedy_matches_dynamic_cache(self):
        self.same_tokens_as_dynamic("Mixtral", num_local_experts=4, num_experts_per_tok=2)

    def test_llama_with_strata_sdpa_attention_matches_dynamic_cache(self):
        self.same_tokens_as_dynamic("Llama", attention="strata_sdpa")

    def test_mixtral_with_strata_sdpa_attention_matches_dynamic_cache(self):
        # 8 query heads over 2 KV heads of 32: rows of one head reach 128 bytes, so two heads fold;
        # 4 rows: a page holds tokens of every row and layer, so the token stride spans them all.
        self.same_tokens_as_dynamic(
            "Mixtral",
            attention="strata_sdpa",
            prompts=PROMPTS + (5,),
            hidden_size=256,
            num_attention_heads=8,
            num_local_experts=4,
            num_experts_per_tok=2,
        )

    def test_mistral_window_wider_than_the_cache_is_full_attention(self):
        self.same_tokens_as_dynamic("Mistral", new_tokens=64, sliding_window=4096)

    def test_beam_search_matches_dynamic_cache(self):
        from strata.transformers import StrataCache

        model = tiny("Llama")
        # 9 rows (a page per row of both layers), and 4 rows (every row in a page).
        for prompts, beams, rows_per_page in ((PROMPTS, 3, 1), (PROMPTS[:2], 2, 4)):
            expected = generate(model, DynamicCache(), new_tokens=24, num_beams=beams, prompts=prompts)
            with StrataCache(model.config, max_cache_len=64) as cache:
                got = generate(model, cache, new_tokens=24, num_beams=beams, prompts=prompts)
                self.assertEqual((cache.layout, cache.stats()["rows_per_page"]), ("token", rows_per_page))
                self.assertTrue(torch.equal(got, expected), f"{beams} beams")

    def test_crop_then_continue_matches_dynamic_cache(self):
        from strata.transformers import StrataCache

        model = tiny("Llama")
        ids, mask = batch()
        more = torch.randint(3, VOCAB, (len(PROMPTS), 6)).to(DEVICE)
        full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
        logits = {}
        with StrataCache(model.config, max_cache_len=128) as cache, torch.no_grad():
            for name, c in (("dynamic", DynamicCache()), ("strata", cache)):
                model(input_ids=ids, attention_mask=mask, past_key_values=c)
                c.crop(-4)
                kept = ids.shape[1] - 4
                self.assertEqual(c.get_seq_length(), kept)
                out = model(input_ids=more, attention_mask=full_mask[:, : kept + 6], past_key_values=c)
                logits[name] = out.logits
            self.assertTrue(torch.equal(logits["strata"], logits["dynamic"]))
            with self.assertRaises(strata.InvalidArgument):
                cache.crop(2.5)

    def test_crop_with_a_positive_count_keeps_that_many_tokens(self):
        """transformers' caches before 5.23 and their assisted generation take crop(n > 0) as
        "keep n tokens"; crop(-n) removes n; crop(0) keeps everything."""
        from strata.transformers import OffloadedStrataCache, StrataCache

        model = offload_model("Qwen2")
        ids = torch.randint(3, VOCAB, (len(PROMPTS), 40)).to(DEVICE)
        more = torch.randint(3, VOCAB, (len(PROMPTS), 5)).to(DEVICE)
        budget = final_kv_bytes(model, 64) // 2
        with torch.no_grad():
            dynamic = DynamicCache()
            model(input_ids=ids, past_key_values=dynamic)
            dynamic.crop(-10)
            want = model(input_ids=more, past_key_values=dynamic).logits
            for cache in (
                StrataCache(model.config, max_cache_len=64),
                OffloadedStrataCache(model.config, max_cache_len=64, device_budget=budget),
            ):
                with cache:
                    model(input_ids=ids, past_key_values=cache)
                    cache.crop(0)
                    cache.crop(100)  # more than held: keeps everything
                    self.assertEqual(cache.get_seq_length(), 40)
                    cache.crop(30)
                    self.assertEqual(cache.get_seq_length(), 30)
                    got = model(input_ids=more, past_key_values=cache).logits
                    self.assertTrue(torch.equal(got, want), type(cache).__name__)
                    with self.assertRaises(strata.InvalidArgument):
                        cache.crop("3")
                    self.assertEqual(cache.get_seq_length(), 35)

    def test_every_update_checks_batch_heads_head_dim_and_dtype_and_keeps_the_cache(self):
        """Not only the first update: a batch-1 step into a batch-2 cache must not broadcast into
        both rows, and another dtype must not be cast silently."""
        from strata.transformers import OffloadedStrataCache, StrataCache

        model = tiny("Llama")
        cfg = model.config
        heads, dim, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        torch.manual_seed(5)
        bad = {
            "batch": torch.randn(1, heads, 1, dim).to(DEVICE),
            "kv_heads": torch.randn(2, heads * 2, 1, dim).to(DEVICE),
            "head_dim": torch.randn(2, heads, 1, dim * 2).to(DEVICE),
            "dtype": torch.randn(2, heads, 1, dim, dtype=torch.float64).to(DEVICE),
        }
        for cache in (
            StrataCache(cfg, max_cache_len=64),
            OffloadedStrataCache(cfg, max_cache_len=64, device_budget=1 << 20),
        ):
            with cache:
                for layer in range(layers):
                    k, v = torch.randn(2, 2, heads, 5, dim).to(DEVICE)
                    cache.update(k, v, layer)
                before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
                for what, t in bad.items():
                    with self.assertRaisesRegex(strata.InvalidArgument, what, msg=type(cache).__name__):
                        cache.update(t, t, 1)
                ok = torch.randn(2, heads, 1, dim).to(DEVICE)
                with self.assertRaisesRegex(strata.InvalidArgument, "differ"):
                    cache.update(ok, ok.double(), 0)
                with self.assertRaisesRegex(strata.InvalidArgument, "4-d"):
                    cache.update(ok[0], ok[0], 0)
                self.assertEqual(cache.get_seq_length(), 5)
                for layer, (k, v) in zip(cache.layers, before):
                    self.assertTrue(torch.equal(layer.keys, k) and torch.equal(layer.values, v))
                del before
                cache.update(ok, ok, 0)  # the cache still takes a good update
                self.assertEqual(cache.layers[0].get_seq_length(), 6)

    def test_a_row_spilled_twice_reads_back_what_was_written_between_the_spills(self):
        """With a host tier, a partly written page must not count as full: a page counted full
        keeps its host copy as clean when restored, and a later spill would then copy nothing
        and bring back the tokens of the first spill only."""
        from strata.transformers import StrataCache

        model = tiny("Llama")
        cfg = model.config
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        layers = cfg.num_hidden_layers
        torch.manual_seed(3)
        written = {layer: ([], []) for layer in range(layers)}

        def write(cache, tokens):
            for layer in range(layers):
                k, v = torch.randn(2, 1, heads, tokens, dim).to(DEVICE)
                written[layer][0].append(k)
                written[layer][1].append(v)
                cache.update(k, v, layer)

        with StrataCache(cfg, max_cache_len=2048, host_bytes=8 << 20) as cache:
            write(cache, 3)
            self.assertLess(3, cache.stats()["tokens_per_block"], "the tokens share one page")
            (row,) = cache._requests
            for more in (2, 4):
                row.spill("host")
                cache.space.make_resident([row])
                write(cache, more)
            row.spill("host")
            cache.space.make_resident([row])
            same = [
                (
                    torch.equal(cache.layers[layer].keys, torch.cat(written[layer][0], dim=2)),
                    torch.equal(cache.layers[layer].values, torch.cat(written[layer][1], dim=2)),
                )
                for layer in range(layers)
            ]
            cache.space.check()
        self.assertEqual(same, [(True, True)] * layers, "(K, V) of each layer as written")

    def test_crop_returns_the_pages_past_the_tokens_kept(self):
        from strata.transformers import StrataCache

        model = tiny("Llama")
        ids = torch.randint(3, VOCAB, (len(PROMPTS), 600)).to(DEVICE)
        with StrataCache(model.config, max_cache_len=1024) as cache, torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            per_page = cache.stats()["tokens_per_block"]
            self.assertLess(per_page, 600, "the test needs sequences over one page")
            addresses = cache.data_ptrs()
            held = cache.stats()["kv_bytes"]
            self.assertEqual(held, mapped_bytes(cache))
            cache.crop(-(600 - per_page // 2))
            self.assertEqual(cache.get_seq_length(), per_page // 2)
            self.assertEqual(cache.stats()["kv_bytes"], mapped_bytes(cache))
            self.assertLess(cache.stats()["kv_bytes"], held)
            # Growing again maps pages at the same addresses and gives DynamicCache's logits.
            dynamic = DynamicCache()
            model(input_ids=ids, past_key_values=dynamic)
            dynamic.crop(-(600 - per_page // 2))
            more = ids[:, per_page // 2 : per_page // 2 + 500]
            got = model(input_ids=more, past_key_values=cache).logits
            want = model(input_ids=more, past_key_values=dynamic).logits
            self.assertTrue(torch.equal(got, want))
            self.assertEqual(cache.stats()["kv_bytes"], mapped_bytes(cache))
            self.assertEqual(cache.data_ptrs(), addresses)

    def test_reset_returns_pages_and_keeps_addresses(self):
        from strata.transformers import StrataCache

        model = tiny("Llama")
        with StrataCache(model.config, max_cache_len=200) as cache:
            first = generate(model, cache, new_tokens=40)
            addresses = cache.data_ptrs()
            self.assertGreater(cache.stats()["kv_bytes"], 0)
            cache.reset()
            self.assertEqual(cache.get_seq_length(), 0)
            self.assertEqual(cache.stats()["kv_bytes"], 0)
            again = generate(model, cache, new_tokens=40)
            self.assertTrue(torch.equal(first, again))
            self.assertEqual(cache.data_ptrs(), addresses)

    def test_more_tokens_than_reserved_is_a_clear_error_and_keeps_the_cache(self):
        from strata.transformers import StrataCache

        model = tiny("Llama")
        ids, mask = batch()
        with StrataCache(model.config, max_cache_len=ids.shape[1] + 3) as cache, torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            held = cache.stats()["kv_bytes"]
            with self.assertRaisesRegex(strata.InvalidArgument, "max_cache_len"):
                model(input_ids=ids[:, :4], past_key_values=cache)
            self.assertEqual(cache.get_seq_length(), ids.shape[1])
            self.assertEqual(cache.stats()["kv_bytes"], held)
        with StrataCache(model.config, max_cache_len=ids.shape[1] + 3) as short:
            with self.assertRaisesRegex(strata.InvalidArgument, "max_cache_len"):
                generate(model, short, new_tokens=10)

    def test_closed_cache_is_a_clear_error(self):
        from strata.transformers import StrataCache

        model = tiny("Llama")
        cache = StrataCache(model.config, max_cache_len=100)
        generate(model, cache, new_tokens=4)
        cache.close()
        cache.close()  # idempotent
        with self.assertRaisesRegex(strata.InvalidState, "closed"):
            generate(model, cache, new_tokens=4)
        with self.assertRaisesRegex(strata.InvalidState, "closed"):
            cache.reset()

    def test_transformers_outside_the_supported_range_is_refused(self):
        from strata import transformers as st

        st._check_version(transformers.__version__)  # this one is in the range
        for version in (f"{st.OLDEST.major}.{st.OLDEST.minor - 1}.9" if st.OLDEST.minor else "4.57.6", "6.0.0"):
            with self.assertRaisesRegex(strata.Unsupported, f"transformers {st.TRANSFORMERS_VERSIONS}.*{version}"):
                st._check_version(version)
        # The check runs on import, before anything of transformers' cache interface is used.
        code = "import transformers; transformers.__version__ = '4.57.6'; import strata.transformers"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn(f"Unsupported: strata.transformers supports transformers {st.TRANSFORMERS_VERSIONS}", run.stderr)

    def test_unsupported_configs_are_refused(self):
        from strata.transformers import StrataCache

        model = tiny("Mistral", sliding_window=16)
        with self.assertRaisesRegex(strata.Unsupported, "sliding_attention"):
            StrataCache(model.config, max_cache_len=100)
        with self.assertRaises(strata.InvalidArgument):
            StrataCache(model.config, max_cache_len=0)


def final_kv_bytes(model, tokens):
    """Whole pages of every row's K and V for `tokens` tokens in every layer (float32)."""
    c = model.config
    bytes_per_token = c.num_key_value_heads * c.head_dim * 4
    with kv.KvSpace(layers=1, kv_heads=1, head_dim=16, dtype="float32", max_requests=1, max_tokens=8) as s:
        page = s.stats()["page_size"]
    pages = math.ceil(tokens / (page // bytes_per_token))
    return 2 * c.num_hidden_layers * len(PROMPTS) * pages * page


def offload_model(name, **extra):
    """Four layers and a 64-wide head dim, so that 512 new tokens cross several pages."""
    config = dict(num_hidden_layers=4, head_dim=64)
    if name == "Llama":
        config["num_key_value_heads"] = 4  # multi-head; the others keep tiny()'s GQA (2 KV heads)
    config.update(extra)
    return tiny(name, **config)


@unittest.skipUnless(transformers, f"needs transformers; {NO_DEVICE}")
class OffloadTest(unittest.TestCase):
    """OffloadedStrataCache: layers' KV swapped to host memory (and disk) within a device budget."""

    def offload_matches_dynamic(self, name, model=None, expected=None, budget=None, **cache_kw):
        """Generates with an OffloadedStrataCache (default budget: half the final KV) and checks
        it against DynamicCache; returns the cache's stats and the watch."""
        from strata.transformers import OffloadedStrataCache

        model = model or offload_model(name)
        if expected is None:
            expected = generate(model, DynamicCache())
        total = max(PROMPTS) + NEW_TOKENS
        budget = budget or final_kv_bytes(model, total - 1) // 2
        with OffloadedStrataCache(model.config, max_cache_len=total + 100, device_budget=budget, **cache_kw) as cache:
            watch = Watch(cache)
            got = generate(model, cache, logits_processor=LogitsProcessorList([watch]))
            self.assertTrue(torch.equal(got, expected), f"{name}: {(got != expected).sum()} tokens differ")
            self.assertEqual(watch.steps, NEW_TOKENS)
            if cache.swap == "pie":  # every layer at its own addresses
                self.assertEqual(len(watch.addresses), 1)
            else:  # a layer is at its own addresses until it is offloaded, then in one of <= 2 slots
                streamer = cache._swap
                pair = lambda g: tuple(t.data_ptr() for t in cache._tensors(g))  # noqa: E731
                slots = {pair(g) for g in streamer.ring}
                self.assertLessEqual(len(slots), 2)
                for i in range(len(cache.layers)):
                    seen = set(step[i] for step in watch.addresses)
                    self.assertLessEqual(seen, ({pair(i)} | slots) if i in streamer.offloaded else {pair(i)})
            self.assertTrue(watch.views_at_base)
            # The device never held more than the budget, and layers really moved.
            self.assertLessEqual(max(watch.kv_bytes), budget)
            s = cache.stats()
            c = model.config
            self.assertEqual(s["tokens"], total - 1)
            self.assertEqual(s["token_bytes"], 2 * 4 * len(PROMPTS) * (total - 1) * c.num_key_value_heads * c.head_dim * 4)
            off = s["offload"]
            self.assertGreater(off["swap_ins"], 0, off)
            self.assertGreater(off["swap_outs"], 0, off)
            self.assertGreater(off["prefetch_hits"] + off["stalls"], 0, off)
            if cache.swap == "pie":
                # Eq. 1's predictions are a subset of what was launched; "early and hidden" of both.
                self.assertLessEqual(off["swap_ins_early"], off["swap_ins"], off)
                self.assertLessEqual(
                    off["swap_ins_early_hidden"], min(off["swap_ins_early"], off["prefetch_hits"]), off
                )
            else:
                # Streamed: every fetch of a decode step was queued ahead (by the layer before it,
                # the first one by the last layer of the step before); only a prefill's first
                # offloaded layer, and the layers offloaded mid-run, fetch at their own update;
                # the last step's last layer fetches the first one of a step that never comes.
                self.assertIn(off["swap_ins"] - off["prefetch_hits"] - off["stalls"], (0, 1), off)
                self.assertLessEqual(off["stalls"], 1 + off["demotions"], off)
            self.assertGreater(s["bytes_to_device"], 0)
            self.assertGreater(s["bytes_from_device"], 0)
            self.assertLessEqual(s["kv_bytes"], budget)
            cache.space.check()
        return s, watch

    def full_offload(self, name, swap=None, **extra):
        """Half the final KV off the device: a floor of two layers, every token swapping."""
        model = offload_model(name, **extra) if extra else None
        s, _ = self.offload_matches_dynamic(name, model=model, swap=swap)
        off = s["offload"]
        self.assertEqual(off.get("mode", "pie"), swap or "stream", off)
        self.assertGreaterEqual(off["floor"], 2, off)
        self.assertGreater(off["swap_ins"], NEW_TOKENS, off)
        self.assertGreater(off["swap_outs"], NEW_TOKENS, off)
        if swap == "pie":
            # Full pages swapped out again copy nothing (their clean copy stayed in host memory).
            self.assertGreater(s["clean_spills"], 0)
        self.assertEqual(s["disk_write_bytes"], 0)
        return off

    def test_llama_offload_matches_dynamic_cache(self):
        self.full_offload("Llama")

    def test_qwen2_gqa_offload_matches_dynamic_cache(self):
        self.full_offload("Qwen2")

    def test_mixtral_moe_offload_matches_dynamic_cache(self):
        self.full_offload("Mixtral", num_local_experts=4, num_experts_per_tok=2)

    def test_offload_with_strata_sdpa_attention_matches_dynamic_cache(self):
        # Swapped-in layers are the same token-major views: every decode step folds over them.
        model = offload_model("Qwen2")
        expected = generate(model, DynamicCache())
        model.set_attn_implementation("strata_sdpa")
        with folding_from_the_first_step() as to_sdpa:
            self.offload_matches_dynamic("Qwen2", model=model, expected=expected)
        self.assertEqual(len(to_sdpa), len(model.model.layers))

    def test_mistral_offload_matches_dynamic_cache(self):
        self.full_offload("Mistral", sliding_window=4096)

    def test_pie_swapping_in_host_memory_matches_dynamic_cache(self):
        # swap="pie" without a disk tier: whole layers spilled and made resident at their addresses.
        self.full_offload("Qwen2", swap="pie")

    def test_disk_tier_holds_what_host_memory_cannot_with_and_without_the_lookahead(self):
        """A host tier of a quarter of the final KV, with half of it off the device: layers go on
        to disk and come back through the two-hop path; with the lookahead, their disk hop runs
        ahead of need where host room allows; DynamicCache's tokens either way."""
        model = offload_model("Llama")
        expected = generate(model, DynamicCache())
        final = final_kv_bytes(model, max(PROMPTS) + NEW_TOKENS - 1)
        runs = {}
        for lookahead in (False, True):
            with tempfile.TemporaryDirectory(prefix="strata-test-") as d:
                s, _ = self.offload_matches_dynamic(
                    "Llama", model, expected, host_bytes=final // 4, disk_bytes=final, disk_dir=d, lookahead=lookahead
                )
            self.assertLessEqual(s["host_capacity_bytes"], final // 4)
            self.assertGreater(s["disk_write_bytes"], 0, s)
            self.assertGreater(s["disk_read_bytes"], 0, s)
            runs[lookahead] = s
        # Without the lookahead every layer that left for disk comes back through both hops.
        off = runs[False]["offload"]
        self.assertEqual((off["stages"], runs[False]["staged_objects"]), (0, 0), off)
        self.assertGreater(off["two_hop_swap_ins"], NEW_TOKENS, off)
        # With it, a disk hop starts ahead of need where Eq. 1 says it is in time, into host room
        # nothing else needs: a tier this full rarely has any, and a staged layer is never pushed
        # back to disk before it runs (the store counts what it staged and dropped unread).
        s, on = runs[True], runs[True]["offload"]
        self.assertEqual(s["staged_objects"], on["stage_objects"], on)
        self.assertEqual(s["staged_evicted"], 0, s)
        self.assertLessEqual(on["stages_hidden"] + on["two_hop_swap_ins"], on["swap_ins"], on)

    def test_adaptive_expansion_moves_layers_in_a_generate_run(self):
        """Everything fits the budget, so only adaptive expansion moves layers off the device."""
        model = offload_model("Qwen2")
        budget = 2 * final_kv_bytes(model, max(PROMPTS) + NEW_TOKENS - 1)
        s, watch = self.offload_matches_dynamic("Qwen2", model, budget=budget, expand=True)
        off = s["offload"]
        self.assertEqual(off["floor"], 0, off)
        self.assertGreater(max(watch.cpu_layers), 0, "expansion never moved a layer")
        self.assertGreater(off["swap_ins"], 0, off)

    @unittest.skipIf(os.environ.get("STRATA_HOST_LINK"), "already under a link model")
    @unittest.skipIf(DEVICE == "cuda", "host backend only: STRATA_HOST_LINK models the host backend's link")
    def test_offload_under_host_link_matches_dynamic_cache(self):
        """Pie's swapping in a process whose host backend pays a modelled link for every copy of
        strata's, so the swaps take time and overlap the layers' compute (layer streaming copies
        with torch, which the link model does not see)."""
        env = dict(os.environ, STRATA_HOST_LINK="2GB,20us")
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "unittest",
                "test_transformers.OffloadTest.test_pie_swapping_in_host_memory_matches_dynamic_cache",
            ],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            env=env,
            capture_output=True,
            text=True,
        )
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("Ran 1 test", run.stderr)
        self.assertNotIn("skipped", run.stderr)

    def test_a_refused_close_leaves_the_cache_usable(self):
        """close() with a view still held is refused (InvalidState); the cache is then empty and
        usable, transfer threads included, and closes once the view is gone."""
        from strata.transformers import OffloadedStrataCache

        model = offload_model("Qwen2")
        expected = generate(model, DynamicCache(), new_tokens=40)
        budget = final_kv_bytes(model, max(PROMPTS) + 40) // 2
        cache = OffloadedStrataCache(model.config, max_cache_len=128, device_budget=budget)
        generate(model, cache, new_tokens=40)
        held = cache.layers[0].keys
        with self.assertRaises(strata.InvalidState):
            cache.close()
        self.assertEqual(cache.get_seq_length(), 0)
        del held
        got = generate(model, cache, new_tokens=40)
        self.assertTrue(torch.equal(got, expected))
        self.assertGreater(cache.stats()["offload"]["swap_ins"], 0)
        cache.close()
        self.assertIsNone(cache.space)

    def test_budget_smaller_than_one_layer_is_a_clear_error(self):
        from strata.transformers import OffloadedStrataCache

        model = offload_model("Llama")
        for bad in (0, -1, 1.5, "1MiB", True):
            with self.assertRaises(strata.InvalidArgument):
                OffloadedStrataCache(model.config, max_cache_len=100, device_budget=bad)
        with OffloadedStrataCache(model.config, max_cache_len=100, device_budget=4096) as cache:
            with self.assertRaisesRegex(strata.OutOfMemory, "device_budget 4096 bytes is smaller than one layer"):
                generate(model, cache, new_tokens=4)
            self.assertEqual(cache.stats()["kv_bytes"], 0)

    def test_offload_crop_reset_then_continue_matches_dynamic_cache(self):
        from strata.transformers import OffloadedStrataCache

        model = offload_model("Qwen2")
        ids = torch.randint(3, VOCAB, (len(PROMPTS), 300)).to(DEVICE)
        budget = final_kv_bytes(model, 300) // 2
        with OffloadedStrataCache(model.config, max_cache_len=400, device_budget=budget) as cache, torch.no_grad():
            dynamic = DynamicCache()
            for c in (cache, dynamic):
                model(input_ids=ids, past_key_values=c)
                c.crop(-100)
            self.assertEqual(cache.get_seq_length(), 200)
            more = ids[:, 200:260]
            got = model(input_ids=more, past_key_values=cache).logits
            want = model(input_ids=more, past_key_values=dynamic).logits
            self.assertTrue(torch.equal(got, want))
            with self.assertRaises(strata.Unsupported):
                cache.reorder_cache(torch.arange(len(PROMPTS)))
            # Reset: every page back (device and host), same addresses, same logits again.
            addresses = cache.data_ptrs()
            cache.reset()
            self.assertEqual(cache.get_seq_length(), 0)
            self.assertEqual(cache.stats()["kv_bytes"], 0)
            self.assertEqual(cache.stats()["host_used_bytes"], 0)
            again = model(input_ids=ids, past_key_values=cache).logits
            self.assertTrue(torch.equal(again, model(input_ids=ids, past_key_values=DynamicCache()).logits))
            self.assertEqual(cache.data_ptrs(), addresses)


if __name__ == "__main__":
    unittest.main()
