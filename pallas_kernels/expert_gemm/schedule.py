"""Work list of a grouped (ragged) GEMM: which (row tile, expert) pairs a kernel visits, in order.

Rows are sorted by expert: group g owns rows [start_g, end_g). The rows past the last group form
a virtual "no expert" group whose output is 0. Every row tile visits, in order, each non-empty
group that overlaps it, so every output row belongs to exactly one item; empty experts are never
visited, so their weights are never read (what makes decode cheap). The list has a static length
(tiles + experts + 1); the tail is padding that repeats the last item with an empty row range.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class WorkList(NamedTuple):
    """int32 [W] each: row tile, weight group to load, row range [lo, hi), and 1 for a real expert."""

    tile: jax.Array
    group: jax.Array
    lo: jax.Array
    hi: jax.Array
    real: jax.Array


def work_list(group_sizes: jax.Array, n_rows_padded: int, tile_rows: int) -> WorkList:
    """Items for `n_rows_padded` (a multiple of `tile_rows`) rows split into groups of `group_sizes`."""
    sizes = group_sizes.astype(jnp.int32)
    E = sizes.shape[0]
    T = n_rows_padded // tile_rows
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    total = ends[-1]
    # non-empty experts first (stable, so still in row order), then the virtual tail group
    order = jnp.argsort(sizes == 0, stable=True).astype(jnp.int32)
    n_real = jnp.sum(sizes > 0)
    i = jnp.arange(E + 1)
    order_e = jnp.concatenate([order, jnp.array([E], jnp.int32)])
    c_gid = jnp.where(i < n_real, order_e, E)
    c_start = jnp.where(i < n_real, starts[jnp.minimum(order_e, E - 1)], jnp.where(i == n_real, total, n_rows_padded))
    c_end = jnp.where(i < n_real, ends[jnp.minimum(order_e, E - 1)], n_rows_padded)

    tile_lo = jnp.arange(T, dtype=jnp.int32) * tile_rows
    first = jnp.searchsorted(c_end, tile_lo, side="right")
    last = jnp.searchsorted(c_end, tile_lo + tile_rows - 1, side="right")
    count = last - first + 1
    item_end = jnp.cumsum(count)
    n_items = item_end[-1]

    W = T + E + 1
    w = jnp.arange(W, dtype=jnp.int32)
    in_list = w < n_items
    w_eff = jnp.minimum(w, n_items - 1)
    tile = jnp.minimum(jnp.searchsorted(item_end, w_eff, side="right"), T - 1).astype(jnp.int32)
    c = first[tile] + (w_eff - (item_end[tile] - count[tile]))
    gid = c_gid[c]
    lo = jnp.maximum(c_start[c], tile_lo[tile])
    hi = jnp.minimum(c_end[c], tile_lo[tile] + tile_rows)
    hi = jnp.where(in_list, hi, lo)  # padding items touch no row
    real = (gid < E) & in_list
    # weights to load: the item's expert, or for virtual / padding items the last real one (no refetch)
    last_real = jax.lax.cummax(jnp.where(real, w, -1))
    fallback = jnp.where(jnp.any(real), gid[jnp.argmax(real)], 0)
    group = jnp.where(last_real >= 0, gid[jnp.maximum(last_real, 0)], fallback)
    return WorkList(tile, group.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), real.astype(jnp.int32))
