"""Hugging Face transformers on strata: `StrataCache`, a KV cache whose tensors live in a strata
KV space (`strata.kv`).

    from transformers import AutoModelForCausalLM
    from strata.transformers import StrataCache

    cache = StrataCache(model.config, max_cache_len=4096)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=1024)
    cache.stats()        # tokens held, KV bytes mapped, pages, tier traffic
    cache.close()        # the space's pages and address ranges go back

Supported: transformers >= 5.0, < 6 (tested with 5.23), decoder models whose layers are full
attention (Llama, Mistral, Qwen2, Mixtral, ...; sliding-window or chunked layers only where the
window is at least `max_cache_len`, which makes them full attention).

Layout. One KV space per cache: for each layer a K and a V tensor of shape
`[batch, max_cache_len, kv_heads, head_dim]` (strata's `[request, token, head, dim]`), each batch
row one strata request. A page of one (layer, K/V) tensor holds `page_size / (kv_heads ×
head_dim × element size)` consecutive tokens of one sequence, all heads together (2 MiB pages of
a Llama-3-8B layer in bf16: 1024 tokens). So a short sequence maps one page per layer and K/V,
never one per head; pages are mapped as the sequence grows (`strata_kv_append`: every layer's
pages for those tokens at once), and the space's whole address range is reserved once, so the
tensors' addresses never move: CUDA graphs and compiled code may bake them in, as with
`StaticCache`, while memory follows the tokens held, as with `DynamicCache`.

`update` writes the new tokens in place and returns views of the filled prefix, transposed to
transformers' `[batch, kv_heads, tokens, head_dim]` (strided; no concatenation, no copy of old
tokens). All rows of a batch hold the same number of positions (left padding is part of the
sequence, masked by the model). `crop` lowers the held length and returns the pages past the
tokens kept (`strata_kv_truncate`; the page holding the last kept token stays); `reset` releases
every request's pages; `close` releases the space. The addresses stay through all three.

Attention. GPU kernels read the `[batch, kv_heads, tokens, head_dim]` views with their stride as
is. Torch's CPU kernels read short head rows of them slowly, so on the CPU set the model's
attention to "strata_sdpa" (registered on import): decode steps then read adjacent heads' rows
together (`strata._row_attention`), everything else is transformers' "sdpa" unchanged:

    model.set_attn_implementation("strata_sdpa")

The tensors are DLPack exports of strata memory (CUDA tensors on the CUDA backend, CPU tensors
on the host backend outside strict mode). Errors are strata's typed exceptions
(`strata.InvalidArgument`, `strata.OutOfMemory`, `strata.InvalidState`, `strata.Unsupported`).
"""

import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from . import _lib, kv
from ._row_attention import NAME as ATTENTION  # registers attn_implementation="strata_sdpa"

__all__ = ["ATTENTION", "StrataCache", "StrataLayer"]

_WINDOWED = ("sliding_attention", "chunked_attention")


def _checked_space(torch_device_type, **config):
    """A new `kv.KvSpace` of `config` whose tensors torch can use on `torch_device_type`."""
    space = kv.KvSpace(**config)
    try:
        probe = space.tensor(0, "k")
        if probe.dlpack_device_type == 0:
            raise _lib.error(
                9,
                "strata's KV memory is not CPU-accessible here (the strict host backend, "
                "STRATA_HOST_STRICT=1): torch cannot read it",
            )
        kind = {1: "cpu", 2: "cuda"}[probe.dlpack_device_type]
        if kind != torch_device_type:
            raise _lib.error(
                9,
                f"the model runs on {torch_device_type} but strata's KV memory is {kind} "
                f"memory (STRATA_BACKEND)",
            )
    except BaseException:
        space.close()
        raise
    return space


class StrataLayer(CacheLayerMixin):
    """One layer of a `StrataCache`: views of the layer's K and V tensors in the cache's space."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.length = 0
        self._k = self._v = None  # [batch, max_cache_len, heads, dim]: the space's tensors

    def lazy_initialization(self, key_states, value_states):
        self._cache._initialize(key_states, value_states)
        self._k, self._v = self._cache._tensors(self.layer_idx)
        self.dtype, self.device = self._k.dtype, self._k.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        if end > self._cache._mapped:
            self._cache._hold(end)
        self._k[:, start:end].copy_(key_states.transpose(1, 2))
        self._v[:, start:end].copy_(value_states.transpose(1, 2))
        self._set_length(end)
        return self.keys, self.values

    def _set_length(self, n):
        self.length = n
        self.keys = self._k[:, :n].transpose(1, 2)
        self.values = self._v[:, :n].transpose(1, 2)

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return self._cache.max_cache_len

    def reset(self):
        if self.is_initialized:
            self._set_length(0)

    def crop(self, tokens_to_remove):
        if tokens_to_remove > 0:
            raise _lib.error(
                3,
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove "
                "(as transformers' DynamicCache)",
            )
        if self.is_initialized and tokens_to_remove:
            self._set_length(max(0, self.length + tokens_to_remove))

    def reorder_cache(self, beam_idx):
        """Beam search: row i takes row beam_idx[i]'s tokens, in place (a gather of the held
        prefix; the addresses stay)."""
        if not self.length:
            return
        idx = beam_idx.to(self._k.device)
        for t in (self._k, self._v):
            held = t[:, : self.length]
            held.copy_(held.index_select(0, idx))

    def batch_repeat_interleave(self, repeats):
        if self.length:
            raise _lib.error(9, "StrataCache has a fixed batch: expand the inputs, not a filled cache")

    def batch_select_indices(self, indices):
        if self.length:
            raise _lib.error(9, "StrataCache has a fixed batch: it cannot drop rows of a filled cache")

    def offload(self):
        """transformers' own offloading copies tensors to the CPU; strata tiers the space instead."""

    def prefetch(self):
        """See `offload`."""

    def _release(self):
        self._k = self._v = self.keys = self.values = None
        self.length = 0
        self.is_initialized = False


class StrataCache(Cache):
    """A transformers `Cache` on a strata KV space reserved for `max_cache_len` tokens per row.

    The space is created on the first `update` (or `early_initialization`), when the batch size,
    KV heads, head dim, dtype and device are known. `device` is the strata device for CPU
    tensors (the host backend); CUDA tensors use their own device's index. `host_bytes`,
    `disk_bytes` and `disk_dir` give the space host and disk tiers (`strata.kv.KvSpace`).
    `on_out_of_memory(pages_short, device=...)` is called when the pool cannot map the pages the
    next tokens need; when it returns True (it made pages free, e.g. `strata.mirage.reclaim`)
    the mapping is tried again, else `strata.OutOfMemory` is raised.
    """

    def __init__(
        self,
        config,
        max_cache_len,
        device=0,
        host_bytes=0,
        disk_bytes=0,
        disk_dir=None,
        on_out_of_memory=None,
    ):
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise _lib.error(3, f"max_cache_len {max_cache_len!r}: a positive int")
        text = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        for i, (kind, kw) in enumerate(zip(types, kwargs)):
            window = kw.get("sliding_window")
            windowed_as_full = kind in _WINDOWED and window is not None and window >= max_cache_len
            if kind != "full_attention" and not windowed_as_full:
                raise _lib.error(
                    9,
                    f"layer {i} is {kind!r} (window {window}): StrataCache holds full-attention "
                    f"layers (or windows of at least max_cache_len = {max_cache_len})",
                )
        self.max_cache_len = max_cache_len
        self._device = device
        self._tiers = dict(host_bytes=host_bytes, disk_bytes=disk_bytes, disk_dir=disk_dir)
        self._space = None
        self._on_out_of_memory = on_out_of_memory
        self._requests = []  # batch row i -> the request at slot i
        self._held = []  # tokens appended per request
        self._mapped = 0  # every request holds this many (update's fast path: no call below it)
        self._closed = False
        super().__init__(layers=[StrataLayer(self, i) for i in range(len(types))])

    # ---- the space ------------------------------------------------------------------------

    def _live(self):
        if self._closed:
            raise _lib.error(7, "this StrataCache is closed")

    def _initialize(self, key_states, value_states):
        self._live()
        batch, heads, _, dim = key_states.shape
        if tuple(value_states.shape[:2]) + (value_states.shape[-1],) != (batch, heads, dim):
            raise _lib.error(
                9,
                f"K {tuple(key_states.shape)} and V {tuple(value_states.shape)} differ in batch, "
                "heads or head dim: StrataCache keeps them in one space of one shape",
            )
        if self._space is not None:
            if (batch, heads, dim, key_states.dtype) != self._shape:
                raise _lib.error(
                    3,
                    f"batch {batch}, {heads} KV heads of {dim} ({key_states.dtype}) do not match "
                    f"this cache's {self._shape}: use a new StrataCache",
                )
            return
        device = key_states.device.index if key_states.device.type == "cuda" else self._device
        self._space = self._open_space(batch, heads, dim, key_states.dtype, device, key_states.device.type)
        self._space_device = device
        self._shape = (batch, heads, dim, key_states.dtype)
        self._tokens_per_page = self._space.stats()["tokens_per_block"]

    def _open_space(self, batch, heads, dim, dtype, device, torch_device_type):
        """The KV space of every layer (`strata.transformers.OffloadedStrataCache`: one per layer)."""
        return _checked_space(
            torch_device_type,
            layers=len(self.layers),
            kv_heads=heads,
            head_dim=dim,
            dtype=str(dtype),
            max_requests=batch,
            max_tokens=self.max_cache_len,
            device=device,
            **self._tiers,
        )

    def _tensors(self, layer):
        return tuple(torch.from_dlpack(self._space.tensor(layer, kind)) for kind in ("k", "v"))

    def _hold(self, tokens):
        """Every row holds at least `tokens` positions (pages mapped in every layer)."""
        self._live()
        if tokens > self.max_cache_len:
            raise _lib.error(
                3,
                f"{tokens} tokens do not fit: this StrataCache was reserved for max_cache_len = "
                f"{self.max_cache_len} per sequence",
            )
        if not self._requests:
            self._admit()
        upto = self._rows_upto(tokens)
        for i, r in enumerate(self._requests):
            if self._held[i] < tokens:
                self._append(r, self._held[i], upto)
                self._held[i] = upto
        self._mapped = upto

    def _rows_upto(self, tokens):
        """The tokens each row is counted as holding when it holds `tokens`. Whole pages at a
        time, so the next tokens up to the page's end need no call, unless the space has a host
        or disk tier: there a page counted full keeps its lower-tier copy as clean when it is
        restored, and a later spill would copy nothing of the tokens written since, so rows
        count exactly the tokens held."""
        if self._tiers["host_bytes"] or self._tiers["disk_bytes"]:
            return tokens
        page = self._tokens_per_page
        return min(-(-tokens // page) * page, self.max_cache_len)

    def _append(self, request, held, upto):
        while True:
            try:
                request.append(upto - held)
                return
            except _lib.OutOfMemory:
                if self._on_out_of_memory is None:
                    raise
                page = self._tokens_per_page
                pages = (-(-upto // page) - -(-held // page)) * 2 * len(self.layers)
                short = max(1, pages - self._space.stats()["pool_free_pages"])
                if not self._on_out_of_memory(short, device=self._space_device):
                    raise

    def _unhold(self, tokens):
        """Every row keeps the pages of its first `tokens` positions; the pages past them go
        back to the pool."""
        upto = self._rows_upto(tokens)
        for i, r in enumerate(self._requests):
            if self._held[i] > upto:
                r.truncate(upto)
                self._held[i] = upto
        self._mapped = min(self._mapped, upto)

    def _admit(self):
        batch = self._shape[0]
        self._requests = self._space.admit_many(batch)
        self._held = [0] * batch

    def _release_requests(self):
        requests, self._requests, self._held, self._mapped = self._requests, [], [], 0
        for r in requests:
            r.release()

    # ---- transformers' Cache --------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._live()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def crop(self, tokens_to_remove):
        """As DynamicCache's (a negative count of tokens to remove); the pages past the tokens
        kept go back to the pool (the addresses stay)."""
        self._live()
        super().crop(tokens_to_remove)
        if self._requests:
            self._unhold(max(layer.length for layer in self.layers))

    def reset(self):
        """Every row empty; the requests' pages go back to the pool (the addresses stay)."""
        self._live()
        super().reset()
        self._release_requests()

    # ---- strata ---------------------------------------------------------------------------

    @property
    def space(self):
        """The `strata.kv.KvSpace` (None before the first update)."""
        return self._space

    def data_ptrs(self):
        """(K, V) base addresses of each layer's tensors (fixed for the cache's life)."""
        return [(l._k.data_ptr(), l._v.data_ptr()) for l in self.layers if l.is_initialized]

    def stats(self):
        """Tokens held and what they cost: `tokens` (per row), `token_bytes` (the KV of the tokens
        held, all rows and layers), `kv_bytes` (mapped for them: whole pages), `pages`, and the
        space's figures (`strata_kv_stats_t`: tier occupancy, bytes moved, prefetch hits, ...)."""
        if self._space is None:
            return {"tokens": 0, "token_bytes": 0, "kv_bytes": 0, "pages": 0}
        s = self._space.stats()
        tokens = self.get_seq_length()
        layers = len(self.layers)
        s.update(
            tokens=tokens,
            token_bytes=2 * layers * len(self._held) * tokens * self._space.bytes_per_token,
            kv_bytes=s["blocks_resident"] * s["block_bytes"],
            pages=s["blocks_resident"] * 2 * layers,
        )
        return s

    def close(self):
        """Releases the space. Views the caller still holds keep it alive: then
        `strata.InvalidState`, and the cache is left empty but usable."""
        if self._closed:
            return
        if self._space is not None:
            for layer in self.layers:
                layer._release()
            self._release_requests()
            self._space.close()
            self._space = None
        self._closed = True

    def __del__(self):
        # A cache dropped without close(): give the space back, or say why not.
        if getattr(self, "_closed", True) or getattr(self, "_space", None) is None:
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - a finalizer cannot raise
            warnings.warn(f"StrataCache dropped without close(); closing failed: {e}", ResourceWarning)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Tiered offload (one KV space per layer, Pie's swapping) lives in its own module.
from ._offload import OffloadedStrataCache  # noqa: E402

__all__.append("OffloadedStrataCache")
