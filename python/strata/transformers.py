"""Hugging Face transformers on strata: `StrataCache`, a KV cache whose tensors live in a strata
KV space (`strata.kv`).

    from transformers import AutoModelForCausalLM
    from strata.transformers import StrataCache

    cache = StrataCache(model.config, max_cache_len=4096)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=1024)
    cache.stats()        # tokens held, KV bytes mapped, pages, tier traffic
    cache.close()        # the space's pages and address ranges go back

Supported: transformers `TRANSFORMERS_VERSIONS` (CI tests the oldest and the newest; importing this
module with another version raises `strata.Unsupported` naming the range), decoder models whose layers are full
attention (Llama, Mistral, Qwen2, Mixtral, ...; sliding-window or chunked layers only where the
window is at least `max_cache_len`, which makes them full attention).

Layout. One KV space per cache, reserved once for `max_cache_len` tokens per row, so the
tensors' addresses never move: CUDA graphs and compiled code may bake them in, as with
`StaticCache`, while memory follows the tokens held, as with `DynamicCache`. Pages are mapped
as the sequences grow (`strata_kv_append`: every tensor's pages for those tokens at once).
`layout` says what one page holds (`strata._layout`):
- "token": a token range of every batch row and as many layers as fit evenly (a slot's token
  row is `[layers_per_page, rows, kv_heads, head_dim]`: every layer and row when that row
  divides the page, as powers of two do, else every layer of one row). The cache then wastes at
  most one partly filled page per K/V and group of layers: with 2 MiB pages, issue 27's H200
  shape (16 layers, 8 KV heads of 128, bf16, batch 4, 1151 tokens) maps 1.001× the KV of the
  tokens held, where "request" maps 1.78×.
- "request": one batch row of one (layer, K/V) tensor, `page_size / (kv_heads × head_dim ×
  element size)` consecutive tokens of it, all heads together (1024 tokens of a Llama-3-8B
  layer in bf16), so each row, layer and K/V rounds up to its own page.
- "auto" (the default): "token" when its pages, summed over every length up to `max_cache_len`,
  cost less than "request"'s (whenever it groups anything), else "request".
Either way each layer's K and V are `[batch, max_cache_len, kv_heads, head_dim]` strided views.
`OffloadedStrataCache` keeps a page per (layer, row): a layer is its unit of residency.

`update` writes the new tokens in place and returns views of the filled prefix, transposed to
transformers' `[batch, kv_heads, tokens, head_dim]` (strided; no concatenation, no copy of old
tokens). All rows of a batch hold the same number of positions (left padding is part of the
sequence, masked by the model). `crop` lowers the held length and returns the pages past the
tokens kept (`strata_kv_truncate`; the page holding the last kept token stays); `reset` releases
every request's pages; `close` releases the space. The addresses stay through all three.

Compiled steps. `StrataCache(config, max_cache_len, compileable=True)` is compileable as
`StaticCache` is (`is_compileable`; `generate` then compiles the decode step on CUDA, or wherever
its `compile_config` says): `update` writes the new tokens at a position held in a device tensor
(`index_copy_`) and returns views of all `max_cache_len` positions, so the step has static shapes,
and its tensors are marked static addresses for the compiler. The step makes no host call: the
pages it writes are mapped before it, outside it, by `prepare(tokens)`, which keeps `margin`
tokens (default one page's worth) mapped past the tokens held. `generate` calls it for every
step through the attention mask it builds outside the compiled step (`get_mask_sizes`); a loop
of one's own calls `cache.prepare(new_tokens)` before each compiled step. Positions past the
mapped pages read the space's shared read-only zero page, so attention over `max_cache_len`
never touches unmapped memory; a write there faults (host backend) rather than corrupt it. So
compile with a backend that writes mutated inputs in place, as inductor (the default) does:
"aot_eager" writes every mutated tensor back whole, the tail included, and faults.
Why this cannot race: on the CPU the steps run in order on the calling thread; on CUDA a
`prepare` that maps pages first waits for the steps in flight (they read the tail whose backing
changes), which happens once per `margin` tokens, and the steps queued after it see the new
pages. Cost: the margin's pages (`margin` tokens of every row and layer, rounded up to whole pages:
one page per row, layer and K/V in the "request" layout), one stream synchronization per margin
on CUDA, and attention over all `max_cache_len` positions (masked), as `StaticCache`. The
first update (the prefill) runs eagerly; mixing host tiers with compileable is refused.

Attention. GPU kernels read the `[batch, kv_heads, tokens, head_dim]` views with their stride as
is. Torch's CPU kernels read short head rows of them slowly, so on the CPU set the model's
attention to "strata_sdpa" (registered on import): decode steps then read adjacent heads' rows
together (`strata._row_attention`), everything else is transformers' "sdpa" unchanged:

    model.set_attn_implementation("strata_sdpa")

The "token" layout's longer token stride is slower still on the CPU (decode steps 1.1-1.5× the
"request" layout's at 1024 tokens, BENCHMARKS.md): there `layout="request"` is the fast choice
where memory is not the constraint.

The tensors are DLPack exports of strata memory (CUDA tensors on the CUDA backend, CPU tensors
on the host backend outside strict mode). Errors are strata's typed exceptions
(`strata.InvalidArgument`, `strata.OutOfMemory`, `strata.InvalidState`, `strata.Unsupported`).
"""

import warnings

import torch
import transformers
from packaging.version import Version

from . import _layout, _lib, kv
from . import stats as _strata_stats

# The transformers versions StrataCache runs on: the oldest 5.x whose cache interface it fits
# (5.x before it lack pieces StrataCache uses) through the last 5.x tested; 6 may change the
# cache interface again. `.ci/run` tests both ends.
TRANSFORMERS_VERSIONS = ">=5.0,<6"
OLDEST, BEFORE = Version("5.0"), Version("6")


def _check_version(version):
    """Refuses a transformers version outside `TRANSFORMERS_VERSIONS` (strata.Unsupported)."""
    if not OLDEST <= Version(version) < BEFORE:
        raise _lib.error(
            _lib.Status.UNSUPPORTED,
            f"strata.transformers supports transformers {TRANSFORMERS_VERSIONS}; this is transformers "
            f"{version} (pip install 'transformers{TRANSFORMERS_VERSIONS}')",
        )


_check_version(transformers.__version__)

from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from ._row_attention import NAME as ATTENTION  # noqa: E402 - registers attn_implementation="strata_sdpa"

__all__ = ["ATTENTION", "StrataCache", "StrataLayer", "TRANSFORMERS_VERSIONS"]

_WINDOWED = ("sliding_attention", "chunked_attention")


def _layer_types(config):
    """[(layer type, window or None)] of a text config, as transformers' caches read it
    (`layer_types`, else every layer sliding with `sliding_window`, chunked with
    `attention_chunk_size`, or full); transformers' own helper for this changed its return type
    between 5.x versions."""
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None else "full_attention"
        types = [kind] * config.num_hidden_layers
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    if shared:
        types = types[:-shared]
    return [(t, chunk if t == "chunked_attention" else window if t == "sliding_attention" else None) for t in types]


def _shape_of(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _torch_tensor(t):
    """A torch view of the `kv.KvTensor` `t` whose storage covers all of its strided extent."""
    return torch.from_dlpack(t.flat()).as_strided(t.shape, [s // t.elem_size for s in t.byte_strides])


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


def _kept(length, tokens):
    """The tokens `crop(tokens)` keeps of `length`: a negative count removes that many (as
    transformers >= 5.17 crops), a positive one keeps that many (as transformers' caches before
    5.23 and their assisted generation took it), 0 keeps everything."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise _lib.error(3, f"crop({tokens!r}): an int (negative: tokens to remove; positive: tokens to keep)")
    if tokens < 0:
        return max(0, length + tokens)
    return min(length, tokens) if tokens else length


class StrataLayer(CacheLayerMixin):
    """One layer of a `StrataCache`: views of the layer's K and V tensors in the cache's space.

    Two modes. By default `update` returns views of the filled prefix (shapes grow with the
    tokens, as DynamicCache's). With `StrataCache(compileable=True)` it returns views of all
    `max_cache_len` positions and writes the new tokens at a position kept in a device tensor
    (`index_copy_`, as StaticCache), so a compiled step has static shapes and makes no host
    call; the pages it writes were mapped ahead by the cache (`StrataCache.prepare`)."""

    is_croppable = True
    is_sliding = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self._cache = cache
        self.is_compileable = cache._compileable
        self.layer_idx = layer_idx
        self.length = 0  # tokens held (compileable: as of the last host-side read of _pos)
        self._k = self._v = None  # [batch, max_cache_len, heads, dim]: the space's tensors
        self._pos = None  # compileable: tokens held, a device tensor the compiled step advances

    def lazy_initialization(self, key_states, value_states):
        self._cache._initialize(key_states, value_states)
        self._k, self._v = self._cache._tensors(self.layer_idx)
        self.dtype, self.device = self._k.dtype, self._k.device
        if self.is_compileable:
            self._pos = torch.zeros((), dtype=torch.long, device=self.device)
            self.keys, self.values = self._k.transpose(1, 2), self._v.transpose(1, 2)
            # Fixed addresses: the compiler may bake them in (as StaticCache marks its tensors).
            if not torch.compiler.is_compiling():
                for t in (self._k, self._v, self._pos):
                    torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.is_compileable:
            return self._update_static(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        if end > self._cache._mapped:
            self._cache._hold(end)
        self._k[:, start:end].copy_(key_states.transpose(1, 2))
        self._v[:, start:end].copy_(value_states.transpose(1, 2))
        self._set_length(end)
        return self.keys, self.values

    def _update_static(self, key_states, value_states):
        tokens = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            # Eager (a prefill, or a step not compiled): map here, with the margin after it.
            self._cache._map_ahead(self._held() + tokens)
        where = torch.arange(tokens, device=self._pos.device) + self._pos
        self._k.index_copy_(1, where, key_states.transpose(1, 2))
        self._v.index_copy_(1, where, value_states.transpose(1, 2))
        self._pos.add_(tokens)
        # Views made here, not the `keys`/`values` attributes: a step whose inputs alias (two
        # views of one tensor, one of them written) is compiled with the whole tensor written
        # back, the tail on the zero page included; one input per tensor keeps the write to the
        # positions at `where`.
        return self._k.transpose(1, 2), self._v.transpose(1, 2)

    def _held(self):
        """Tokens held, read on the host (compileable: from the device tensor; a sync on CUDA)."""
        if self._pos is not None:
            self.length = int(self._pos)
        return self.length

    def _set_length(self, n):
        self.length = n
        if self._pos is not None:
            self._pos.fill_(n)
            return
        self.keys = self._k[:, :n].transpose(1, 2)
        self.values = self._v[:, :n].transpose(1, 2)

    def get_mask_sizes(self, query_length):
        if self.is_compileable:
            return self._cache.max_cache_len, 0
        # transformers < 5.10 passes the new tokens' cache positions, later versions their count.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def get_seq_length(self):
        if self._pos is not None and torch.compiler.is_compiling():
            return self._pos  # a tensor: an int would be baked into the compiled step
        return self._held()

    def get_max_length(self):
        return self._cache.max_cache_len

    get_max_cache_shape = get_max_length  # its name before transformers 5.13

    def reset(self):
        if self.is_initialized:
            self._set_length(0)

    def crop(self, tokens):
        if self.is_initialized:
            self._set_length(_kept(self._held(), tokens))

    def reorder_cache(self, beam_idx):
        """Beam search: row i takes row beam_idx[i]'s tokens, in place (a gather of the held
        prefix; the addresses stay)."""
        held = self._held() if self.is_initialized else 0
        if not held:
            return
        idx = beam_idx.to(self._k.device)
        for t in (self._k, self._v):
            rows = t[:, :held]
            rows.copy_(rows.index_select(0, idx))

    def batch_repeat_interleave(self, repeats):
        if self.is_initialized and self._held():
            raise _lib.error(9, "StrataCache has a fixed batch: expand the inputs, not a filled cache")

    def batch_select_indices(self, indices):
        if self.is_initialized and self._held():
            raise _lib.error(9, "StrataCache has a fixed batch: it cannot drop rows of a filled cache")

    def offload(self):
        """transformers' own offloading copies tensors to the CPU; strata tiers the space instead."""

    def prefetch(self):
        """See `offload`."""

    def _release(self):
        self._k = self._v = self.keys = self.values = self._pos = None
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

    `compileable=True` gives the decode step static shapes and no host call (the module
    documentation, "Compiled steps"): transformers' `generate` then compiles it as it compiles
    StaticCache's. `margin` (tokens, default one page's worth, at least 64) is what stays mapped
    past the tokens held; it needs no host or disk tier.

    `layout` ("auto", "token" or "request"; else `strata.InvalidArgument`) says what a page holds
    (the module documentation, "Layout"); `cache.layout` is the one chosen, from the first
    update on. "token" where no rows or layers can share a page is `strata.InvalidArgument` at
    the first update.
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
        compileable=False,
        margin=None,
        layout="auto",
    ):
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise _lib.error(3, f"max_cache_len {max_cache_len!r}: a positive int")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int) or margin < 1):
            raise _lib.error(3, f"margin {margin!r}: a positive number of tokens")
        if compileable and (host_bytes or disk_bytes):
            raise _lib.error(
                3,
                "compileable=True needs a cache without host or disk tiers (a spilled page reads "
                "as zeros, and a compiled step would write into it)",
            )
        types = _layer_types(config.get_text_config(decoder=True))
        for i, (kind, window) in enumerate(types):
            windowed_as_full = kind in _WINDOWED and window is not None and window >= max_cache_len
            if kind != "full_attention" and not windowed_as_full:
                raise _lib.error(
                    9,
                    f"layer {i} is {kind!r} (window {window}): StrataCache holds full-attention "
                    f"layers (or windows of at least max_cache_len = {max_cache_len})",
                )
        self._layout_choice = _layout.checked_choice(layout)
        self._layout = None  # the `_layout.Layout`, once the first update gives the shapes
        self._space_tensors = {}  # (space layer, kind) -> its torch tensor (zeroed whole per margin)
        self._max_cache_len = max_cache_len
        self._compileable = bool(compileable)
        self._margin = margin
        self._bound = 0  # compileable: an upper bound of the tokens held (prepare's fast path)
        self._device = device
        self._tiers = dict(host_bytes=host_bytes, disk_bytes=disk_bytes, disk_dir=disk_dir)
        self._space = None
        self._on_out_of_memory = on_out_of_memory
        self._requests = []  # the space's requests (a batch row each, or all rows: the layout's)
        self._held = []  # tokens appended per request
        self._mapped = 0  # every request holds this many (update's fast path: no call below it)
        self._closed = False
        super().__init__(layers=[StrataLayer(self, i) for i in range(len(types))])

    @property
    def max_cache_len(self):
        """Tokens reserved per sequence (transformers < 5.23 has a read-only property of this name
        on `Cache`; this one overrides it)."""
        return self._max_cache_len

    # ---- the space ------------------------------------------------------------------------

    def _live(self):
        if self._closed:
            raise _lib.error(7, "this StrataCache is closed")

    def _check_states(self, key_states, value_states):
        """Every update: K and V are `[batch, heads, tokens, dim]` of the cache's batch, heads, head
        dim, dtype and device (checked before anything is written, so a refused update leaves the
        cache as it was; a batch-1 step must not broadcast into every row, nor another dtype be cast
        silently)."""
        for name, t in (("K", key_states), ("V", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise _lib.error(
                    3, f"{name} states must be a 4-d tensor [batch, kv_heads, tokens, head_dim], not {_shape_of(t)}"
                )
        batch, heads, tokens, dim = key_states.shape
        if tuple(value_states.shape) != (batch, heads, tokens, dim) or value_states.dtype != key_states.dtype:
            raise _lib.error(
                3,
                f"K {tuple(key_states.shape)} {key_states.dtype} and V {tuple(value_states.shape)} "
                f"{value_states.dtype} differ: StrataCache keeps them in one space of one shape and dtype",
            )
        if self._space is None:
            return
        want_batch, want_heads, want_dim, want_dtype = self._shape
        got = dict(batch=batch, kv_heads=heads, head_dim=dim, dtype=key_states.dtype, device=key_states.device)
        want = dict(batch=want_batch, kv_heads=want_heads, head_dim=want_dim, dtype=want_dtype, device=self._torch_device)
        differ = [f"{k} {got[k]} (this cache: {want[k]})" for k in got if got[k] != want[k]]
        if differ:
            raise _lib.error(
                3,
                f"update of {', '.join(differ)}: a StrataCache keeps the batch, KV heads, head dim, dtype "
                "and device of its first update; use a new StrataCache (or reset() and a new one for "
                "another batch)",
            )

    def _initialize(self, key_states, value_states):
        self._live()
        self._check_states(key_states, value_states)
        if self._space is not None:
            return
        batch, heads, _, dim = key_states.shape
        device = key_states.device.index if key_states.device.type == "cuda" else self._device
        row_bytes = heads * dim * key_states.element_size()
        # One slot per row and layer unless `_open_space` groups them (OffloadedStrataCache's
        # space of (layer, row) requests is laid out so).
        self._layout = _layout.Layout(len(self.layers), batch, heads, row_bytes)
        self._space = self._open_space(batch, heads, dim, key_states.dtype, device, key_states.device.type)
        self._space_device = device
        self._shape = (batch, heads, dim, key_states.dtype)
        self._torch_device = key_states.device
        self._tokens_per_page = self._space.stats()["tokens_per_block"]
        if self._margin is None:
            self._margin = max(self._tokens_per_page, 64)

    def _open_space(self, batch, heads, dim, dtype, device, torch_device_type):
        """The KV space of every layer, laid out as `layout` chose (`_layout.plan`, with the
        device's page size)."""
        page = _strata_stats(device)["page_size"]
        row_bytes = self._layout.row_bytes
        self._layout = _layout.plan(
            self._layout_choice, len(self.layers), batch, heads, row_bytes, page, self.max_cache_len
        )
        return _checked_space(
            torch_device_type,
            layers=self._layout.space_layers,
            kv_heads=self._layout.space_heads,
            head_dim=dim,
            dtype=str(dtype),
            max_requests=self._layout.requests,
            max_tokens=self.max_cache_len,
            device=device,
            **self._tiers,
        )

    def _space_tensor(self, space_layer, kind):
        """The torch tensor of a (space layer, K/V) tensor, exported once (for zeroing)."""
        key = (space_layer, kind)
        if key not in self._space_tensors:
            self._space_tensors[key] = _torch_tensor(self._space.tensor(space_layer, kind))
        return self._space_tensors[key]

    def _tensors(self, layer):
        """Layer `layer`'s K and V, `[batch, max_cache_len, kv_heads, head_dim]` views, each of an
        export of its own. Layers that share a space tensor ("token" layout) interleave in memory
        but share no element; as views of one torch storage a compiled step would take them for
        aliases and write the whole storage back, the tail on the zero page included (a fault)."""
        where = self._layout.space_layer(layer)
        return tuple(
            self._layout.view(_torch_tensor(self._space.tensor(where, kind)), layer) for kind in ("k", "v")
        )

    def _hold(self, tokens):
        """Every row holds at least `tokens` positions (pages mapped in every layer)."""
        self._live()
        self._fits(tokens)
        if not self._requests:
            self._admit()
        upto = self._rows_upto(tokens)
        for i, r in enumerate(self._requests):
            if self._held[i] < tokens:
                self._append(r, self._held[i], upto)
                self._held[i] = upto
        self._mapped = upto

    def _fits(self, tokens):
        if tokens > self.max_cache_len:
            raise _lib.error(
                3,
                f"{tokens} tokens do not fit: this StrataCache was reserved for max_cache_len = "
                f"{self.max_cache_len} per sequence",
            )

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
                pages = (-(-upto // page) - -(-held // page)) * 2 * self._layout.space_layers
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

    # ---- compiled steps: pages mapped ahead ---------------------------------------------------

    def prepare(self, tokens=1):
        """Before a step that writes `tokens` tokens per row: their pages mapped, and the margin
        after them (compileable caches; a no-op otherwise). `generate` calls it for every step,
        through the attention mask it builds outside the compiled step (`get_mask_sizes`); a
        caller that runs a compiled step of its own calls it before each one. No call (and on
        CUDA no synchronization) while the margin still covers the step."""
        if not self._compileable or self._space is None:
            return
        self._live()
        self._bound += tokens
        if self._bound + self._margin <= self._mapped:
            return
        self._bound = max(layer._held() for layer in self.layers if layer.is_initialized) + tokens
        self._map_ahead(self._bound)

    def _map_ahead(self, end):
        """Rows hold pages through `end` tokens plus the margin (capped at max_cache_len); the
        pages mapped now are zeroed (pool pages come back with old bytes, and the compiled step's
        attention reads every position, masked or not). On CUDA the steps in flight finish first:
        they read the tail whose backing changes from the zero page to real pages."""
        self._fits(end)
        want = min(end + self._margin, self.max_cache_len)
        self._bound = max(self._bound, end)
        if want <= self._mapped:
            return
        if self._torch_device.type == "cuda":
            torch.cuda.current_stream(self._torch_device).synchronize()
        old = self._mapped
        self._hold(want)
        for space_layer in range(self._layout.space_layers):
            for kind in ("k", "v"):
                self._space_tensor(space_layer, kind)[:, old : self._mapped].zero_()

    def _admit(self):
        self._requests = self._space.admit_many(self._layout.requests)
        self._held = [0] * len(self._requests)

    def _release_requests(self):
        requests, self._requests, self._held, self._mapped = self._requests, [], [], 0
        for r in requests:
            r.release()

    # ---- transformers' Cache --------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._live()
        self._check_states(key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def crop(self, tokens):
        """`crop(-n)` removes the last n tokens (transformers >= 5.17), `crop(n)` with n > 0 keeps the
        first n (transformers' caches before 5.23 and their assisted generation); the pages past
        the tokens kept go back to the pool (the addresses stay)."""
        self._live()
        _kept(0, tokens)  # refuse a non-int before any layer changes
        super().crop(tokens)
        if self._requests:
            kept = max(layer._held() for layer in self.layers)
            if self._compileable:
                self._bound = kept
                kept = min(kept + self._margin, self.max_cache_len)
            self._unhold(kept)

    def reset(self):
        """Every row empty; the requests' pages go back to the pool (the addresses stay)."""
        self._live()
        super().reset()
        self._release_requests()
        if self._compileable and self._space is not None:
            self._bound = 0
            self._map_ahead(0)  # a compiled step may come next

    def get_mask_sizes(self, query_length, layer_idx=0):
        """transformers' mask sizes; outside a compiled region, the hook that maps a compileable
        cache's pages ahead (`prepare`): `generate` builds the mask of a compileable cache's
        step before it runs the step."""
        if self._compileable and not torch.compiler.is_compiling():
            self.prepare(query_length if isinstance(query_length, int) else query_length.shape[0])
        return super().get_mask_sizes(query_length, layer_idx)

    # ---- strata ---------------------------------------------------------------------------

    @property
    def space(self):
        """The `strata.kv.KvSpace` (None before the first update)."""
        return self._space

    def data_ptrs(self):
        """(K, V) base addresses of each layer's tensors (fixed for the cache's life)."""
        return [(l._k.data_ptr(), l._v.data_ptr()) for l in self.layers if l.is_initialized]

    @property
    def layout(self):
        """"token" or "request" (`strata._layout`: what one page holds), None before the first
        update (the choice depends on the batch and the shapes)."""
        return None if self._space is None else self._layout.name

    def stats(self):
        """Tokens held and what they cost: `tokens` (per row), `token_bytes` (the KV of the tokens
        held, all rows and layers), `kv_bytes` (mapped for them: whole pages), `pages`,
        `rows_per_page` and `layers_per_page` (the layout: what a page holds tokens of), and the
        space's figures (`strata_kv_stats_t`: tier occupancy, bytes moved, prefetch hits, ...;
        a block is one page index of a request in every space tensor)."""
        if self._space is None:
            return {"tokens": 0, "token_bytes": 0, "kv_bytes": 0, "pages": 0}
        s = self._space.stats()
        tokens = self.get_seq_length()
        layout = self._layout
        s.update(
            tokens=tokens,
            token_bytes=2 * layout.layers * layout.batch * tokens * layout.row_bytes,
            kv_bytes=s["blocks_resident"] * s["block_bytes"],
            pages=s["blocks_resident"] * 2 * layout.space_layers,
            rows_per_page=layout.rows_per_page,
            layers_per_page=layout.layers_per_page,
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
            self._space_tensors = {}
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
