"""Cost of one DSpark draft + one verification step against one plain decode step, from shapes.

Counted from the stored parameter arrays of the config (`info.abstract_model`, no weights):
bytes read are the arrays a step touches (every non-expert array once per step, scales
included; routed experts only those some token of the step activates), FLOPs are 2 per
multiply-add of the active parameters per token. At small batch a step's time follows its bytes:
six verified tokens activate up to six times the distinct experts of one. Distinct experts per
layer assume uniform routing: E * (1 - (1 - k/E)^n) for n routed tokens. Attention over the cache
is left out of both sides (it is the same per token for plain and verified tokens; the window and
compressed rows a 6-query verification reads are those of one query plus 5 positions).

Break-even acceptance length: the tokens a speculative step must yield (accepted drafts + the
bonus) for it to beat plain decode, = cost(draft + verify) / cost(plain), by bytes and by FLOPs.
"""
from __future__ import annotations

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.info import abstract_model, param_elems
from dsv41_jax.model.param_names import flat_params


def _array_bytes(var) -> int:
    return int(np.prod(var.shape)) * np.dtype(var.dtype).itemsize


def _elems(path, var) -> int:
    return param_elems(path, var)


def distinct_experts(E: int, k: int, tokens: int) -> float:
    """Expected distinct experts of E hit by `tokens` tokens choosing k each, uniformly."""
    return E * (1.0 - (1.0 - k / E) ** tokens)


def step_costs(cfg: ModelConfig, batch: int, drafts: int | None = None) -> dict:
    """{"plain", "verify", "draft"}: bytes and FLOPs of one step for `batch` sequences; the verify
    step checks `drafts` tokens (default the drafter's block: `Engine(speculative=drafts)`)."""
    params = flat_params(abstract_model(cfg))
    bs = cfg.dspark_block_size
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    Ed, kd = cfg.dspark_moe
    dense_b = {"backbone": 0, "dspark": 0}
    dense_f = {"backbone": 0, "dspark": 0}
    expert_b = {"backbone": 0, "dspark": 0}  # bytes of one expert summed over layers
    expert_f = {"backbone": 0, "dspark": 0}
    head_b = head_f = 0
    for path, var in params.items():
        part = "dspark" if path[0] == "mtp" else "backbone"
        if path[0] == "embed" or (path[0] == "layers" and path[2] == "engram" and path[3] in ("embed", "embed_scale")):
            continue  # table lookups: a few rows per token
        if path[0] == "head":
            head_b, head_f = _array_bytes(var), _elems(path, var)
            continue
        if path[2:4] == ("ffn", "experts"):
            n = var.shape[0]
            expert_b[part] += _array_bytes(var) // n
            expert_f[part] += _elems(path, var) // n
            continue
        dense_b[part] += _array_bytes(var)
        dense_f[part] += _elems(path, var)
    layers = cfg.n_layers

    def backbone(tokens):
        hit = distinct_experts(E, k, tokens)
        b = dense_b["backbone"] + head_b + hit * expert_b["backbone"]
        f = 2 * tokens * (dense_f["backbone"] + head_f + k * expert_f["backbone"])
        return {"bytes": b, "flops": f, "tokens": tokens, "distinct_experts_per_layer": hit, "layers": layers}

    plain = backbone(batch)
    verify = backbone(batch * ((bs if drafts is None else drafts) + 1))
    out = {"plain": plain, "verify": verify}
    if cfg.has_dspark:
        t = batch * bs
        hit = distinct_experts(Ed, kd, t)
        markov = cfg.vocab_size * cfg.dspark_markov_rank  # the Markov head runs once per draft position
        out["draft"] = {"bytes": dense_b["dspark"] + head_b + hit * expert_b["dspark"],
                        "flops": 2 * t * (dense_f["dspark"] + head_f + kd * expert_f["dspark"] + markov),
                        "tokens": t, "distinct_experts_per_stage": hit}
    return out


def break_even(cfg: ModelConfig, batch: int, drafts: int | None = None) -> dict:
    """Step costs plus the break-even acceptance length (tokens per speculative step) by bytes and FLOPs."""
    c = step_costs(cfg, batch, drafts)
    if "draft" not in c:
        raise ValueError("the config has no DSpark drafter (n_mtp_layers / dspark_block_size 0)")
    spec = {m: c["draft"][m] + c["verify"][m] for m in ("bytes", "flops")}
    return {**c, "speculative": spec,
            "break_even_tokens_per_step": {m: spec[m] / c["plain"][m] for m in ("bytes", "flops")}}
