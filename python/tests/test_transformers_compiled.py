"""`StrataCache(compileable=True)` under torch.compile on the CPU: the decode step compiles with
`fullgraph=True` into one graph with no graph break, makes no strata call, gives DynamicCache's
tokens, and the pages it writes were mapped ahead (the margin) through prefill, decode, crop,
reset and a refused batch; a write past the mapped pages faults on the read-only zero page.
Run by ffi/tests/python_transformers.rs outside strict mode, as test_transformers.py (whose
helpers this module shares). The backend is inductor, torch.compile's default and what generate
uses: it writes the new tokens in place. ("aot_eager" does not: it writes every mutated input
back whole, so its step writes the tail on the zero page and faults.)"""

import os
import signal
import subprocess
import sys
import textwrap
import unittest
from unittest import mock

import strata
from strata import kv

from kv_device import NO_DEVICE
from test_transformers import DEVICE, PROMPTS, VOCAB, generate, offload_model, transformers

if transformers:
    import torch
    from torch._dynamo.utils import counters
    from transformers import DynamicCache, LogitsProcessorList
    from transformers.generation.configuration_utils import CompileConfig

NEW_TOKENS = 160
MARGIN = 64
BACKEND = "inductor"


def compile_config():
    """generate()'s compile settings: the decode step with fullgraph=True, also on the CPU."""
    config = CompileConfig(fullgraph=True, dynamic=False, backend=BACKEND)
    config._compile_all_devices = True
    return config


def mapped_tokens(cache):
    """Tokens every row has pages for (the fewest of any row)."""
    return min(r.info()["tokens"] for r in cache._requests)


class MarginWatch:
    """A logits processor (once per step, between steps): the mapped pages cover the tokens held
    plus the margin, and the tensors' addresses never change."""

    def __init__(self, test, cache):
        self.test, self.cache = test, cache
        self.addresses = set()
        self.steps = 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        self.test.assert_margin(self.cache)
        self.addresses.add(tuple(self.cache.data_ptrs()))
        return scores


@unittest.skipUnless(transformers, f"needs transformers; {NO_DEVICE}")
class CompiledStrataCacheTest(unittest.TestCase):
    def assert_margin(self, cache):
        held = cache.get_seq_length()
        want = min(held + MARGIN, cache.max_cache_len)
        self.assertGreaterEqual(mapped_tokens(cache), want, f"{held} tokens held")

    def compiled_matches_dynamic(self, name, prompts=PROMPTS, rows_per_page=1, **extra):
        """`prompts`: the batch; `rows_per_page`: how many of its rows share pages in the "token"
        layout the cache chooses (1: a page holds one row's tokens of every layer)."""
        from strata.transformers import StrataCache

        model = offload_model(name, **extra)
        expected = generate(model, DynamicCache(), NEW_TOKENS, prompts=prompts)
        counters.clear()
        total = max(prompts) + NEW_TOKENS
        with StrataCache(model.config, max_cache_len=total + 200, compileable=True, margin=MARGIN) as cache:
            self.assertTrue(cache.is_compileable)
            watch = MarginWatch(self, cache)
            got = generate(
                model,
                cache,
                NEW_TOKENS,
                prompts=prompts,
                compile_config=compile_config(),
                logits_processor=LogitsProcessorList([watch]),
            )
            self.assertEqual((cache.layout, cache.stats()["rows_per_page"]), ("token", rows_per_page))
            self.assertTrue(torch.equal(got, expected), f"{name}: {(got != expected).sum()} tokens differ")
            self.assertEqual(watch.steps, NEW_TOKENS)
            self.assertEqual(len(watch.addresses), 1)
            # The decode step compiled once, whole: no graph break, no recompilation per step.
            self.assertEqual(dict(counters["graph_break"]), {})
            self.assertEqual(counters["stats"]["unique_graphs"], 1, dict(counters["stats"]))
            # Memory follows the tokens: whole pages for the tokens held and the margin, never
            # the whole reservation.
            s = cache.stats()
            page = s["tokens_per_block"]
            self.assertLess(page, total, "the test needs sequences over one page")
            pages = -(-min(s["tokens"] + MARGIN, cache.max_cache_len) // page)
            slots = len(cache._requests)
            self.assertEqual(s["kv_bytes"], slots * pages * s["block_bytes"])
            self.assertLess(s["kv_bytes"], slots * -(-cache.max_cache_len // page) * s["block_bytes"])
            cache.space.check()

    def test_llama_compiled_decode_matches_dynamic_cache(self):
        # Four rows: the "token" layout puts every row's tokens in one page.
        self.compiled_matches_dynamic("Llama", prompts=PROMPTS + (5,), rows_per_page=len(PROMPTS) + 1)

    def test_qwen2_compiled_decode_matches_dynamic_cache(self):
        self.compiled_matches_dynamic("Qwen2")

    def test_mixtral_compiled_decode_matches_dynamic_cache(self):
        self.compiled_matches_dynamic("Mixtral", num_local_experts=4, num_experts_per_tok=2)

    def test_margin_holds_through_prefill_decode_crop_reset_and_a_refused_batch(self):
        """A decode loop of our own around the compiled model (so `prepare` is called here, as the
        contract says): after every operation the pages cover the tokens held plus the margin,
        the compiled step makes no strata call, and the logits equal DynamicCache's."""
        from strata.transformers import StrataCache

        model = offload_model("Llama")
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=BACKEND)
        rows = 4  # the "token" layout with every row's tokens in one page
        torch.manual_seed(11)
        prompt = torch.randint(3, VOCAB, (rows, 30)).to(DEVICE)
        calls = []
        real_c = kv._c

        def counted():
            calls.append(None)
            return real_c()

        with StrataCache(model.config, max_cache_len=400, compileable=True, margin=MARGIN) as cache, torch.no_grad():
            dynamic = DynamicCache()

            def prefill(ids):
                got = model(input_ids=ids, past_key_values=cache).logits
                want = model(input_ids=ids, past_key_values=dynamic).logits
                self.assertTrue(torch.equal(got, want))
                self.assert_margin(cache)
                return got[:, -1:].argmax(-1)

            def decode(token, steps):
                for _ in range(steps):
                    held = cache.get_seq_length()
                    cache.prepare(1)
                    positions = torch.full((rows, 1), held, device=DEVICE)
                    with mock.patch.object(kv, "_c", counted):
                        got = step(input_ids=token, position_ids=positions, past_key_values=cache).logits
                    want = model(input_ids=token, position_ids=positions, past_key_values=dynamic).logits
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
                    self.assertEqual(cache.get_seq_length(), held + 1)
                    self.assert_margin(cache)
                    token = want.argmax(-1)
                return token

            token = decode(prefill(prompt), 100)  # crosses pages (4 tokens each) and margins
            self.assertEqual((cache.layout, cache.stats()["rows_per_page"]), ("token", rows))
            self.assertEqual(calls, [], "the compiled step called strata")
            for crop in (-50, 40):
                cache.crop(crop)
                dynamic.crop(crop if crop < 0 else crop - dynamic.get_seq_length())
                self.assertEqual(cache.get_seq_length(), dynamic.get_seq_length())
                self.assert_margin(cache)
                token = decode(token, 20)
            with self.assertRaisesRegex(strata.InvalidArgument, "batch 1"):
                model(input_ids=token[:1], past_key_values=cache)
            self.assert_margin(cache)
            token = decode(token, 5)
            cache.reset()
            dynamic = DynamicCache()
            self.assertEqual(cache.get_seq_length(), 0)
            self.assert_margin(cache)  # a compiled step may come next
            decode(prefill(prompt[:, :10]), 70)
            self.assertEqual(calls, [])
            cache.space.check()


@unittest.skipUnless(transformers and DEVICE == "cpu", "the host backend outside strict mode (a fault there is a signal)")
class ZeroPageTest(unittest.TestCase):
    def test_a_compiled_write_past_the_mapped_pages_faults_on_the_zero_page(self):
        """With `prepare` never called, compiled steps write until the mapped pages end, and the
        next write lands on the read-only zero page: the host backend faults (SIGSEGV) rather than
        let it corrupt the page every hole reads."""
        code = textwrap.dedent(
            f"""
            import torch, sys
            from test_transformers import offload_model
            from strata.transformers import StrataCache
            model = offload_model("Llama")
            step = torch.compile(model, fullgraph=True, dynamic=False, backend="{BACKEND}")
            cache = StrataCache(model.config, max_cache_len=400, compileable=True, margin={MARGIN})
            ids = torch.randint(3, 96, (3, 10))
            with torch.no_grad():
                token = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
                mapped = min(r.info()["tokens"] for r in cache._requests)
                print("mapped", mapped, flush=True)
                for held in range(10, 400):
                    print("step", held, flush=True)
                    out = step(input_ids=token, position_ids=torch.full((3, 1), held), past_key_values=cache)
                    token = out.logits.argmax(-1)
            print("no fault", flush=True)
            """
        )
        run = subprocess.run(
            [sys.executable, "-c", code],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
        )
        lines = run.stdout.split()
        self.assertIn("mapped", lines, run.stderr)
        mapped = int(lines[lines.index("mapped") + 1])
        last = int([w for w in run.stdout.splitlines() if w.startswith("step")][-1].split()[1])
        self.assertEqual(run.returncode, -signal.SIGSEGV, run.stdout[-300:] + run.stderr[-2000:])
        self.assertEqual(last, mapped, "the first write past the mapped pages faulted, not earlier or later")


if __name__ == "__main__":
    unittest.main()
