"""A sweep of seeded configs the golden folder does not cover, checked on the model's own invariants (slow).

Intended index-key mode (Runtime.index_k_quirk False). On every config, for a prompt of at least
5 windows: one prefill == the same tokens in uneven chunks == a short prefill then one token per
call (decisions and every cache byte identical, logits to the tolerance of the mode; see
tests/README.md "Prefill vs decode"), and imposing the prefill's decisions on the decode run changes
nothing (forced == free, given the model reports its own decisions equal to the imposed ones up
to exact ties, `model.tie_aware_equal`).

The configs vary the window, RoPE bases and YaRN parameters (rope_theta 2e4 included), the
candidate pool's blocks x positions (non-powers of two included), top-k, two adjacent Full
ratio-2 layers with Reuse of the second, gate temperature, route scale and Engram positions.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.transformer import Transformer, init_cache, make_step
from dsv41_jax.runtime import Runtime

# two adjacent Full ratio-2 layers (1, 2); layer 3 reuses the second; 4 Full r1 + pool; 5 Reindex r1; 6 Reuse
ADJACENT_FULL = dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1), kv_source_layers=(1, 2, 4),
                     index_source_layers=(1, 2, 4, 5), candidate_source_layer=4)
DEFAULT_ROLES = dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1), kv_source_layers=(1, 4),
                     index_source_layers=(1, 3, 4, 5), candidate_source_layer=4)


def sweep_configs() -> list[tuple[str, dict]]:
    """12 seeded configs; the first few pin the cases the issue names, the rest are drawn."""
    pinned = [
        ("adjacent_full_theta2e4_pool3x5", dict(ADJACENT_FULL, window_size=6, engram_layer_ids=(), rope_theta=2e4, compress_rope_theta=4e4,
                                                rope_factor=8.0, original_seq_len=32, beta_fast=16, beta_slow=2,
                                                candidate_topk_blocks=3, candidate_block_size=5, index_topk=6)),
        ("adjacent_full_engram13", dict(ADJACENT_FULL, window_size=4, candidate_topk_blocks=2, candidate_block_size=6,
                                        index_topk=4, engram_layer_ids=(1, 3), gate_temp=0.7, route_scale=2.5)),
        ("pool4x3_topk5_theta2e4", dict(DEFAULT_ROLES, window_size=5, rope_theta=2e4, candidate_topk_blocks=4,
                                        candidate_block_size=3, index_topk=5, gate_temp=1.5, route_scale=1.0)),
        ("engram2_yarn40", dict(DEFAULT_ROLES, window_size=8, rope_factor=40.0, original_seq_len=16,
                                compress_rope_theta=1e6, engram_layer_ids=(2,), candidate_topk_blocks=3,
                                candidate_block_size=4, index_topk=8)),
    ]
    rng = np.random.default_rng(1313)
    drawn = []
    for i in range(12 - len(pinned)):
        roles = ADJACENT_FULL if i % 2 else DEFAULT_ROLES
        blocks, size = [(2, 3), (3, 3), (2, 5), (3, 4), (2, 7), (4, 2)][int(rng.integers(6))]
        drawn.append((f"drawn{i}", dict(
            roles, window_size=int(rng.choice([4, 5, 6, 8])),
            rope_theta=float(rng.choice([1e4, 2e4, 5e4])), compress_rope_theta=float(rng.choice([4e4, 1.6e5, 1e6])),
            rope_factor=float(rng.choice([4.0, 16.0, 40.0])), original_seq_len=int(rng.choice([16, 32, 64])),
            beta_fast=int(rng.choice([16, 32])), beta_slow=int(rng.choice([1, 2])),
            candidate_topk_blocks=blocks, candidate_block_size=size, index_topk=int(min(blocks * size, rng.integers(3, 9))),
            gate_temp=float(rng.choice([0.5, 1.0, 2.0])), route_scale=float(rng.choice([1.0, 1.5, 2.5])),
            engram_layer_ids=[(), (1,), (3,), (1, 5)][int(rng.integers(4))])))
    return pinned + drawn


def _engram_ids(cfg, tokens, start):
    """Host hashing of tokens[:, start:] with the earlier tokens as history (None without Engram)."""
    if not cfg.engram_layer_ids:
        return None
    from dsv41_jax.engram.hashing import EngramLayout, hash_ids

    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_compressed_vocab_size,
                                cfg.engram_pad_id)
    token_map = (np.arange(cfg.vocab_size, dtype=np.int64) * 7919) % cfg.engram_compressed_vocab_size
    history = tokens[:, :start] if start else None
    return jnp.asarray(hash_ids(layout, token_map, tokens[:, start:], history=history))


def _run(step, params, cfg, tokens, chunks, forced=None, impose=True):
    cache = init_cache(cfg, tokens.shape[0])
    outs, auxes, s = [], [], 0
    for n in chunks:
        f = None
        if forced is not None:
            f = {"topk": {l: jnp.asarray(v[:, s:s + n]) for l, v in forced["topk"].items()},
                 "experts": {l: jnp.asarray(v[:, s:s + n]) for l, v in forced["experts"].items()},
                 "impose": jnp.asarray(impose)}
        logits, cache, aux = step(params, jnp.asarray(tokens[:, s:s + n]), cache, _engram_ids(cfg, tokens[:, :s + n], s), f)
        outs.append(np.asarray(logits))
        auxes.append(jax.tree.map(np.asarray, {k: aux[k] for k in ("topk", "experts", "topk_agree", "experts_agree")}))
        s += n
    decisions = {k: {l: np.concatenate([a[k][l] for a in auxes], 1) for l in auxes[0][k]} for k in ("topk", "experts")}
    agree = all(bool(np.all(a[k][l])) for a in auxes for k in ("topk_agree", "experts_agree") for l in a[k])
    return np.concatenate(outs, 1), cache, decisions, agree


def _same_caches(a, b, what):
    for name in ("compressed", "index_keys", "compressor"):
        for key in a[name]:
            for x, y in zip(jax.tree.leaves(a[name][key]), jax.tree.leaves(b[name][key])):
                np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8),
                                              err_msg=f"{what}: {name}[{key}]")
    for x, y in zip(jax.tree.leaves(a["window"]), jax.tree.leaves(b["window"])):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8), err_msg=f"{what}: window")


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", sweep_configs(), ids=[n for n, _ in sweep_configs()])
def test_sweep_invariants(name, overrides):
    cfg = ModelConfig.tiny(max_seq_len=64, max_batch_size=1, **overrides)
    graphdef, params = nnx.split(Transformer(cfg, rngs=sum(map(ord, name))))
    L = 5 * cfg.window_size + 3
    tokens = np.random.default_rng(len(name)).integers(0, cfg.vocab_size, size=(1, L))
    step = make_step(graphdef, Runtime(mode="fast"))
    ref, ref_cache, ref_dec, _ = _run(step, params, cfg, tokens, [L])
    k = 2 * cfg.window_size - 1
    runs = {"chunked": [7, L - 7 - 5, 5], "decode": [k] + [1] * (L - k)}
    for what, chunks in runs.items():
        got, cache, dec, _ = _run(step, params, cfg, tokens, chunks)
        for kind in ("topk", "experts"):
            for l in ref_dec[kind]:
                np.testing.assert_array_equal(dec[kind][l], ref_dec[kind][l], err_msg=f"{name} {what}: {kind} of layer {l}")
        _same_caches(cache, ref_cache, f"{name} {what}")
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=f"{name} {what}: logits")
    # one compilation for both: `impose` is traced
    free, _, _, agree = _run(step, params, cfg, tokens, runs["decode"], forced=ref_dec, impose=False)
    forced, _, _, _ = _run(step, params, cfg, tokens, runs["decode"], forced=ref_dec)
    assert agree, f"{name}: the decode run's own decisions differ (beyond ties) from the prefill's"
    np.testing.assert_array_equal(forced, free, err_msg=f"{name}: imposing the agreeing decisions changed the logits")
