"""Engram tables across devices: row-sharded in HBM, or kept in host memory with rows fetched ahead.

Row-sharded ("table_rows" over every mesh axis): device s owns rows [s*R/n, (s+1)*R/n). A
lookup runs on every device over the full id set, each device reads only the ids it owns
(zeros elsewhere) and one psum assembles the rows; exactly one device contributes each
value, so the sum is exact. The released tables (384,006,168 and 384,016,682 rows) do not
divide by every device count, so sharded deployments pad them (`padded_rows`, `pad_tables`).

Host memory (`HostEngramTables`), for when HBM cannot hold the ~196 GB of tables: the hash
ids depend only on token ids (`dsv41_jax.engram.hashing`, host numpy), so the rows a step needs
are known before the step runs. What runs where:
  host CPU : hashing, `np.unique` of the step's ids, the row gather (numpy fancy indexing,
             or an XLA host computation over a `memory_kind="pinned_host"` array),
  transfer : `jax.device_put` of the gathered rows only (asynchronous: issue it for step
             t+1 while step t runs),
  device   : the unchanged model, whose Engram layers index a *compact* table of just those
             rows with remapped ids (`compact_params`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv41_jax.layers.engram import Engram
from dsv41_jax.model.param_names import flat_params
from dsv41_jax.model.stack import blocks
from dsv41_jax.model.transformer import engram_table_rows
from dsv41_jax.numerics import quant
from sharding.compat import on_host, shard_map
from sharding.rules import get_rules, path_tuple


def is_table(path: tuple) -> bool:
    """layers.N.engram.embed / embed_scale."""
    return len(path) == 4 and path[0] == "layers" and path[2] == "engram" and path[3] in ("embed", "embed_scale")


def table_axes(mesh: Mesh, preset="inference") -> tuple[str, ...]:
    """Mesh axes (size > 1) the preset spreads table rows over."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return tuple(a for a in get_rules(preset).get("table_rows", ()) if sizes.get(a, 1) > 1)


def padded_rows(rows: int, n_shards: int) -> int:
    """Rows rounded up so `n_shards` devices hold equal slices."""
    return -(-rows // n_shards) * n_shards


def pad_tables(params, multiple: int):
    """Params state with every Engram table (and its scales) padded with zero rows to a multiple.

    Padding rows are never addressed (hash ids stay below the original row count).
    """
    def pad(jax_path, leaf):
        if is_table(path_tuple(jax_path)):
            extra = -leaf.shape[0] % multiple
            return jnp.pad(leaf, ((0, extra), (0, 0))) if extra else leaf
        return leaf

    return jax.tree_util.tree_map_with_path(pad, params)


# ----------------------------------------------------------------------------- row-sharded HBM
def sharded_lookup(table: jax.Array, scale: jax.Array, ids: jax.Array, mesh: Mesh, axes: tuple[str, ...]) -> jax.Array:
    """`Engram.lookup` over a table whose rows are split over `axes`: ids [..., C] -> bf16 [..., C*head_dim]."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    n = math.prod(sizes[a] for a in axes)
    if table.shape[0] % n:
        raise ValueError(f"Engram table of {table.shape[0]} rows cannot be split over {n} devices ({axes}); "
                         f"pad it with sharding.engram_shard.pad_tables(params, {n})")
    if not axes:
        vals = quant.dequant_fp8_act(table[ids], scale[ids], 32)
        return vals.astype(jnp.bfloat16).reshape(*ids.shape[:-1], -1)
    rows_per = table.shape[0] // n

    def body(tab, sc, idx):
        lo = jax.lax.axis_index(axes) * rows_per
        local = idx - lo
        own = (local >= 0) & (local < rows_per)
        safe = jnp.clip(local, 0, rows_per - 1)
        vals = quant.dequant_fp8_act(tab[safe], sc[safe], 32)
        return jax.lax.psum(jnp.where(own[..., None], vals, 0.0), axes)

    spec = P(axes)
    vals = shard_map(body, mesh=mesh, in_specs=(spec, spec, P()), out_specs=P())(table, scale, ids)
    return vals.astype(jnp.bfloat16).reshape(*ids.shape[:-1], -1)


class ShardedEngram(nnx.Module):
    """An Engram layer (same parameters and paths) whose lookup is `sharded_lookup`."""

    def __init__(self, engram: Engram, mesh: Mesh, axes: tuple[str, ...]):
        self.hc, self.dim, self.eps, self.head_dim = engram.hc, engram.dim, engram.eps, engram.head_dim
        self.embed, self.embed_scale = engram.embed, engram.embed_scale
        self.wkv, self.q_weight, self.k_weight = engram.wkv, engram.q_weight, engram.k_weight
        self.mesh, self.axes = mesh, tuple(axes)

    def lookup(self, ids):
        return sharded_lookup(self.embed[...], self.embed_scale[...], ids, self.mesh, self.axes)

    __call__ = Engram.__call__  # the layer's own gate and projection, around our lookup


def with_sharded_engram(model, mesh: Mesh, preset="inference"):
    """A copy of `model` (sharing arrays) whose Engram layers look up row-sharded tables."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    axes = table_axes(mesh, preset)
    for block in blocks(copy):  # a stack of layers (`LayerStack`) once
        if block.engram is not None:
            block.engram = ShardedEngram(block.engram, mesh, axes)
    return copy


# ----------------------------------------------------------------------------- host memory
class HostEngramTables:
    """Engram tables kept in host memory; `prefetch` turns a step's hash ids into compact device tables.

    tables: {engram layer id: (values [R, head_dim] float8_e4m3fn, scales [R, head_dim/32] uint8)}
      as numpy arrays (np.memmap works: only touched rows are read).
    storage: "numpy" (host gather with numpy; runs anywhere) or "pinned_host" (tables as JAX
      arrays in pinned host memory, gathered by an XLA host computation; needs a backend with
      host memory spaces and `compute_on`).
    """

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]], *, storage: str = "numpy",
                 device=None):
        if storage not in ("numpy", "pinned_host"):
            raise ValueError(f"storage must be 'numpy' or 'pinned_host', got {storage!r}")
        self.layer_ids = tuple(sorted(tables))
        self.storage = storage
        self.device = device or jax.local_devices()[0]
        if storage == "numpy":
            self.tables = {l: (np.asarray(v), np.asarray(s)) for l, (v, s) in tables.items()}
        else:
            if not supports_pinned_host(self.device):
                raise RuntimeError(f"device {self.device} has no pinned_host memory space; use storage='numpy'")
            host = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
            self.tables = {l: (jax.device_put(v, host), jax.device_put(s, host)) for l, (v, s) in tables.items()}
            self._host_gather = jax.jit(functools.partial(_host_gather, device=self.device))

    @classmethod
    def from_params(cls, params, cfg, **kwargs) -> "HostEngramTables":
        """Copy the tables out of a params state (e.g. a loaded checkpoint) into host memory."""
        flat = flat_params(params)
        tables = {l: (np.asarray(flat[("layers", l, "engram", "embed")].get_value()),
                      np.asarray(flat[("layers", l, "engram", "embed_scale")].get_value()))
                  for l in cfg.engram_layer_ids}
        return cls(tables, **kwargs)

    def prefetch(self, ids: np.ndarray, sharding=None) -> tuple[dict[int, tuple[jax.Array, jax.Array]], jax.Array]:
        """Hash ids [B, T, n_layers, C] (int64, host) -> ({layer: compact (values, scales)}, remapped ids int32).

        The compact table of each layer has a fixed B*T*C rows (unused rows zero), so the jitted
        step sees the same shapes every call. `sharding`: where the compact tables go (default:
        the host table's device; pass a replicated NamedSharding for a mesh).
        """
        ids = np.asarray(ids)
        if ids.ndim != 4 or ids.shape[2] != len(self.layer_ids):
            raise ValueError(f"ids must be [B, T, {len(self.layer_ids)}, C] (hash_ids output), got shape {ids.shape}")
        B, T, L, C = ids.shape
        cap = B * T * C
        remapped = np.empty(ids.shape, np.int32)
        out = {}
        for j, layer in enumerate(self.layer_ids):
            uniq, inverse = np.unique(ids[:, :, j], return_inverse=True)
            remapped[:, :, j] = inverse.reshape(B, T, C)
            rows = np.zeros(cap, np.int64)
            rows[: uniq.size] = uniq
            vals, scales = self._gather(layer, rows)
            target = sharding or self.device
            out[layer] = (jax.device_put(vals, target), jax.device_put(scales, target))
        return out, jnp.asarray(remapped)

    def _gather(self, layer, rows: np.ndarray):
        v, s = self.tables[layer]
        if self.storage == "numpy":
            return v[rows], s[rows]
        host = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        return self._host_gather(v, s, jax.device_put(rows, host))


def _host_gather(v, s, rows, *, device):
    """Row gather computed by XLA on the host, next to the pinned-host tables; result in device memory."""
    gv, gs = on_host(lambda v, s, r: (v[r], s[r]), 2)(v, s, rows)
    to_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    return jax.device_put(gv, to_device), jax.device_put(gs, to_device)


def supports_pinned_host(device=None) -> bool:
    device = device or jax.local_devices()[0]
    try:
        return "pinned_host" in {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 (older runtimes without memory spaces)
        return False


def compact_params(params, compact: dict[int, tuple[jax.Array, jax.Array]]):
    """Params state whose Engram tables are replaced by a step's compact tables (from `prefetch`).

    The model code is untouched: Engram.lookup indexes whatever table it holds, and the
    remapped ids point into the compact one.
    """
    def swap(jax_path, leaf):
        path = path_tuple(jax_path)
        if is_table(path) and path[1] in compact:
            return compact[path[1]][0 if path[3] == "embed" else 1]
        return leaf

    return jax.tree_util.tree_map_with_path(swap, params)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def unpadded_tables(params, cfg):
    """The params with Engram tables cut back to their stored rows (`pad_tables` undone), so a
    model's fingerprint is the same whether its tables are padded, on a mesh or in host memory."""
    rows = dict(zip(cfg.engram_layer_ids, engram_table_rows(cfg)))

    def cut(jax_path, leaf):
        path = path_tuple(jax_path)
        return leaf[: rows[path[1]]] if is_table(path) and leaf.shape[0] > rows[path[1]] else leaf

    return jax.tree_util.tree_map_with_path(cut, params)


def split_host_tables(model, cfg, **kwargs):
    """(the model with empty Engram tables, `HostEngramTables` holding them) for an engine that keeps
    the tables in host memory (`sharding.serving.HostTables`). The empty tables are zero-row
    placeholders, replicated where the other weights live: every step gets `compact_params` in
    their place, so they are never indexed, and the devices hold none of the tables. kwargs go to
    `HostEngramTables` (storage=...)."""
    graphdef, state = nnx.split(model)
    host = HostEngramTables.from_params(unpadded_tables(state, cfg), cfg, **kwargs)
    flat = jax.tree_util.tree_leaves_with_path(state)
    home = next(leaf.sharding for p, leaf in flat if not is_table(path_tuple(p)) and isinstance(leaf, jax.Array))
    if isinstance(home, NamedSharding):
        home = replicated(home.mesh)

    def empty(jax_path, leaf):
        if not is_table(path_tuple(jax_path)):
            return leaf
        return jax.device_put(np.zeros((0,) + tuple(leaf.shape[1:]), leaf.dtype), home)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(empty, state)), host


def host_table_sharding(path: tuple, shape: tuple, dtype):
    """A load hook's answer for an Engram table kept in host memory: the host's CPU device (the
    table then lives in host RAM, and `HostEngramTables` reads it without a copy); None when the
    CPU backend is not available (JAX_PLATFORMS without cpu: the engine copies the table out)."""
    try:
        return jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])  # this process's host
    except RuntimeError:
        return None
