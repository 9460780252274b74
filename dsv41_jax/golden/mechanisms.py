"""Which of the model's selection mechanisms a golden case exercises, so a passing check says what it
proved and what it did not.

A case only tests a mechanism that actually decides something at its lengths: the index top-k keeps
every compressed position until a layer has more than `index_topk` of them, the candidate pool
keeps every block until the pool source has more than `candidate_topk_blocks` blocks, and the
window ring only overwrites once a prompt passes `window_size`. These counts follow from the config
and the case's schedule alone (positions are causal and deterministic), so they are derived here,
not observed from a run.
"""
from __future__ import annotations

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.moe import GROUPED_ROWS, PER_ROW_TOKENS


def _length(case: dict) -> int:
    return max(call["start_pos"] + call["n_tokens"] for call in case["schedule"])


def _selection(cfg: ModelConfig, length: int) -> list[str]:
    """The window, top-k and pool at the case's longest position (the last row sees the most)."""
    found = []
    if any(r.kind == "swa" or r.ratio for r in cfg.roles) and length > cfg.window_size:
        found.append(f"window ring wraps ({length} > {cfg.window_size} positions)")
    selecting = [l for l in cfg.index_source_layers
                 if length // cfg.compress_ratios[cfg.roles[l].kv_source] > cfg.index_topk]
    if selecting:
        n = max(length // cfg.compress_ratios[cfg.roles[l].kv_source] for l in selecting)
        found.append(f"top-k selects at layers {','.join(map(str, selecting))} (up to {n} > {cfg.index_topk} "
                     "compressed positions)")
    else:
        found.append(f"top-k keeps every position (<= {cfg.index_topk})")
    cs = cfg.candidate_source_layer
    if 0 <= cs < cfg.n_layers and any(r.uses_candidates for r in cfg.roles):
        blocks = -(-(length // cfg.compress_ratios[cs]) // cfg.candidate_block_size)
        if blocks > cfg.candidate_topk_blocks:
            found.append(f"candidate pool restricts ({blocks} > {cfg.candidate_topk_blocks} blocks of "
                         f"{cfg.candidate_block_size})")
        else:
            found.append(f"candidate pool keeps every block ({blocks} <= {cfg.candidate_topk_blocks})")
    return found


def exercised(cfg: ModelConfig, case: dict, mode: str = "exact") -> tuple[str, ...]:
    """The mechanisms `case` exercises under golden-check's numerics (`mode`: "exact", or "fast" for
    `--numerics fast`, whose MoE paths differ), as short phrases."""
    calls = case["schedule"]
    found = _selection(cfg, _length(case))
    prefill_calls = [c for c in calls if c["n_tokens"] > 1 or c is calls[0]]
    if len(prefill_calls) > 1:
        found.append(f"chunked prefill ({len(prefill_calls)} calls)")
    if len(calls) > len(prefill_calls):
        found.append(f"decode ({len(calls) - len(prefill_calls)} steps)")
    # exact numerics runs a call over PER_ROW_TOKENS tokens expert by expert, shorter ones row by row
    # (the same bits); the grouped (ragged) path is fast mode's above the MoE's row threshold, so no
    # golden case can exercise it
    paths = [name for name, used in (("per-expert", any(c["n_tokens"] > PER_ROW_TOKENS for c in calls)),
                                     ("per-row", any(c["n_tokens"] <= PER_ROW_TOKENS for c in calls))) if used]
    if mode == "fast":  # fast mode groups a call's rows by expert once it has more than GROUPED_ROWS (token, expert) rows
        grouped = [c["n_tokens"] * cfg.n_activated_experts > GROUPED_ROWS for c in calls]
        paths = [name for name, used in (("grouped", any(grouped)), ("per-row", not all(grouped))) if used]
    found.append(f"MoE {' + '.join(paths)}, {cfg.n_activated_experts} of {cfg.n_routed_experts} experts")
    if cfg.engram_layer_ids:
        found.append(f"Engram at layers {','.join(map(str, cfg.engram_layer_ids))}")
    if case.get("images"):
        found.append(f"vision ({len(case['images'])} image{'s' if len(case['images']) > 1 else ''})")
    if cfg.has_dspark:
        n_exp, k = cfg.dspark_moe
        found.append(f"DSpark drafts ({cfg.n_mtp_layers} stages, blocks of {cfg.dspark_block_size}, Markov rank "
                     f"{cfg.dspark_markov_rank}, {k} of {n_exp} stage experts)")
    return tuple(found)
