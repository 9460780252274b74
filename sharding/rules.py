"""Logical axis names for every parameter and cache array, and rule tables mapping them to mesh axes.

Two steps, as in MaxText/t5x: each array dimension gets a *logical* name from what it means
(``heads``, ``expert``, ``vocab``, ...), derived here from the parameter's path in
`dsv41_jax.model.param_names.flat_params`; a *rule table* (a preset) then says which mesh axes shard
each logical name. Changing the parallelism layout means changing a table, never the model.

A rule lists mesh axes in priority order. When resolving one array, an axis is used only if it
is in the mesh with size > 1, not already used by another dimension of the same array, and the
dimension stays divisible; otherwise it is skipped (and recorded, so the plan can report the
arrays that ended up replicated against the rule's wish).

Quantization scales carry the logical names of their weight (a 32x32 FP8 block scale
[out/32, in/32] shards like [out, in]); packed FP4 dims ([.., in/2]) likewise.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, tuple[str, ...]]


class ShardingRuleError(ValueError):
    """A parameter or cache array the rule tables do not describe."""


# ------------------------------------------------------------------------------- logical names
# Keyed by the module path without layer indices ("attn.wq_b" for layers.N.attn.wq_b.weight/.scale).
_PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "head": ("vocab", "embed"),
    "norm": ("embed",),
    "attn_norm": ("embed",),
    "ffn_norm": ("embed",),
    "attn.attn_sink": ("heads",),
    "attn.wq_a": ("q_lora", "embed"),
    "attn.q_norm": ("q_lora",),
    # [n_heads * head_dim, q_lora]: output rows are whole heads
    "attn.wq_b": ("heads", "q_lora"),
    "attn.wkv": ("head_dim", "embed"),
    "attn.kv_norm": ("head_dim",),
    # [o_groups * o_lora_rank, heads-per-group * head_dim]: output rows are whole groups of heads
    "attn.wo_a": ("o_groups", "o_group_in"),
    "attn.wo_b": ("embed", "o_groups"),
    "attn.compressor.wkv": ("head_dim", "embed"),
    "attn.compressor.wgate": ("head_dim", "embed"),
    "attn.compressor.norm": ("head_dim",),
    "attn.indexer.wq_b": ("index_heads", "q_lora"),
    "attn.indexer.weights_proj": ("index_heads", "embed"),
    "attn.indexer.wk": ("index_dim", "head_dim"),
    "attn.indexer.k_norm": ("index_dim",),
    "ffn.gate.weight": ("gate_experts", "embed"),
    "ffn.gate.bias": ("gate_experts",),
    # stacked routed experts [E, out, in]
    "ffn.experts.w1": ("expert", "expert_mlp", "embed"),
    "ffn.experts.w3": ("expert", "expert_mlp", "embed"),
    "ffn.experts.w2": ("expert", "embed", "expert_mlp"),
    "ffn.shared_experts.w1": ("mlp", "embed"),
    "ffn.shared_experts.w3": ("mlp", "embed"),
    "ffn.shared_experts.w2": ("embed", "mlp"),
    "engram.embed": ("table_rows", "table_dim"),
    "engram.wkv": ("engram_out", "engram_in"),
    "engram.q_weight": ("hc", "embed"),
    "engram.k_weight": ("hc", "embed"),
    "hc_attn.fn": ("hc_mix", "hc_embed"),
    "hc_attn.base": ("hc_mix",),
    "hc_attn.scale": ("hc_scale",),
    "hc_ffn.fn": ("hc_mix", "hc_embed"),
    "hc_ffn.base": ("hc_mix",),
    "hc_ffn.scale": ("hc_scale",),
    # the VL part (docs/VISION.md): bias_vl like the gate bias; the delimiters are model-width
    # vectors; the aligner maps 9 ViT cells into the model width. The tower's own dims have names
    # no preset shards: at 0.49 B parameters it is replicated and run data-parallel over images.
    "ffn.gate.bias_vl": ("gate_experts",),
    "image_start": ("embed",),
    "image_end": ("embed",),
    "image_newline": ("embed",),
    "aligner.w1": ("embed", "aligner_in"),
    "aligner.w1.bias": ("embed",),
    "aligner.w2": ("embed", "embed_in"),
    "aligner.w2.bias": ("embed",),
    "vision.patch_embed.proj": ("vision_embed", "vision_patch"),
    "vision.patch_embed.proj.bias": ("vision_embed",),
    "vision.blocks.norm1": ("vision_embed",),
    "vision.blocks.norm2": ("vision_embed",),
    "vision.blocks.attn.wqkv": ("vision_qkv", "vision_embed"),
    "vision.blocks.attn.wqkv.bias": ("vision_qkv",),
    "vision.blocks.attn.wo": ("vision_embed", "vision_heads"),
    "vision.blocks.attn.wo.bias": ("vision_embed",),
    "vision.blocks.mlp.w1": ("vision_mlp", "vision_embed"),
    "vision.blocks.mlp.w2": ("vision_embed", "vision_mlp"),
    "vision.norm": ("vision_embed",),
    # DSpark stages (mtp.K.*) reuse the block entries above; these are theirs alone
    "main_proj": ("embed", "dspark_taps"),
    "main_norm": ("embed",),
    "markov_head.embed": ("vocab", "markov_rank"),
    "markov_head.head": ("vocab", "markov_rank"),
    "confidence_head.proj": ("confidence_out", "confidence_in"),
}

# Cache arrays, keyed by the top-level cache entry (see `dsv41_jax.model.transformer.init_cache`).
_CACHE_AXES: dict[str, tuple[str, ...]] = {
    "length": ("batch",),
    "published": ("batch",),
    "window": ("batch", "window", "kv_dim"),  # WindowKV values / scales
    "compressed": ("batch", "cache_seq", "kv_dim"),  # CompressedKV packed / scales
    "index_keys": ("batch", "cache_seq", "index_dim"),  # IndexKeys packed / scales
    "compressor": ("batch", "ratio_slot", "kv_dim"),  # partial-group kv / score
}

# Which bucket a parameter's bytes belong to in the plan.
ROUTED, ENGRAM_TABLE, OTHER, VISION = "routed_experts", "engram_tables", "other_weights", "vision_weights"


def _module_key(path: tuple) -> str:
    """('layers', 3, 'attn', 'wq_b', 'scale') -> 'attn.wq_b'; experts' 'w1_scale' -> 'ffn.experts.w1'."""
    names = [str(p) for p in path if not isinstance(p, int)]
    if names and names[0] in ("layers", "mtp"):
        names = names[1:]
    if len(names) > 1 and names[-1] in ("weight", "scale") and ".".join(names) not in _PARAM_AXES:
        names = names[:-1]
    if names and names[-1].endswith("_scale"):
        names[-1] = names[-1][: -len("_scale")]
    return ".".join(names)


def param_logical_axes(path: tuple, ndim: int | None = None) -> tuple[str, ...]:
    """Logical names of a parameter's dimensions, from its path in `flat_params(model)`."""
    key = _module_key(tuple(path))
    axes = _PARAM_AXES.get(key)
    if axes is None:
        raise ShardingRuleError(f"no logical axes for parameter {'.'.join(map(str, path))} (module key {key!r}); "
                                f"add an entry to _PARAM_AXES in sharding/rules.py")
    if ndim is not None and ndim != len(axes):
        raise ShardingRuleError(f"parameter {'.'.join(map(str, path))} has {ndim} dims but its logical axes "
                                f"{axes} name {len(axes)}; update _PARAM_AXES in sharding/rules.py")
    return axes


def param_bucket(path: tuple) -> str:
    key = _module_key(tuple(path))
    if key.startswith("ffn.experts."):
        return ROUTED
    if key == "engram.embed":
        return ENGRAM_TABLE
    if key.startswith(("vision.", "aligner.", "image_")) or key == "ffn.gate.bias_vl":
        return VISION
    return OTHER


def cache_logical_axes(path: tuple, ndim: int | None = None) -> tuple[str, ...]:
    """Logical names of a cache array's dimensions, from its path in the cache pytree."""
    axes = _CACHE_AXES.get(str(path[0]))
    if axes is None:
        raise ShardingRuleError(f"no logical axes for cache entry {'/'.join(map(str, path))}; add it to _CACHE_AXES")
    if path[:1] == ("window",) and "rings" in path[2:3]:
        # a run's window rings held stacked (`dsv41_jax.model.cache.RingStack`): split like one
        # layer's ring, the layer axis whole (a scan reads and writes its layers in place)
        axes = (None,) + axes
    if ndim is not None and ndim != len(axes):
        raise ShardingRuleError(f"cache entry {'/'.join(map(str, path))} has {ndim} dims, logical axes {axes}")
    return axes


# ------------------------------------------------------------------------------- rule tables
ALL_AXES = ("data", "expert", "tensor")

_INFERENCE: dict[str, tuple[str, ...]] = {
    # attention runs data-parallel over the expert axis too (DP attention + EP MoE): every
    # device holds distinct sequences, and only the MoE exchanges tokens across it
    "batch": ("data", "expert"),
    "heads": ("tensor",),
    "o_groups": ("tensor",),
    "index_heads": ("tensor",),
    "vocab": ("tensor",),
    "expert": ("expert",),
    "mlp": ("tensor",),
    # the Engram tables are the largest arrays: rows spread over every device
    "table_rows": ALL_AXES,
}

_FSDP = ("data", "expert")
# the model dimensions only FSDP splits (the training preset's additions to the serving rules)
_FSDP_NAMES = ("embed", "hc_embed", "q_lora", "engram_out", "vision_embed", "o_group_in")

PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    # expert-parallel MoE, tensor-parallel attention heads and indexer heads
    "inference": dict(_INFERENCE),
    # the same with the indexer replicated: no all-reduce of index scores, more bytes per device
    "inference-indexer-replicated": {**_INFERENCE, "index_heads": ()},
    # FSDP over the axes the batch is split over (every weight's model dimension), EP over the
    # expert axis, heads over tensor; the optimizer state follows the parameters. The attention runs
    # data-parallel over the expert axis too, so its weights shard over it as well (an expert weight
    # has the expert axis on its expert dimension: data only on the model dimension). wo_a's input
    # dimension takes expert only: on a mesh without an expert axis its layout, and so the order of
    # its contraction's sums, stays the data-only FSDP's (replicated)
    "training": {**_INFERENCE, **{name: _FSDP for name in _FSDP_NAMES}, "o_group_in": ("expert",)},
}

# Tables looked up by row, never multiplied: they keep their stored layout where the forward uses them
# (a lookup on a table split by columns takes every device's columns of the looked-up rows and moves
# no weight; gathering the token embedding whole would hold 1.3 GB more per chip, and its gradient)
_LOOKED_UP = ("embed", "engram.embed")


def get_rules(preset: str | Rules) -> Rules:
    """A preset by name, or a rule table passed through."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ShardingRuleError(f"unknown sharding preset {preset!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[preset]
    return preset


def compute_rules(preset: str | Rules) -> Rules:
    """The rules a preset's weights are laid out by where the forward multiplies them: its own, less
    the FSDP names (a weight stored split over the batch's axes is gathered whole over them before its
    products, FSDP's all-gather of weights; every device then multiplies its own rows). Left to the
    partitioner, a product whose contracted dimension is FSDP-split may instead gather the batch,
    compute every row's partial product and all-reduce it: wq_b at 64 x 1024 tokens on v5p:4x4x4
    held f32[64, 1024, 32768] on every chip. The serving presets have no FSDP names: unchanged."""
    return {name: axes for name, axes in get_rules(preset).items() if name not in _FSDP_NAMES}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One array's PartitionSpec and the rule axes it could not use (and why)."""

    spec: PartitionSpec
    dropped: tuple[str, ...] = ()


def resolve(logical: tuple[str, ...], shape: tuple[int, ...], rules: Rules, mesh_sizes: Mapping[str, int]) -> Resolved:
    """Map one array's logical axes to a PartitionSpec for a mesh of `mesh_sizes`."""
    used: set[str] = set()
    entries, dropped = [], []
    for name, dim in zip(logical, shape):
        chosen: list[str] = []
        for axis in rules.get(name, ()):
            size = mesh_sizes.get(axis, 1)
            if size <= 1:
                continue
            if axis in used:  # a second choice by design (e.g. FSDP's data axis taken by another dim)
                continue
            if dim % (math.prod(mesh_sizes[a] for a in chosen) * size):
                dropped.append(f"{name}:{axis} (dim {dim} not divisible)")
                continue
            chosen.append(axis)
            used.add(axis)
        entries.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
    while entries and entries[-1] is None:
        entries.pop()
    return Resolved(PartitionSpec(*entries), tuple(dropped))


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array laid out by `spec` (evenly divisible by construction)."""
    out = list(shape)
    for i, entry in enumerate(spec):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        out[i] //= math.prod(mesh_sizes[a] for a in axes)
    return tuple(out)


# ------------------------------------------------------------------------------- pytrees
def _key_name(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def path_tuple(jax_path) -> tuple:
    """A jax key path -> plain tuple, without the Variable's trailing 'value' attribute."""
    out = tuple(_key_name(k) for k in jax_path)
    while out and out[-1] in ("value", "raw_value"):
        out = out[:-1]
    return out


def _state_of(model_or_state):
    from flax import nnx

    return nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state


def _mesh_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh, Mesh):
        return dict(zip(mesh.axis_names, mesh.devices.shape))
    return dict(mesh)


def param_specs(model_or_state, mesh: Mesh | Mapping[str, int], preset: str | Rules = "inference", *, report: dict | None = None,
                compute: bool = False):
    """A pytree like `nnx.state(model)` of PartitionSpecs (works on abstract models too).

    report: if a dict is given, it receives {path string: dropped rule axes} for arrays whose
    rule could not be fully applied.
    compute: the layout where the forward uses each parameter (`compute_rules`; a table looked up
    by row keeps its stored layout) instead of the stored one.
    """
    sizes = _mesh_sizes(mesh)
    stored = get_rules(preset)
    used = compute_rules(preset) if compute else stored

    def one(jax_path, leaf):
        path = path_tuple(jax_path)
        if path[:1] == ("layers",) and path[2:3] == ("stacked",):
            # a run of layers held stacked (`dsv41_jax.model.stack`): split like one layer's, the
            # layer axis whole (a scan slices it)
            return PartitionSpec(None, *spec(path[:2] + path[3:], tuple(leaf.shape[1:]), leaf.dtype))
        return spec(path, tuple(leaf.shape), leaf.dtype)

    def spec(path, shape, dtype):
        axes = param_logical_axes(path)
        if len(shape) == len(axes) + 1 and dtype == jnp.int32:
            # the FP8 kernel's word view of a dense weight, [2, N, Kp/8] (model.kernel_weights): a plane
            # axis in front, N and K's words laid out as the weight's N and K
            axes = (None,) + axes
        axes = param_logical_axes(path, len(shape)) if len(axes) != len(shape) else axes
        r = resolve(axes, shape, stored if _module_key(tuple(path)) in _LOOKED_UP else used, sizes)
        if report is not None and r.dropped:
            report[".".join(map(str, path))] = r.dropped
        return r.spec

    return jax.tree_util.tree_map_with_path(one, _state_of(model_or_state))


def param_shardings(model_or_abstract, mesh: Mesh, preset: str | Rules = "inference", *, compute: bool = False):
    """A pytree like `nnx.state(model)` of NamedShardings (`param_specs`)."""
    specs = param_specs(model_or_abstract, mesh, preset, compute=compute)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def cache_specs(cache, mesh: Mesh | Mapping[str, int], preset: str | Rules = "inference"):
    rules, sizes = get_rules(preset), _mesh_sizes(mesh)

    def one(jax_path, leaf):
        path = path_tuple(jax_path)
        return resolve(cache_logical_axes(path, len(leaf.shape)), tuple(leaf.shape), rules, sizes).spec

    return jax.tree_util.tree_map_with_path(one, cache)


def cache_shardings(cache, mesh: Mesh, preset: str | Rules = "inference"):
    """A pytree like `cache` (real or `jax.eval_shape`d) of NamedShardings."""
    specs = cache_specs(cache, mesh, preset)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], preset: str | Rules = "inference") -> NamedSharding:
    """Sharding of a [batch, ...] input (tokens, Engram ids): batch split like the caches."""
    r = resolve(("batch",) + (None,) * (len(shape) - 1), tuple(shape), get_rules(preset), _mesh_sizes(mesh))
    return NamedSharding(mesh, r.spec)


def shard_params(model, mesh: Mesh, preset: str | Rules = "inference"):
    """Place a model's parameters on the mesh; returns the sharded `nnx.State` (merge it with the graphdef)."""
    state = _state_of(model)
    return jax.device_put(state, param_shardings(state, mesh, preset))


def shard_cache(cache, mesh: Mesh, preset: str | Rules = "inference"):
    return jax.device_put(cache, cache_shardings(cache, mesh, preset))
