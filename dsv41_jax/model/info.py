"""Parameter counts and cache bytes of a config, from the real module shapes (no allocation).

Counts come from `nnx.eval_shape` of the Transformer: a packed FP4 byte holds two parameters,
scales are storage overhead rather than parameters. Cache bytes come from the kv_layout
quantizers applied to abstract rows with `jax.eval_shape`; totals follow the layer roles.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.param_names import flat_params, is_vision_name, reference_name
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.numerics import kv_layout


_SCALE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))


def param_elems(path: tuple, var) -> int:
    """Parameters held by one stored array: 0 for quantization scales, 2 per packed FP4 byte."""
    dt = jnp.dtype(var.dtype)
    if str(path[-1]).endswith("scale") and dt in _SCALE_DTYPES:
        return 0
    n = 1
    for s in var.shape:
        n *= int(s)
    return 2 * n if dt == jnp.dtype(jnp.uint8) else n


def abstract_model(cfg: ModelConfig):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def row_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of one cached row of each kind, from the quantizers' abstract outputs."""
    def nbytes(fn, d):
        out = jax.eval_shape(fn, jax.ShapeDtypeStruct((d,), jnp.bfloat16))
        return kv_layout.row_bytes(out)

    return {"compressed_kv": nbytes(kv_layout.quantize_compressed, cfg.head_dim),
            "index_key": nbytes(kv_layout.quantize_index_keys, cfg.index_head_dim),
            "window": nbytes(kv_layout.quantize_window, cfg.head_dim)}


def model_info(cfg: ModelConfig) -> dict:
    model = abstract_model(cfg)
    params = flat_params(model)
    total = engram_tables = routed = dspark = dspark_routed = vision = 0
    per_layer: dict[int, int] = {}
    routed_per_layer: dict[int, int] = {}
    embed = head = 0
    for path, var in params.items():
        n = param_elems(path, var)
        if n == 0:
            continue
        if path[0] == "layers" and path[2] == "engram" and path[3] == "embed":
            engram_tables += n
            continue
        if path[0] != "mtp" and path[2:4] != ("ffn", "experts") and is_vision_name(reference_name(path)):
            vision += n  # tower, aligner, span delimiters, bias_vl: outside the backbone figures
            continue
        if path[0] == "mtp":  # the drafter, counted apart (it shares embed and head)
            dspark += n
            dspark_routed += n if path[2:4] == ("ffn", "experts") else 0
            continue
        total += n
        if path[0] == "embed":
            embed += n
        elif path[0] == "head":
            head += n
        elif path[0] == "layers":
            l = path[1]
            if path[2:4] == ("ffn", "experts"):
                routed += n
                routed_per_layer[l] = routed_per_layer.get(l, 0) + n
            else:
                per_layer[l] = per_layer.get(l, 0) + n
    k, E = cfg.n_activated_experts, cfg.n_routed_experts
    rows_per_token = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim * len(cfg.engram_layer_ids)

    def active_layer(l):
        return per_layer.get(l, 0) + routed_per_layer.get(l, 0) * k // E

    # a token touches one embedding row and the whole head; experts k of E; Engram rows it looks up
    active_decode = cfg.dim + head + sum(active_layer(l) for l in range(cfg.n_layers)) + rows_per_token + (
        total - embed - head - routed - sum(per_layer.values()))
    # under the CED split a prompt token runs the encoder layers; the decoder runs only the last window
    enc = [l for l in range(cfg.n_layers) if l < cfg.decoder_start]
    active_prefill = cfg.dim + sum(active_layer(l) for l in enc) + rows_per_token + _ced_projection_params(cfg, model)
    rb = row_bytes(cfg)
    kv_per_token = 0.0
    for s in cfg.kv_source_layers:
        m = cfg.compress_ratios[s]
        keys = rb["index_key"] if s in cfg.index_source_layers else 0
        kv_per_token += (rb["compressed_kv"] + keys) / m
    window_per_seq = cfg.n_layers * cfg.window_size * rb["window"]
    roles = [{"layer": r.layer, "kind": r.kind, "half": r.half, "ratio": r.ratio, "kv_source": r.kv_source,
              "index_source": r.index_source, "uses_candidates": r.uses_candidates,
              "candidate_source": r.is_candidate_source, "engram": r.has_engram} for r in cfg.roles]
    # one draft block runs every stage on block_size tokens; each token activates k of E stage experts
    dspark_active = 0
    if dspark:
        E_d, k_d = cfg.dspark_moe
        dspark_active = dspark - dspark_routed + dspark_routed * k_d // E_d
    return {
        "backbone_params": total, "engram_params": engram_tables, "routed_expert_params": routed,
        "vision_params": vision, "vision": _vision_summary(cfg),
        "dspark_params": dspark, "dspark_active_params_per_token": dspark_active,
        "active_params_decode": active_decode, "active_params_prefill_split": active_prefill,
        "row_bytes": rb, "global_kv_bytes_per_token": kv_per_token,
        "persistent_bytes_per_token": kv_per_token,
        "window_bytes_per_sequence": window_per_seq, "layers": roles,
    }


def _vision_summary(cfg: ModelConfig) -> dict | None:
    """The tower's shape (None for a text-only config)."""
    if not cfg.vision_enabled:
        return None
    return {"layers": cfg.vision_n_layers, "dim": cfg.vision_dim, "heads": cfg.vision_n_heads,
            "inter_dim": cfg.vision_inter_dim, "patch_size": cfg.vision_patch_size,
            "downsample_ratio": cfg.vision_downsample_ratio, "max_image_tokens": cfg.vision_max_n_token,
            "min_pixels": cfg.vision_min_pixels, "max_wh_ratio": cfg.vision_max_wh_ratio,
            "image_token_id": cfg.image_token_id}


def _ced_projection_params(cfg: ModelConfig, model) -> int:
    """Graph A also runs the first decoder layer's mHC pre-mix, attn_norm, compressor and index-key projection."""
    d = cfg.decoder_start
    if d >= cfg.n_layers:
        return 0
    n = 0
    for path, var in flat_params(model).items():
        if path[:2] == ("layers", d) and (path[2] in ("hc_attn", "attn_norm") or path[3:4] in (("compressor",),) or
                                          path[3:5] in (("indexer", "wk"), ("indexer", "k_norm"))):
            n += param_elems(path, var)
    return n


def format_info(cfg_name: str, info: dict) -> str:
    B = 1e9
    lines = [f"config: {cfg_name}",
             f"  backbone parameters        {info['backbone_params'] / B:10.2f} B",
             f"  Engram table parameters    {info['engram_params'] / B:10.2f} B",
             f"  vision parameters          {info['vision_params'] / B:10.2f} B" + (
                 "  (none: text only)" if info["vision"] is None else
                 f"  ({info['vision']['layers']}-layer ViT {info['vision']['dim']} wide, patch {info['vision']['patch_size']}, "
                 f"aligner {info['vision']['downsample_ratio']}x{info['vision']['downsample_ratio']}, "
                 f"<= {info['vision']['max_image_tokens']} tokens per image)"),
             f"  DSpark drafter parameters  {info.get('dspark_params', 0) / B:10.2f} B  (mtp.*; shares embed and head)",
             f"  active per decode token    {info['active_params_decode'] / B:10.2f} B",
             f"  active per prefill token   {info['active_params_prefill_split'] / B:10.2f} B  (CED split: encoder only)",
             f"  global KV per token        {info['global_kv_bytes_per_token']:10.1f} bytes  (persistent)",
             f"  window KV per sequence     {info['window_bytes_per_sequence'] / 2**20:10.2f} MiB (disposable)",
             f"  row bytes: compressed {info['row_bytes']['compressed_kv']}, index key {info['row_bytes']['index_key']}, window {info['row_bytes']['window']}",
             "  layer roles:"]
    for r in info["layers"]:
        extra = (" pool-source" if r["candidate_source"] else "") + (" in-pool" if r["uses_candidates"] else "") + (" +engram" if r["engram"] else "")
        lines.append(f"    {r['layer']:3d} {r['half']:7s} {r['kind']:7s} ratio {r['ratio']}  kv<-{r['kv_source']}  topk<-{r['index_source']}{extra}")
    return "\n".join(lines)
