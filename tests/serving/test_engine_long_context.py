"""The engine at long context equals `model.forward` on the same tokens, bit for bit in exact numerics.

Toy configurations stop at a few dozen tokens; the paths that only decide something at length are
exercised here: the index top-k selecting over thousands of compressed rows, the candidate pool in
decode (at the released pool size too: 2048 blocks of 8 restrict a ratio-1 layer only past 16,384
positions), the cache's capacity buckets growing, the grouped MoE over prefill pieces of >= 256
rows, continuous batching of two long prompts, and the same on a mesh of 8 devices. The oracle is the
model's own step (`make_step`, no engine, one device), fed the same pieces the engine's exact prefill
cuts (`steps.pieces`, unpadded: the exact numerics pick their elementwise kernels by a call's length,
as the reference's do), then one token a call; the engine's logprob rows must equal log_softmax of
those logits, every element. The cases on 4,096 + 3,072 tokens then resume the first conversation
from its saved cache (`Request.resume_from`: its last window replayed over the stored global caches)
with a 1,024-token follow-up: those rows equal the forward fed the first turn, its windows dropped
and its last window replayed (`forward_logprob_rows(resumed=...)`), then the follow-up.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import sampling
from dsv41_jax.serving.random_weights import random_model
from dsv41_jax.serving.steps import forward_logprob_rows

CHUNK, NEW = 1024, 3  # prompts of whole chunks: one prefill program per side


def long_config(max_seq_len: int, **over) -> ModelConfig:
    """tests/serving/test_serving.py's five-layer layout (SWA, Full r2, Full r1 pool source,
    in-pool Reindex, Reuse) at a long context: top-k 8 of up to 4K compressed rows."""
    base = dict(engram_layer_ids=(), max_seq_len=max_seq_len, n_layers=5, compress_ratios=(0, 2, 1, 1, 1),
                kv_source_layers=(1, 2), index_source_layers=(1, 2, 3), candidate_source_layer=2,
                hc_sinkhorn_iters=3, n_routed_experts=4, vocab_size=256)
    return ModelConfig.tiny(**{**base, **over})


FOLLOW_UP = 1024  # a resumed turn's new tokens after the first turn's last one (one prefill piece)

# (prompt lengths, mesh spec or None for one device, config overrides, resume the first conversation)
CASES = {
    "4096x3072": ((4096, 3072), None, {}, True),
    # the same two prompts on 8 devices: experts over expert=4, heads over tensor=2, the cache's
    # slots over expert (4 slots, two of them idle)
    "4096x3072-mesh": ((4096, 3072), "expert=4,tensor=2", {}, True),
    # the released candidate pool (2048 blocks of 8) and index top-k (512): 16,896 positions, so the
    # pool restricts the ratio-1 layers' top-k and the top-k selects from its pool in decode
    "16896-released-pool": ((16896,), None, dict(index_topk=512, candidate_topk_blocks=2048,
                                                 candidate_block_size=8), False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_forward_at_long_context(case, tmp_path):
    from dsv41_jax.golden.mechanisms import exercised
    from dsv41_jax.serving.engine import Engine, Request
    from sharding.mesh import make_mesh
    from sharding.serving import engine_strategies

    lengths, spec, over, resume = CASES[case]
    cfg = long_config(max(lengths) + FOLLOW_UP + 64, **over)
    said = " ".join(exercised(cfg, {"schedule": [{"start_pos": 0, "n_tokens": max(lengths)}]}))
    assert "top-k selects" in said and "candidate pool restricts" in said, said
    model = random_model(cfg, seed=7)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in lengths]
    seen: list[list] = [[] for _ in prompts]
    mesh = make_mesh(spec) if spec else None
    with jax.enable_x64(True):
        eng = Engine(model, slots=4 if mesh else len(prompts), exact_prefill=True, prefill_chunk=CHUNK,
                     min_capacity=64, runtime=Runtime(mode="exact"), **engine_strategies(mesh))
        saved = str(tmp_path / "conversation")
        reqs = [Request(p, sampling.SamplingParams(max_tokens=NEW), want_logprobs=True,
                        on_token=lambda tok, lp, i=i: seen[i].append((tok, lp)),
                        save_to=saved if resume and i == 0 else None) for i, p in enumerate(prompts)]
        results = eng.run(reqs)
        assert eng.capacity >= max(lengths)  # the cache grew through its buckets to hold them
        for i, (prompt, res) in enumerate(zip(prompts, results)):
            assert res.tokens == [t for t, _ in seen[i]] and len(res.tokens) == NEW
            want = forward_logprob_rows(graphdef, params, cfg, Runtime(mode="exact"), prompt, res.tokens, CHUNK)
            for j, ((tok, lp), ref) in enumerate(zip(seen[i], want)):
                assert np.array_equal(lp, ref), (lengths[i], j, float(np.max(np.abs(lp - ref))))
                assert tok == int(np.argmax(ref))  # greedy: the forward's own argmax
        if resume:
            _check_resumed_turn(eng, graphdef, params, cfg, prompts[0], results[0].tokens, saved, rng)


def _check_resumed_turn(eng, graphdef, params, cfg, prompt, generated, saved, rng):
    """A follow-up turn resumed from the first conversation's saved cache equals the forward's rows."""
    from dsv41_jax.serving.engine import Request

    follow = [generated[-1]] + [int(t) for t in rng.integers(1, cfg.vocab_size, FOLLOW_UP - 1)]
    seen = []
    turn = eng.run([Request(follow, sampling.SamplingParams(max_tokens=NEW), want_logprobs=True,
                            resume_from=saved, on_token=lambda tok, lp: seen.append((tok, lp)))])[0]
    assert turn.cached_tokens == len(prompt) + len(generated) - 1 and len(turn.tokens) == NEW
    want = forward_logprob_rows(graphdef, params, cfg, Runtime(mode="exact"), follow, turn.tokens, CHUNK,
                                resumed=(prompt, generated))
    for j, ((tok, lp), ref) in enumerate(zip(seen, want)):
        assert np.array_equal(lp, ref), ("resumed", j, float(np.max(np.abs(lp - ref))))
        assert tok == int(np.argmax(ref))
