"""Exact mode's memory-bounded paths give the same bits as the plain ones.

`Experts.per_expert` (prefills: rows sorted by expert, each expert's rows run in chunks) against
`Experts.per_row` (each row gathers its expert: the path the golden entries were first checked on),
and the exact block GEMM in row chunks (`gemm.EXACT_CHUNK_BYTES`) against the whole GEMM at once.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.moe import MoE
from dsv41_jax.numerics import gemm, quant


def _moe(expert_dtype, dtype="fp8"):
    cfg = ModelConfig.tiny(engram_layer_ids=(), n_routed_experts=12, n_activated_experts=3, dim=96,
                           moe_inter_dim=64, expert_dtype=expert_dtype, dtype=dtype)
    return MoE(cfg, rngs=nnx.Rngs(3))


# FP4 experts are slow here (34 s of the default suite: the exact FP4 GEMM per row and per chunk in
# float64); the default suite's FP4 per-expert path is held bit for bit to the oracle end to end by
# tests/golden/test_golden_wide.py (wide_r1_short: "MoE per-expert, 6 of 8 experts", FP4). FP8 experts
# too (21.6 s in the clean-clone CI run of 2026-12-05): `per_expert` reaches the kind only through
# `_lin`, so the default suite keeps its sorting, chunking and dropping with dense experts (bf16, below)
# and the FP8 GEMM's part, that a row's exact FP8 output does not depend on the rows computed with it,
# in test_exact_gemm_in_chunks_equals_whole[fp8]
@pytest.mark.parametrize("expert_dtype,dtype", [pytest.param("fp4", "fp8", marks=pytest.mark.slow),
                                                pytest.param(None, "fp8", marks=pytest.mark.slow), (None, "bf16")])
def test_per_expert_equals_per_row(expert_dtype, dtype):
    m = _moe(expert_dtype, dtype)
    assert m.experts.kind == {"fp4": "fp4", None: "fp8" if dtype == "fp8" else "dense"}[expert_dtype]
    x = (jax.random.normal(jax.random.key(1), (2, 21, 96)) * 2).astype(jnp.bfloat16)
    with jax.enable_x64(True):
        scores, _, _ = m.route(x, "exact")
        # forced choices (3 distinct a token) that leave experts 0 and 7 unused: the skipped branch
        allowed = jnp.array([e for e in range(12) if e not in (0, 7)])
        keys = jax.random.uniform(jax.random.key(9), (2, 21, allowed.size))
        experts = allowed[jnp.argsort(keys, axis=-1)[..., :3]]
        _, e_sorted, w_sorted = m.slots(scores, experts, "exact")
        flat = x.reshape(42, 96)
        rows = jnp.repeat(flat, 3, axis=0)
        by_row = jax.jit(lambda r, e, w: m.experts.per_row(r, e, w, "exact"))(
            rows, e_sorted.reshape(-1), w_sorted.reshape(-1))
        # chunks of 4 rows: experts with several chunks, chunks cut inside an expert's rows
        by_expert = jax.jit(lambda r, e, w: m.experts.per_expert(r, e, w, "exact", chunk=4))(
            rows, e_sorted.reshape(-1), w_sorted.reshape(-1))
    assert not np.any(np.asarray(e_sorted) == 0) and not np.any(np.asarray(e_sorted) == 7)
    a = np.asarray(by_row).view(np.uint16)
    b = np.asarray(by_expert).view(np.uint16)
    assert np.array_equal(a, b), f"{np.sum(a != b)} of {a.size} elements differ"


@pytest.mark.slow  # the default suite's share: per_expert == per_row above, wide_r1_short end to end
def test_moe_apply_takes_per_expert_for_prefills():
    """MoE.apply in exact mode: a prefill over per_row_tokens runs per_expert, and its output equals
    the same call with the threshold raised (every token through per_row)."""
    m = _moe("fp4")
    x = (jax.random.normal(jax.random.key(2), (1, 13, 96)) * 2).astype(jnp.bfloat16)
    with jax.enable_x64(True):
        scores, _, experts = m.route(x, "exact")
        y_expert, _ = m.apply(x, scores, experts, "exact")
        m.per_row_tokens = 1 << 20
        y_row, _ = m.apply(x, scores, experts, "exact")
    assert np.array_equal(np.asarray(y_expert).view(np.uint16), np.asarray(y_row).view(np.uint16))


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_exact_gemm_in_chunks_equals_whole(kind, monkeypatch):
    n, k, m = 72, 160, 37
    w = jax.random.normal(jax.random.key(4), (n, k)) / 8
    q, s = (quant.quant_fp8_weight if kind == "fp8" else quant.quant_fp4_weight)(w)
    x = (jax.random.normal(jax.random.key(5), (m, k)) * jnp.logspace(-3, 3, m)[:, None]).astype(jnp.bfloat16)
    with jax.enable_x64(True):
        whole = gemm.linear(x, q, s, kind=kind, mode="exact")
        # 5 rows a chunk: 8 chunks, the last padded by 3 rows
        monkeypatch.setattr(gemm, "EXACT_CHUNK_BYTES", 5 * n * (-(-k // 32)) * 8)
        chunked = jax.jit(lambda a: gemm.linear(a, q, s, kind=kind, mode="exact"))(x)
    assert chunked.shape == whole.shape == (m, n)
    assert np.array_equal(np.asarray(whole).view(np.uint16), np.asarray(chunked).view(np.uint16))
