"""Speculative decoding with DSpark: the acceptance rules (greedy prefix + bonus; rejection sampling
that keeps the target distribution, checked by a chi-square test with teeth) and the decoder
end to end: greedy speculative output equals greedy plain output token for token."""
import numpy as np
import pytest
from scipy import stats

from dsv41_jax.serving.speculative import greedy_accept, rejection_accept


def test_greedy_accept_prefix_bonus_and_limit():
    target = np.array([5, 6, 7, 8, 9, 1])
    assert greedy_accept(np.array([5, 6, 7, 8, 9]), target) == (5, 1)
    assert greedy_accept(np.array([5, 6, 0, 8, 9]), target) == (2, 7)
    assert greedy_accept(np.array([0, 6, 7, 8, 9]), target) == (0, 5)
    assert greedy_accept(np.array([5, 6, 7, 8, 9]), target, limit=3) == (3, 8)  # truncated block: bonus at 3


# -------------------------------------------------------------------- rejection sampling (chi-square)
V, K = 5, 3


def _markov(seed, concentration):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(V, concentration), size=V)  # rows: next-token distribution given the last token


P = _markov(1, 0.7)  # the target: an order-1 Markov chain over V symbols
NOISE = _markov(2, 1.0)
Q = 0.6 * P + 0.4 * NOISE  # a drafter that follows the target often (acceptance >= 50 %)


def _speculate_two(rng, rule):
    """The first two tokens after symbol 0, by speculative steps of K drafts until two are emitted."""
    out, last = [], 0
    while len(out) < 2:
        drafts, q, prev = [], [], last
        for _ in range(K):
            d = int(rng.choice(V, p=Q[prev]))
            drafts.append(d), q.append(Q[prev])
            prev = d
        ctx = [last] + drafts
        p = np.stack([P[c] for c in ctx])  # target rows after [g, d1..dK]
        a, nxt = rule(p, np.stack(q), np.asarray(drafts), rng)
        out.extend(drafts[:a] + [nxt])
        last = out[-1]
    return out[0] * V + out[1]


def _always_accept(p, q, drafts, rng):
    return len(drafts), int(rng.choice(V, p=p[-1]))


@pytest.mark.slow
def test_rejection_sampling_keeps_the_joint_distribution_and_always_accept_fails():
    n = 20000
    want = np.outer(P[0], np.ones(V)).reshape(-1) * P.reshape(-1)  # P(x1 | 0) P(x2 | x1)
    assert np.minimum(P, Q).sum(-1).min() >= 0.5  # per-draft acceptance probability = 1 - TV(P, Q), every context
    rng = np.random.default_rng(0)
    ours = np.bincount([_speculate_two(rng, rejection_accept) for _ in range(n)], minlength=V * V)
    wrong = np.bincount([_speculate_two(rng, _always_accept) for _ in range(n)], minlength=V * V)
    keep = want > 0
    p_ours = stats.chisquare(ours[keep], want[keep] * n).pvalue
    p_wrong = stats.chisquare(wrong[keep], want[keep] * n).pvalue
    assert p_ours > 1e-3, p_ours
    assert p_wrong < 1e-3, p_wrong


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


def _plain_greedy(dec, prompt, n):
    """One token per forward through the same jitted step (the reference schedule)."""
    from dsv41_jax.model.transformer import init_cache

    cache, history = init_cache(dec.cfg, 1), None
    logits, cache, _, history = dec._forward(list(prompt), cache, history)
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        logits, cache, _, history = dec._forward([out[-1]], cache, history)
        out.append(int(np.argmax(logits[-1])))
    return out


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
    from dsv41_jax.serving.speculative import SpeculativeDecoder

    cfg = _tiny(engram)
    dec = SpeculativeDecoder(synthetic_model(cfg, seed=5), engram=_engram_tables(cfg))
    k = cfg.dspark_block_size
    schedule = [0, 3, 5, 1, 4, 2, 5, 0]
    for prompt_len in (7, 10):
        prompt = list(np.random.default_rng(prompt_len).integers(3, cfg.vocab_size, prompt_len))
        n = 30
        want = _plain_greedy(dec, prompt, n + k + 1)
        blocks = []

        def follower(context, drafts, dlogits):
            i = len(context) - len(prompt)  # drafts propose want[i], want[i+1], ...
            d = np.asarray(want[i:i + k])
            a = schedule[len(blocks) % len(schedule)]
            blocks.append(a)
            if a < k:
                d = d.copy()
                d[a] = (d[a] + 1) % cfg.vocab_size  # the first wrong draft
            return d, None

        got = dec.generate(prompt, n, drafter=follower)
        assert got.tokens == want[:n]
        assert got.accepted_per_block == blocks[:got.blocks]
        assert set(got.accepted_per_block) == set(range(k + 1))
        assert got.mean_acceptance_length == pytest.approx((got.accepted + got.blocks) / got.blocks)
    # its own (random) drafter: acceptance is whatever it is, the output is still plain greedy
    free = dec.generate(prompt, 12)
    assert free.tokens == want[:12] and free.drafted == free.blocks * k


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
