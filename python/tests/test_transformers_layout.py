"""StrataCache's layouts (`strata._layout`): the "token" layout, whose pages hold a token range of
every row and as many layers as fit, keeps the KV bytes mapped within 1.10× of the tokens held
at the shape of issue 27's H200 run and within 1.02× at a Llama-3-8B shape, with 2 MiB pages, where
the "request" layout (a page per row, layer and K/V) maps 1.78×; "auto" picks it; bad `layout`
arguments are typed errors. The KV bytes are measured on caches filled through `update` (K/V of
the models' shapes, no model), in a process of its own with 2 MiB host pages (the other tests use
64 KiB). Generation with the layouts is tested in test_transformers.py and
test_transformers_compiled.py."""

import json
import os
import subprocess
import sys
import textwrap
import unittest

import strata
from kv_device import NO_DEVICE
from test_transformers import DEVICE, transformers

if transformers:
    import torch

    from strata import _layout

MIB = 1 << 20
PAGE = 2 * MIB
# (layers, KV heads of 128, batch): issue 27's H200 run (a random Llama: hidden 2048, 16 heads)
# and Llama-3-8B's KV heads at batch 8.
H200 = (16, 8, 4)
LLAMA3_8B = (32, 8, 8)

# Fills caches at both shapes and prints what they map, as JSON (run in a process of its own).
FILL = textwrap.dedent(
    """
    import json, sys, time, torch
    from transformers import LlamaConfig
    from strata.transformers import StrataCache

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def fill(shape, tokens, max_len, **kw):
        start = time.perf_counter()
        layers, heads, batch = shape
        config = LlamaConfig(num_hidden_layers=layers, num_attention_heads=2 * heads, num_key_value_heads=heads,
                             head_dim=128, hidden_size=2 * heads * 128)
        before = rss()
        with StrataCache(config, max_cache_len=max_len, **kw) as cache:
            torch.manual_seed(len(kw))
            k, v = torch.randn(2, batch, heads, tokens, 128, dtype=torch.bfloat16, device=sys.argv[1])
            for layer in range(layers):
                cache.update(k, v, layer)
            s = cache.stats()
            page, per_token = s["page_size"], s["token_bytes"] // tokens
            worst = max(cache._layout.mapped_bytes(t, page) / (t * per_token) for t in range(150, max_len + 1))
            return dict(layout=cache.layout, rows_per_page=s["rows_per_page"], layers_per_page=s["layers_per_page"],
                        page=page, kv_bytes=s["kv_bytes"], token_bytes=s["token_bytes"], worst_from_150=worst,
                        same=all(torch.equal(l.keys[:, :, :tokens], k) and torch.equal(l.values[:, :, :tokens], v)
                                 for l in cache.layers),
                        rss_growth=rss() - before, seconds=time.perf_counter() - start)

    h200, llama3 = json.loads(sys.argv[2])
    print(json.dumps({
        "h200": fill(h200, 1151, 1216),
        "h200_request": fill(h200, 1151, 1216, layout="request"),
        "h200_compileable": fill(h200, 1151, 1216, compileable=True),
        "llama3_8b": fill(llama3, 257, 4096),
    }))
    """
)


@unittest.skipUnless(transformers, f"needs transformers; {NO_DEVICE}")
class LayoutTest(unittest.TestCase):
    def test_kv_bytes_within_the_targets_at_the_h200_and_llama3_8b_shapes(self):
        env = dict(os.environ, STRATA_HOST_GRANULARITY="2MiB", STRATA_HOST_DEVICES="1x3GiB")
        run = subprocess.run(
            [sys.executable, "-c", FILL, DEVICE, json.dumps([H200, LLAMA3_8B])],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            env=env,
            capture_output=True,
            text=True,
        )
        self.assertEqual(run.returncode, 0, run.stderr[-3000:])
        got = json.loads(run.stdout.splitlines()[-1])
        for case, g in got.items():
            print(f"{case}: {g['layout']}, {g['kv_bytes'] / g['token_bytes']:.4f}x", file=sys.stderr)
        for case, g in got.items():
            self.assertEqual(g["page"], PAGE, case)
            self.assertTrue(g["same"], f"{case}: the cache holds the K/V written")
            # Memory follows the pages mapped, never the reservation (the host backend maps lazily).
            self.assertLess(g["rss_growth"], g["kv_bytes"] + 64 * MIB, case)

        def ratio(case):
            return got[case]["kv_bytes"] / got[case]["token_bytes"]

        # The H200 run's shape: 1151 tokens held (1024 prompt + 128 new, the last not cached).
        self.assertEqual(got["h200"]["token_bytes"], 1151 * 256 * 1024)
        h200 = got["h200"]
        self.assertEqual((h200["layout"], h200["rows_per_page"], h200["layers_per_page"]), ("token", 4, 16))
        self.assertLessEqual(ratio("h200"), 1.10)
        self.assertEqual(got["h200_request"]["kv_bytes"], 512 * MIB)  # issue 27's 1.78x
        self.assertGreater(ratio("h200_request"), 1.10)
        # Compiled steps keep a margin (64 tokens) mapped past the tokens held: still within.
        self.assertEqual(got["h200_compileable"]["layout"], "token")
        self.assertLessEqual(ratio("h200_compileable"), 1.10)
        self.assertGreater(got["h200_compileable"]["kv_bytes"], got["h200"]["kv_bytes"])
        # Llama-3-8B's shape: within 1.02x at 257 tokens (where a page per row and layer maps
        # 3.98x), and by the pages the layout maps, at every length from 150 to 4096.
        self.assertEqual(got["llama3_8b"]["layout"], "token")
        self.assertLessEqual(ratio("llama3_8b"), 1.02)
        self.assertLessEqual(got["llama3_8b"]["worst_from_150"], 1.02)
        self.assertLessEqual(got["h200"]["worst_from_150"], 1.10)

    def test_auto_takes_the_layout_that_maps_less(self):
        row = 8 * 128 * 2  # 8 KV heads of 128, bf16
        for shape, max_len in ((H200, 1216), (LLAMA3_8B, 4096)):
            layers, heads, batch = shape
            auto = _layout.plan("auto", layers, batch, heads, row, PAGE, max_len)
            request = _layout.plan("request", layers, batch, heads, row, PAGE, max_len)
            self.assertEqual((auto.name, auto.rows_per_page, auto.layers_per_page), ("token", batch, layers))
            self.assertLess(auto.mean_mapped_bytes(max_len, PAGE), request.mean_mapped_bytes(max_len, PAGE))
            # The closed form is the sum it stands for.
            self.assertEqual(
                auto.mean_mapped_bytes(max_len, PAGE), sum(auto.mapped_bytes(t, PAGE) for t in range(1, max_len + 1))
            )
        # 3 rows of 384 bytes cannot share a 64 KiB page; 2 layers of one row can.
        grouped = _layout.plan("auto", 2, 3, 2, 128 * 3, 64 << 10, 100)
        self.assertEqual((grouped.name, grouped.rows_per_page, grouped.layers_per_page), ("request", 1, 1))
        grouped = _layout.plan("auto", 2, 3, 2, 128, 64 << 10, 100)
        self.assertEqual((grouped.name, grouped.rows_per_page, grouped.layers_per_page), ("token", 1, 2))
        # One layer and one row: nothing to group; "auto" is "request", "token" a clear error.
        self.assertEqual(_layout.plan("auto", 1, 1, 2, 128, 64 << 10, 100).name, "request")
        with self.assertRaisesRegex(strata.InvalidArgument, "layout 'token'"):
            _layout.plan("token", 1, 1, 2, 128, 64 << 10, 100)

    def test_a_bad_layout_is_a_typed_error(self):
        from strata.transformers import StrataCache

        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        for bad in ("rows", None, 1, "Token"):
            with self.subTest(layout=bad), self.assertRaisesRegex(strata.InvalidArgument, "layout"):
                StrataCache(config, max_cache_len=64, layout=bad)
        # A shape "token" cannot group (one layer, one row) fails at the first update, which
        # then leaves nothing behind.
        k = torch.zeros(1, 2, 3, 16, device=DEVICE)
        cache = StrataCache(config, max_cache_len=64, layout="token")
        with self.assertRaisesRegex(strata.InvalidArgument, "layout 'token'"):
            cache.update(k, k, 0)
        self.assertIsNone(cache.space)
        cache.close()
        with StrataCache(config, max_cache_len=64) as cache:
            cache.update(k, k, 0)
            self.assertEqual(cache.layout, "request")


if __name__ == "__main__":
    unittest.main()
