"""attn_implementation="strata_sdpa" (strata._row_attention): decode attention over token-major
K/V views gives SDPA's outputs, and everything else is transformers' SDPA itself. Plain torch
tensors, no strata memory: runs wherever torch and transformers import."""

import itertools
import unittest
from unittest import mock

try:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from strata import _row_attention as rows
except ImportError:
    rows = None


class Attention:
    """What transformers' attention functions read of the module."""

    is_causal = True

    def __init__(self, groups):
        self.num_key_value_groups = groups


def token_major(batch, tokens, heads, dim, dtype, spare=3):
    """A `[batch, heads, tokens, dim]` view of `[batch, tokens + spare, heads, dim]` memory, as
    StrataCache hands the model (rows reserved past the tokens held)."""
    return torch.randn(batch, tokens + spare, heads, dim, dtype=dtype)[:, :tokens].transpose(1, 2)


@unittest.skipUnless(rows, "needs torch and transformers")
class RowAttentionTest(unittest.TestCase):
    def folded(self, module, *args, fold_from=0, **kw):
        """row_attention_forward's output, and whether it handed the call to SDPA. `fold_from`:
        FOLD_FROM_BYTES (0: these small shapes fold too)."""
        with (
            mock.patch.object(rows, "sdpa_attention_forward", wraps=sdpa_attention_forward) as sdpa,
            mock.patch.object(rows, "FOLD_FROM_BYTES", fold_from),
        ):
            out, weights = rows.row_attention_forward(module, *args, **kw)
        self.assertIsNone(weights)
        return out, sdpa.called

    def test_decode_over_token_major_views_matches_sdpa(self):
        torch.manual_seed(0)
        shapes = itertools.product((1, 2, 4, 8), (1, 2, 4), (16, 32, 128), (torch.float32, torch.bfloat16))
        for heads, rep, dim, dtype in shapes:
            for tokens, padded in ((1, False), (37, True), (300, False), (300, True)):
                with self.subTest(heads=heads, rep=rep, dim=dim, dtype=dtype, tokens=tokens, padded=padded):
                    batch = 3
                    q = torch.randn(batch, heads * rep, 1, dim, dtype=dtype)
                    k = token_major(batch, tokens, heads, dim, dtype)
                    v = token_major(batch, tokens, heads, dim, dtype)
                    mask = None
                    if padded:  # left padding: row 0's first half is masked for every head
                        mask = torch.ones(batch, 1, 1, tokens, dtype=torch.bool)
                        mask[0, ..., : tokens // 2] = False
                    module = Attention(rep)
                    got, fell_back = self.folded(module, q, k, v, mask, scaling=0.3)
                    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
                    self.assertFalse(fell_back)
                    self.assertEqual(got.shape, expected.shape)
                    self.assertTrue(got.is_contiguous())
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)

    def test_decode_over_token_layout_views_matches_sdpa(self):
        """StrataCache's "token" layout: a token's row holds every layer's and row's heads, so the
        token stride spans all of them; the fold reads the same memory through it."""
        torch.manual_seed(4)
        layers, batch, heads, rep, dim, tokens = 3, 2, 4, 2, 32, 200
        memory = [torch.randn(tokens + 5, layers, batch, heads, dim) for _ in "kv"]
        k, v = (m[:tokens, 1].permute(1, 2, 0, 3) for m in memory)
        self.assertEqual(k.stride(2), layers * batch * heads * dim)
        q = torch.randn(batch, heads * rep, 1, dim)
        got, fell_back = self.folded(Attention(rep), q, k, v, None)
        expected, _ = sdpa_attention_forward(Attention(rep), q, k, v, None)
        self.assertFalse(fell_back)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    def test_the_default_scale_is_one_over_the_root_of_the_head_dim(self):
        torch.manual_seed(1)
        q = torch.randn(2, 8, 1, 32)
        k, v = token_major(2, 50, 4, 32, torch.float32), token_major(2, 50, 4, 32, torch.float32)
        got, fell_back = self.folded(Attention(2), q, k, v, None)
        expected, _ = sdpa_attention_forward(Attention(2), q, k, v, None)
        self.assertFalse(fell_back)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    def test_everything_else_is_sdpa_unchanged(self):
        torch.manual_seed(2)
        b, heads, rep, dim, n = 2, 4, 2, 32, 40
        k, v = token_major(b, n, heads, dim, torch.float32), token_major(b, n, heads, dim, torch.float32)
        q1 = torch.randn(b, heads * rep, 1, dim)
        per_head_mask = torch.ones(b, heads * rep, 1, n, dtype=torch.bool)
        per_head_mask[:, 0, :, :5] = False
        cases = {
            "contiguous K/V (DynamicCache's)": (q1, k.contiguous(), v.contiguous(), None, {}),
            "prefill (more than one query token)": (torch.randn(b, heads * rep, 7, dim), k, v, None, {}),
            "a mask that differs per head": (q1, k, v, per_head_mask, {}),
            "position bias": (q1, k, v, None, {"position_bias": torch.zeros(b, heads * rep, 1, n)}),
        }
        for name, (q, kk, vv, mask, extra) in cases.items():
            with self.subTest(name):
                module = Attention(rep)
                got, fell_back = self.folded(module, q, kk, vv, mask, **extra)
                expected, _ = sdpa_attention_forward(module, q, kk, vv, mask, **extra)
                self.assertTrue(fell_back)
                self.assertTrue(torch.equal(got, expected))

    def test_short_contexts_are_sdpa_unchanged(self):
        torch.manual_seed(3)
        heads, dim = 4, 32  # 512 bytes of float32 keys per token and request
        fold_from = rows.FOLD_FROM_BYTES // (heads * dim * 4)
        q = torch.randn(2, 8, 1, dim)
        for tokens, folds in ((fold_from - 1, False), (fold_from, True)):
            with self.subTest(tokens=tokens):
                k = token_major(2, tokens, heads, dim, torch.float32)
                v = token_major(2, tokens, heads, dim, torch.float32)
                _, fell_back = self.folded(Attention(2), q, k, v, None, fold_from=rows.FOLD_FROM_BYTES)
                self.assertEqual(fell_back, not folds)

    def test_a_row_holds_the_fewest_heads_that_reach_row_bytes(self):
        self.assertEqual(rows.ROW_BYTES, 256)
        self.assertEqual(rows.row_group(4, 32, 4), 2)  # 2 x 32 float32 = 256 bytes
        self.assertEqual(rows.row_group(8, 128, 2), 1)  # one bf16 head of 128 is 256 bytes
        self.assertEqual(rows.row_group(8, 16, 2), 8)  # 8 x 32 bytes: all of them
        self.assertEqual(rows.row_group(6, 16, 4), 6)  # 4 x 64 bytes, but 4 does not divide 6
        self.assertEqual(rows.row_group(2, 16, 4), 2)  # short of 256 bytes even together


if __name__ == "__main__":
    unittest.main()
