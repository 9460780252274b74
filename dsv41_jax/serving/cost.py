"""FLOP accounting for prefill and decode at any width, without weights (compile-only).

Cost comes from XLA's cost analysis of the lowered step over abstract parameters
(`jax.ShapeDtypeStruct`s from `info.abstract_model`); the arithmetic it is checked against
comes from the same module shapes. What the cost analysis cannot see is counted from shapes:

- XLA's cost analysis counts a while-loop body once, whatever the trip count; the steps lowered
  here have no loops in fast mode (`check_no_loops` verifies it on the HLO): their layers run
  unrolled (`unrolled`), not as the scans a server runs (the same arithmetic).
- `lax.ragged_dot` (the grouped MoE path used above 256 routed rows) lowers on CPU to a dense
  product over every expert group, so its reported FLOPs are E/k times the real work. Prefill
  accounting replaces the MoE's reported cost with the arithmetic count of the rows it routes
  (`moe_correction`).
- Pallas kernels and other custom calls report nothing; with impl="xla" there are none except
  top-k (`lax.top_k`), which does no arithmetic.
- Quantized weights (FP8/FP4) are dequantized elementwise per call by the XLA fallback; a fused
  kernel does that in registers. `arithmetic_config` gives the same shapes with bf16 weights,
  which is what "FLOPs of the active parameters" measures. Both are reported.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.fast_index import scores_packed
from dsv41_jax.layers.mhc import unrolled_sinkhorn
from dsv41_jax.layers.rope import cos_sin, layer_rope
from dsv41_jax.model.block import decode_index_keys
from dsv41_jax.model.info import abstract_model, model_info
from dsv41_jax.numerics import kv_layout
from dsv41_jax.runtime import COMPILER_OPTIONS, Runtime
from dsv41_jax.serving.buckets import empty_cache
from dsv41_jax.serving.split_prefill import decode_plan, decode_step, exact_prefill, split_prefill
from dsv41_jax.serving.weight_traffic import kernel_name, sub_jaxprs


def arithmetic_config(cfg: ModelConfig) -> ModelConfig:
    """Same shapes, every Linear a plain bf16 matrix: cost analysis then counts GEMM arithmetic only."""
    return cfg.replace(dtype="bf16", expert_dtype=None)


def abstract_params(cfg: ModelConfig):
    return nnx.split(abstract_model(cfg))


def abstract_cache(cfg: ModelConfig, batch: int, capacity: int, words: bool = False, runs=()):
    return jax.eval_shape(lambda: empty_cache(cfg, batch, capacity, words, runs))


def engram_spec(cfg: ModelConfig, batch: int, T: int):
    if not cfg.engram_layer_ids:
        return None
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    return jax.ShapeDtypeStruct((batch, T, len(cfg.engram_layer_ids), cols), jnp.int32)


def lowered(fn, *args, platform: str | None = None):
    """The lowered program, mHC's Sinkhorn rounds written out (`mhc.unrolled_sinkhorn`): a `while` would
    hide all but one round from cost analysis (`loop_probe`). platform: lower for another backend
    than this one (e.g. "tpu": the Pallas kernels become Mosaic custom calls instead of loops)."""
    with unrolled_sinkhorn():
        if platform is None:
            return jax.jit(fn, compiler_options=COMPILER_OPTIONS).lower(*args)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))


def flops_of(low) -> float:
    """Total FLOPs XLA's cost analysis assigns to a lowered computation."""
    ca = low.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0]
    return float(ca.get("flops", 0.0))


def bytes_of(low) -> float:
    """Bytes accessed (read + written) that XLA's cost analysis assigns to a lowered computation."""
    ca = low.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0]
    return float(ca.get("bytes accessed", 0.0))


def kernel_calls(fn, *args) -> dict[str, int]:
    """{kernel name: calls} of the Pallas kernels in fn's trace. Cost analysis cannot see into them:
    interpreted (CPU) they lower to a loop over the grid whose body it counts once; compiled they are
    custom calls it counts as nothing."""
    from collections import Counter

    counts: Counter = Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                counts[kernel_name(eqn)] += 1
                continue
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return dict(sorted(counts.items()))


def check_no_loops(low) -> dict:
    """Ops in the lowered module whose work cost analysis may under-count (loops, custom calls)."""
    text = low.as_text()
    return {"while": len(re.findall(r"stablehlo\.while", text)),
            "custom_call": sorted(set(re.findall(r"stablehlo\.custom_call @(\w+)", text)))}


def loop_probe() -> dict:
    """What XLA's cost analysis reports for the same four 8x64x64 matmuls written as a
    `lax.scan` and unrolled: the loop body is counted once, whatever the trip count. This is
    why every step accounted here is checked for `stablehlo.while` (`check_no_loops`)."""
    w = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)

    def scanned(w, x):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    def unrolled(w, x):
        for i in range(4):
            x = x @ w[i]
        return x

    low = lowered(scanned, w, x)
    return {"scan": flops_of(low), "unrolled": flops_of(lowered(unrolled, w, x)), "arithmetic": 4 * 2 * 8 * 64 * 64,
            "scan_hlo": check_no_loops(low)}


# ---------------------------------------------------------------------------------- decode
def unrolled(runtime: Runtime) -> Runtime:
    """`runtime` with every layer unrolled (`Runtime.scan_layers` off): cost analysis would count a
    scanned run's body once. What the accounting lowers; a server runs the scans."""
    return dataclasses.replace(runtime, scan_layers=False)


def decode_fn(graphdef, runtime: Runtime = Runtime(), layers: range | None = None):
    """The engine's lean one-token step, optionally over a slice of layers (for per-role costs)."""
    def step(params, tokens, cache, engram_ids=None):
        logits, cache, _ = decode_step(nnx.merge(graphdef, params), tokens, cache, decode_plan(runtime),
                                       engram_ids=engram_ids, layers=layers)
        return logits, cache

    return step


def decode_flops(cfg: ModelConfig, context: int, batch: int = 1, runtime: Runtime = Runtime(),
                 platform: str | None = None) -> dict:
    """Cost-analysis FLOPs of one decode step with every sequence at `context` cached tokens."""
    gd, params = abstract_params(cfg)
    cache = abstract_cache(cfg, batch, context)
    toks = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    low = lowered(decode_fn(gd, unrolled(runtime)), params, toks, cache, engram_spec(cfg, batch, 1), platform=platform)
    return {"flops": flops_of(low), "bytes": bytes_of(low), "hlo": check_no_loops(low)}


def _signature(role) -> tuple:
    return (role.kind, role.ratio, role.is_candidate_source, role.uses_candidates, role.has_engram)


def _dependencies(cfg: ModelConfig, layer: int) -> tuple[int, ...]:
    """Layers a decode step must run before `layer` for its inputs to exist (top-k, pool)."""
    role = cfg.roles[layer]
    deps = []
    src = role.index_source
    if src is not None and src != layer:
        deps.append(src)
        src_role = cfg.roles[src]
    else:
        src_role = role
    if src_role.uses_candidates and cfg.candidate_source_layer not in deps:
        deps.insert(0, cfg.candidate_source_layer)
    return tuple(deps)


def decode_flops_by_role(cfg: ModelConfig, context: int, batch: int = 1, runtime: Runtime = Runtime(),
                         platform: str | None = None) -> dict:
    """Decode-step FLOPs summed from per-layer costs, one lowering per distinct layer signature.

    Lowering all 40 full-width layers takes minutes; layers with the same role, ratio, pool
    use and Engram cost the same, so each signature is lowered once as (its dependencies + it)
    minus (its dependencies), and the embedding/head once as an empty layer range.
    """
    gd, params = abstract_params(cfg)
    cache = abstract_cache(cfg, batch, context)
    toks = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    ids = engram_spec(cfg, batch, 1)
    memo: dict[tuple, tuple[float, float]] = {}
    hlo = {"while": 0, "custom_call": set()}

    def cost(layers: tuple[int, ...]) -> tuple[float, float]:
        if layers not in memo:
            low = lowered(decode_fn(gd, unrolled(runtime), layers), params, toks, cache, ids, platform=platform)
            memo[layers] = (flops_of(low), bytes_of(low))
            seen = check_no_loops(low)
            hlo["while"] += seen["while"]
            hlo["custom_call"].update(seen["custom_call"])
        return memo[layers]

    base = cost(())
    per_sig: dict[tuple, dict] = {}
    total, total_bytes = base
    for role in cfg.roles:
        sig = _signature(role)
        if sig not in per_sig:
            deps = _dependencies(cfg, role.layer)
            (f1, b1), (f0, b0) = cost(deps + (role.layer,)), cost(deps)
            per_sig[sig] = {"layer": role.layer, "count": 0, "flops": f1 - f0, "bytes": b1 - b0}
        per_sig[sig]["count"] += 1
        total += per_sig[sig]["flops"]
        total_bytes += per_sig[sig]["bytes"]
    roles = [{"signature": "/".join(map(str, k)), **v} for k, v in per_sig.items()]
    return {"flops": total, "bytes": total_bytes, "embed_head": base[0], "roles": roles,
            "hlo": {"while": hlo["while"], "custom_call": sorted(hlo["custom_call"])}}


def indexer_scoring_flops(cfg: ModelConfig, positions: int, batch: int = 1, packed: bool = True) -> float:
    """Cost-analysis FLOPs of one index source scoring `positions` cached keys for one query:
    key decode, the FP4 query and head weights, the dots, the ReLU-weighted head sum and the
    masking (no top-k). packed: the lean fast step's `fast_index.scores_packed` (what decode
    runs); False: `Indexer.scores` on `decode_index_keys` (reference rounding points)."""
    gd, params = abstract_params(cfg)
    layer = cfg.decoder_start

    def score(params, x, qr, keys):
        model = nnx.merge(gd, params)
        attn = model.layers[layer].attn
        pos = jnp.zeros((batch, 1), jnp.int32) + positions - 1
        cos, sin = cos_sin(pos, layer_rope(cfg, 1))
        if packed:
            return scores_packed(attn.indexer, x, qr, keys, cos, sin, pos + 1)
        return attn.indexer.scores(x, qr, decode_index_keys(keys), cos, sin, pos + 1, "fast")

    keys = kv_layout.IndexKeys(jax.ShapeDtypeStruct((batch, positions, cfg.index_head_dim // 2), jnp.uint8),
                               jax.ShapeDtypeStruct((batch, positions, cfg.index_head_dim // 32), jnp.uint8))
    x = jax.ShapeDtypeStruct((batch, 1, cfg.dim), jnp.bfloat16)
    qr = jax.ShapeDtypeStruct((batch, 1, cfg.q_lora_rank), jnp.bfloat16)
    return flops_of(lowered(score, params, x, qr, keys))


def positions_scored(cfg: ModelConfig, context: int) -> dict[int, int]:
    """Per index source, how many cached positions one decode query scores (lean step)."""
    out = {}
    P = cfg.candidate_topk_blocks * cfg.candidate_block_size
    for role in cfg.roles:
        if not role.is_index_source:
            continue
        G = context // cfg.compress_ratios[role.kv_source]
        width = min(cfg.index_topk, G)
        out[role.layer] = P if (role.uses_candidates and width <= P < G) else G
    return out


def arithmetic_decode(cfg: ModelConfig, context: int, batch: int = 1) -> dict:
    """The textbook count of a decode step: 2 x active matrix parameters, attention over
    window + selected slots, and the indexer term positions x 2 x heads x dim."""
    info = model_info(cfg)
    rows = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim * len(cfg.engram_layer_ids)
    # table lookups (embedding row, Engram rows) move bytes, they do no arithmetic
    matrix_params = info["active_params_decode"] - cfg.dim - rows
    attention = 0
    for role in cfg.roles:
        slots = cfg.window_size
        if role.ratio:
            slots += min(cfg.index_topk, context // role.ratio)
        attention += 2 * 2 * cfg.n_heads * cfg.head_dim * slots  # q.k and p.v
    pos = positions_scored(cfg, context)
    indexer = sum(pos.values()) * 2 * cfg.index_n_heads * cfg.index_head_dim
    return {"matrix": 2 * matrix_params * batch, "attention": attention * batch, "indexer": indexer * batch,
            "positions_scored": sum(pos.values()), "total": (2 * matrix_params + attention + indexer) * batch}


# ---------------------------------------------------------------------------------- prefill
def prefill_fns(graphdef, runtime: Runtime = Runtime(), tail: int | None = None):
    def split(params, tokens, cache, engram_ids=None):
        return split_prefill(nnx.merge(graphdef, params), tokens, cache, tail=tail, runtime=runtime,
                             engram_ids=engram_ids)[0]

    def exact(params, tokens, cache, engram_ids=None):
        return exact_prefill(nnx.merge(graphdef, params), tokens, cache, runtime=runtime, engram_ids=engram_ids)[0]

    return split, exact


def moe_rows_flops(cfg: ModelConfig, rows: int) -> dict:
    """One MoE layer over `rows` tokens: what cost analysis reports for it and the arithmetic."""
    gd, params = abstract_params(cfg)

    def moe(params, x):
        return nnx.merge(gd, params).layers[0].ffn(x, "fast")[0]

    x = jax.ShapeDtypeStruct((1, rows, cfg.dim), jnp.bfloat16)
    reported = flops_of(lowered(moe, params, x))
    k, d, f = cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    gate = 2 * cfg.n_routed_experts * d
    arithmetic = rows * (gate + 2 * 3 * d * f * (k + 1))
    return {"reported": reported, "arithmetic": arithmetic}


def prefill_flops(cfg: ModelConfig, n: int, tail: int | None = None, runtime: Runtime = Runtime()) -> dict:
    """Split and exact prefill FLOPs for one n-token prompt on an empty cache of capacity n,
    with the MoE's CPU ragged_dot cost replaced by its arithmetic (see module doc)."""
    gd, params = abstract_params(cfg)
    split, exact = prefill_fns(gd, unrolled(runtime), tail)
    cache = abstract_cache(cfg, 1, n)
    toks = jax.ShapeDtypeStruct((1, n), jnp.int32)
    W = tail or cfg.window_size
    out = {}
    for name, fn, rows_per_layer in (("split", split, None), ("exact", exact, None)):
        low = lowered(fn, params, toks, cache, engram_spec(cfg, 1, n))
        out[name] = {"reported": flops_of(low), "hlo": check_no_loops(low)}
    enc, dec = cfg.decoder_start, cfg.n_layers - cfg.decoder_start
    m_full, m_tail = moe_rows_flops(cfg, n), moe_rows_flops(cfg, min(n, W))
    fix = lambda m: m["arithmetic"] - m["reported"]
    out["split"]["flops"] = out["split"]["reported"] + enc * fix(m_full) + dec * fix(m_tail)
    out["exact"]["flops"] = out["exact"]["reported"] + cfg.n_layers * fix(m_full)
    out["moe"] = {"per_layer_full": m_full, "per_layer_tail": m_tail}
    out["ratio"] = out["split"]["flops"] / out["exact"]["flops"]
    out["ratio_reported"] = out["split"]["reported"] / out["exact"]["reported"]
    return out
