"""Where a `StrataCache` keeps its K and V in its KV space: the layouts, and the choice between them.

A KV space maps pages per (space layer, K/V) tensor and request slot, each page a run of
consecutive tokens of one slot (`strata.kv`). A layout decides what one token row of a slot holds:

- "request": one batch row of one model layer (`[heads, dim]`); a page holds `page / (heads ×
  dim × element size)` tokens, so every (row, layer, K/V) maps its own partly filled last page.
- "token": the same token of `rows_per_page` batch rows and `layers_per_page` layers
  (`[layers_per_page, rows_per_page, heads, dim]`), as many as divide the page evenly (every row
  and every layer where the sizes allow): a page holds a token range of all of them, so the
  cache wastes at most one partly filled page per (space layer, K/V, slot).

Either way each model layer's K and V are `[batch, max_len, heads, dim]` strided views of the
space's tensors (`view`), at fixed addresses; only their strides differ.
"""

from dataclasses import dataclass

from . import _lib

LAYOUTS = ("auto", "token", "request")


def checked_choice(layout):
    """`layout` if it is one of `LAYOUTS`, else strata.InvalidArgument."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise _lib.error(_lib.Status.INVALID_ARGUMENT, f"layout {layout!r}: one of {', '.join(map(repr, LAYOUTS))}")
    return layout


def _ceil_sum(tokens, per_page):
    """sum(ceil(t / per_page) for t in 1..tokens), in closed form."""
    full, rest = divmod(tokens, per_page)
    return per_page * full * (full + 1) // 2 + rest * (full + 1)


@dataclass(frozen=True)
class Layout:
    """`layers` model layers × `batch` rows of `heads × dim` elements (`row_bytes` per token), a
    slot's token row holding `layers_per_page` layers of `rows_per_page` rows."""

    layers: int
    batch: int
    heads: int
    row_bytes: int
    layers_per_page: int = 1
    rows_per_page: int = 1

    @property
    def name(self):
        return "request" if self.layers_per_page * self.rows_per_page == 1 else "token"

    @property
    def space_layers(self):
        return self.layers // self.layers_per_page

    @property
    def requests(self):
        """Request slots of the space: batch rows that do not share a token row."""
        return self.batch // self.rows_per_page

    @property
    def space_heads(self):
        """The space's `kv_heads`: the heads of one slot's token row."""
        return self.layers_per_page * self.rows_per_page * self.heads

    @property
    def slot_row_bytes(self):
        return self.layers_per_page * self.rows_per_page * self.row_bytes

    def mapped_bytes(self, tokens, page):
        """Bytes of the pages every slot maps to hold `tokens` tokens (K and V, all tensors)."""
        pages = -(-tokens * self.slot_row_bytes // page)
        return 2 * self.space_layers * self.requests * pages * page

    def mean_mapped_bytes(self, max_len, page):
        """`mapped_bytes` summed over every held length 1..max_len (the layout's cost when the
        length is anywhere up to the reservation), exact integers."""
        per_page = page // self.slot_row_bytes
        return 2 * self.space_layers * self.requests * _ceil_sum(max_len, per_page) * page

    def space_layer(self, layer):
        return layer // self.layers_per_page

    def view(self, tensor, layer):
        """Model layer `layer`'s `[batch, max_len, heads, dim]` view of `tensor`, the torch tensor
        of its space layer (`[requests, max_len, space_heads, dim]`)."""
        requests, tokens, _, dim = tensor.shape
        t = tensor.unflatten(2, (self.layers_per_page, self.rows_per_page, self.heads))
        t = t[:, :, layer % self.layers_per_page].transpose(1, 2)  # [requests, rows, tokens, heads, dim]
        # One of requests and rows_per_page is 1, so this is a view (never a copy).
        return t.view(self.batch, tokens, self.heads, dim)


def plan(choice, layers, batch, heads, row_bytes, page, max_len):
    """The `Layout` for `choice` ("auto", "token", "request"). "token" groups the most rows (all
    of them, else one) and then the most layers whose token row divides the page (a KV space's
    pages hold whole tokens); "auto" takes it when its pages, summed over every length up to
    `max_len`, cost less than "request"'s. strata.InvalidArgument for "token" when no grouping
    divides the page."""
    request = Layout(layers, batch, heads, row_bytes)
    if choice == "request":
        return request
    candidates = [
        Layout(layers, batch, heads, row_bytes, g, b)
        for b in dict.fromkeys((batch, 1))
        for g in range(layers, 0, -1)
        if layers % g == 0 and g * b > 1 and page % (g * b * row_bytes) == 0
    ]
    if not candidates:
        if choice == "token":
            raise _lib.error(
                _lib.Status.INVALID_ARGUMENT,
                f"layout 'token': no group of the {batch} rows and {layers} layers has a token row "
                f"({row_bytes} bytes per row and layer) that divides the {page}-byte page; use 'request'",
            )
        return request
    token = min(candidates, key=lambda c: (c.mean_mapped_bytes(max_len, page), -c.layers_per_page * c.rows_per_page))
    if choice == "token" or token.mean_mapped_bytes(max_len, page) < request.mean_mapped_bytes(max_len, page):
        return token
    return request
