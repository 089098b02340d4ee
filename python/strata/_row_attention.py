"""`attn_implementation="strata_sdpa"`: transformers' SDPA attention, except for one query token
on the CPU over K/V stored token-major, as `StrataCache` holds them.

`StrataCache` keeps a token's heads of each layer and row together (`[batch, token, head, dim]` in
its "request" layout; in its "token" layout a token's row holds those of every layer and row) and
hands the model `[batch, head, token, dim]` views of them: head `h`'s keys are rows of `dim`
elements, `heads × dim` apart or more. GPU attention kernels read that stride as is. Torch's CPU
flash attention reads one head at a time, and when a head's row is short (32 float32 = 128 bytes)
decode attention at a 2048-token context took 2.3× as long as over contiguous K/V (BENCHMARKS.md),
most likely because the CPU's prefetchers fetch the neighbouring heads' rows too.

Here a decode step reads `group` adjacent heads' rows as one row of `group × dim` elements (at
least `ROW_BYTES` long): the keys become `[batch, heads / group, token, group × dim]`, a view of
the same memory, and each query head becomes a row of `group × dim` elements that is zero outside
its own KV head's `dim` (a block-diagonal query). A head's score then adds only exact zeros for the
other heads' elements, and its output is its own block of the `group × dim` output row. Grouped
query heads ride along as extra query rows, so K/V are read once per group, not once per query
head. The extra multiply-adds (`group`×) are cheap next to the memory reads of decode attention.

Everything else (prefill, CUDA tensors, contiguous K/V such as DynamicCache's, masks that differ
per head, position bias, softcap, dropout) goes to transformers' `sdpa_attention_forward`
unchanged, so "strata_sdpa" is a drop-in replacement for "sdpa" on any cache:

    model.set_attn_implementation("strata_sdpa")     # or from_pretrained(..., attn_implementation=...)
"""

import functools
import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "strata_sdpa"
ROW_BYTES = 256  # the shortest row read per group: 128-byte head rows are what read slowly
# One request's keys of a layer (tokens x heads x dim x element size) from which decode folds.
# Below it the stride costs little and the fold's extra work more than it saves: on the 2-vCPU
# development VM the fold lost 4 % at 512 tokens of 4 x 32 float32 heads (256 KiB) and won 20 %
# at 1024 (`python -m strata.examples.bench_attention`, BENCHMARKS.md).
FOLD_FROM_BYTES = 256 << 10


def row_group(heads, dim, itemsize):
    """How many adjacent KV heads one folded row holds: the fewest (a divisor of `heads`) whose
    rows together are at least `ROW_BYTES`, else all of them."""
    for group in range(1, heads + 1):
        if heads % group == 0 and group * dim * itemsize >= ROW_BYTES:
            return group
    return heads


@functools.lru_cache(maxsize=32)
def _block_diagonal(group, dtype, device):
    """Ones where a query head meets its own KV head in a folded row, zeros elsewhere (shaped to
    broadcast over `[batch, groups, group, rep, group, dim]`)."""
    return torch.eye(group, dtype=dtype, device=device).view(1, 1, group, 1, group, 1)


def _token_major(t):
    """`t` ([batch, heads, tokens, dim]) is a view of memory whose heads of one token are one
    contiguous row of `heads × dim` elements, tokens and batch rows at any stride (StrataCache's
    "request" layout: `[batch, tokens, heads, dim]`; its "token" layout: tokens of every row and
    layer interleaved)."""
    _, heads, tokens, dim = t.shape
    return t.stride(3) == 1 and t.stride(1) == dim and (tokens == 1 or t.stride(2) >= heads * dim)


def _foldable(query, key, value, attention_mask, dropout, kwargs):
    # The cheap tests first: most calls that go to SDPA are prefill or a short context.
    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1:
        return False
    _, heads, tokens, dim = key.shape
    if tokens * heads * dim * key.element_size() < FOLD_FROM_BYTES or query.device.type != "cpu":
        return False
    if dropout or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache", "s_aux")):
        return False
    if kwargs.get("output_attentions"):
        return False
    if key.shape != value.shape or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if dim != query.shape[-1] or query.shape[1] % heads:
        return False
    if not (_token_major(key) and _token_major(value)):
        return False
    # A mask shared by all heads and the one query broadcasts over the folded rows.
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))


def row_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention-function contract: returns (`[batch, 1, query heads, dim]`, None)."""
    if not _foldable(query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    batch, q_heads, _, dim = query.shape
    heads, tokens = key.shape[1], key.shape[2]
    rep = q_heads // heads
    group = row_group(heads, dim, query.element_size())
    groups = heads // group
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)

    def rows(t):  # [batch, heads, tokens, dim] -> [batch, groups, tokens, group x dim], a view
        return t.transpose(1, 2).view(batch, tokens, groups, group * dim).transpose(1, 2)

    if group == 1:
        folded = query.reshape(batch, heads, rep, dim)
    else:
        # [batch, groups, group, rep, group, dim]: each query head's row is zero outside its
        # own KV head's block.
        ones = _block_diagonal(group, query.dtype, query.device)
        folded = query.reshape(batch, groups, group, rep, 1, dim) * ones
        folded = folded.view(batch, groups, group * rep, group * dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, rows(key), rows(value), attn_mask=attention_mask, scale=scale
    )
    if group > 1:
        out = torch.diagonal(out.view(batch, groups, group, rep, group, dim), dim1=2, dim2=4)
        out = out.permute(0, 1, 4, 2, 3)  # [batch, groups, group, rep, dim]: query-head order
    return out.reshape(batch, 1, q_heads, dim).contiguous(), None


AttentionInterface.register(NAME, row_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
