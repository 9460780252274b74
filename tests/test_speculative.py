"""Speculative decoding with DSpark in the engine (`serving/speculation.py`): output with
speculation equals the engine's output without it, token for token, through `generate`'s one-slot
engine and a batch of concurrent requests."""
import numpy as np
import pytest


# ------------------------------------------------------------------------------------ end to end
def _tiny(engram: bool):
    from dsv41_jax.config import ModelConfig

    base = dict(n_mtp_layers=3, dspark_block_size=5, dspark_noise_token_id=500, dspark_target_layer_ids=(4, 5, 6),
                dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=3, max_seq_len=64,
                max_batch_size=1)
    return ModelConfig.tiny(**base) if engram else ModelConfig.tiny(engram_layer_ids=(), **base)


def _engram_tables(cfg):
    if not cfg.engram_layer_ids:
        return None
    from dsv41_jax.engram.hashing import EngramLayout

    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim,
                                cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id)
    return layout, np.arange(cfg.vocab_size, dtype=np.int64) % cfg.engram_compressed_vocab_size


@pytest.mark.slow
@pytest.mark.parametrize("engram", [False, True])
def test_greedy_speculative_equals_plain_greedy_for_every_acceptance_length(engram):
    """Exact numerics, intended index-key mode. A drafter that follows the target (the plain greedy
    continuation) corrupted at a scheduled draft forces acceptance lengths 0..5 (a block of 5 proposes 5 drafts);
    the prompts straddle a ratio-2 group edge (odd / even lengths) and the window (8) wraps."""
    import jax

    with jax.enable_x64(True):  # exact numerics compute their dots in float64
        _greedy_case(engram)


def _greedy_case(engram):
    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving.generate import generate, one_slot_engine

    cfg = _tiny(engram)
    model = synthetic_model(cfg, seed=5)
    kw = dict(runtime=Runtime(mode="exact"), engram=_engram_tables(cfg))
    k = cfg.dspark_block_size
    plain, spec = one_slot_engine(model, **kw), one_slot_engine(model, speculative=k, **kw)
    own_draft = spec._draft
    schedule = [0, 3, 5, 1, 4, 2, 5, 0]
    for prompt_len in (7, 10):
        prompt = list(np.random.default_rng(prompt_len).integers(3, cfg.vocab_size, prompt_len))
        n = 30
        want = generate(plain, prompt, max_new_tokens=n + k + 1).tokens
        blocks = []

        def follower(p, rings, anchor, newest):
            i = len(spec.table[0].generated)  # drafts propose want[i], want[i+1], ...
            d = np.asarray(want[i:i + k])
            a = schedule[len(blocks) % len(schedule)]
            blocks.append(a)
            if a < k:
                d[a] = (d[a] + 1) % cfg.vocab_size  # the first wrong draft
            return d[None]

        spec._draft = follower
        before = dict(spec.spec_stats)
        got = generate(spec, prompt, max_new_tokens=n)
        assert got.tokens == want[:n]
        assert set(blocks) == set(range(k + 1))
        # accepted drafts are counted before the max_tokens cut: exactly the schedule's
        assert spec.spec_stats["accepted"] - before["accepted"] == sum(blocks)
        assert spec.spec_stats["slot_steps"] - before["slot_steps"] == len(blocks)
    # its own (random) drafter: acceptance is whatever it is, the output is still plain greedy
    spec._draft = own_draft
    assert generate(spec, prompt, max_new_tokens=12).tokens == want[:12]


@pytest.mark.slow
def test_engine_decode_step_returns_the_taps_forward_returns():
    """DSpark's taps from the engine's decode step (`decode_step(..., taps=True)`, a TapProbe) equal
    model.forward's aux["main_hidden"] bit for bit (exact mode, the same two chunks), and the
    step's logits and cache are those it returns without taps."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.model.transformer import init_cache, make_step
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving import split_prefill as sp

    cfg = _tiny(False)
    rt = Runtime(mode="exact")
    gd, params = nnx.split(synthetic_model(cfg, seed=5))
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (1, 14)), jnp.int32)
    plan = sp.decode_plan(rt, packed=False)
    with jax.enable_x64(True):
        step = make_step(gd, rt)
        _, cache, _ = step(params, tokens[:, :9], init_cache(cfg, 1))
        ref_logits, ref_cache, ref_aux = step(params, tokens[:, 9:], cache)
        dec = jax.jit(lambda p, t, c, taps: sp.decode_step(nnx.merge(gd, p), t, c, plan, taps=taps),
                      static_argnums=3)
        logits, got_cache, aux = dec(params, tokens[:, 9:], cache, True)
        plain = dec(params, tokens[:, 9:], cache, False)
    assert aux["main_hidden"].shape == ref_aux["main_hidden"].shape == (1, 5, len(cfg.dspark_target_layer_ids) * cfg.dim)
    assert bool(jnp.array_equal(aux["main_hidden"], ref_aux["main_hidden"]))
    assert "main_hidden" not in plain[2]
    for a, b in ((logits, ref_logits), (got_cache, ref_cache), (logits, plain[0]), (got_cache, plain[1])):
        assert all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ------------------------------------------------------------------------------ in the engine
@pytest.mark.slow
def test_engine_with_speculation_equals_the_engine_without():
    """Issue 26 item 1, exact numerics: concurrent requests of different lengths (greedy, one at
    T = 1 with a seed, one stopping on a stop token mid-block, one that turns speculation off)
    give the same tokens with speculation as without, token for token; first with a drafter that
    follows the plain output and breaks at scheduled positions (acceptance 0..K), then with the
    model's own (random) drafter."""
    import jax

    with jax.enable_x64(True):
        _engine_case()


def _engine_case():
    import dataclasses

    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving.engine import Engine, Request
    from dsv41_jax.serving.sampling import SamplingParams

    cfg = _tiny(False)
    model = synthetic_model(cfg, seed=5)
    K = cfg.dspark_block_size
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (8, 12, 4, 8)]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=13, temperature=1.0, seed=7),
              SamplingParams(max_tokens=16), SamplingParams(max_tokens=9)]

    def requests(stop=None):
        out = [Request(list(p), s) for p, s in zip(prompts, params)]
        out[3].speculate = False
        if stop is not None:
            out[2].sampling = SamplingParams(max_tokens=16, stop_tokens=(stop,))
        return out

    kw = dict(slots=3, exact_prefill=True, runtime=Runtime(mode="exact"), min_capacity=64)
    plain = Engine(model, **kw)
    want = [r.tokens for r in plain.run(requests())]
    stop = want[2][6]  # request 2 stops on its 7th token, inside a block
    want[2] = want[2][:want[2].index(stop) + 1]
    assert [r.tokens for r in plain.run(requests(stop))] == want

    spec = Engine(model, speculative=K, **kw)
    schedule, blocks = [K, 0, 3, K, 1, 4, 2, K], []
    own_draft = spec._draft

    def follower(p, rings, anchor, newest):
        d = np.array(own_draft(p, rings, anchor, newest))
        for i, st in enumerate(spec.table):
            if st is None:
                continue
            w = want[[r.request_id for r in reqs].index(st.request.request_id)]
            g = len(st.generated)
            row = (w[g:g + K] + [0] * K)[:K]
            a = schedule[len(blocks) % len(schedule)]
            blocks.append(a)
            if a < K:
                row[a] = (row[a] + 1) % cfg.vocab_size
            d[i] = row
        return d

    reqs = requests(stop)
    spec._draft = follower
    assert [r.tokens for r in spec.run(reqs)] == want
    stats = dict(spec.spec_stats)
    assert stats["accepted"] > stats["steps"] and stats["drafted"] > 0  # long blocks were accepted
    spec._draft = own_draft
    reqs = requests(stop)
    assert [r.tokens for r in spec.run(reqs)] == want

    # the runtime's finite guard covers the verify positions: NaN logits at the first position of the
    # first request's verify fail that request alone, naming the position; the others go on
    verify = spec._verify
    calls = []

    def poisoned(p, tokens, cache, ids):
        logits, pending, taps = verify(p, tokens, cache, ids)
        calls.append(len(calls))
        return (logits.at[0, 0].set(np.nan) if len(calls) == 2 else logits), pending, taps

    spec._verify, spec.runtime = poisoned, dataclasses.replace(spec.runtime, check_finite=True)
    reqs = requests(stop)
    ids = [spec.submit(r) for r in reqs]
    while not spec.idle():
        spec.step()
    got = [spec.done.pop(i) for i in ids]
    assert got[0].finish_reason == "error" and isinstance(got[0].exception, FloatingPointError)
    assert "non-finite logits for position" in got[0].error
    assert got[0].tokens == want[0][:len(got[0].tokens)]
    assert [r.tokens for r in got[1:]] == want[1:]
