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
    own_draft = spec.steps.drafting.draft
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

        spec.steps.drafting.draft = follower
        before = dict(spec.spec_stats)
        got = generate(spec, prompt, max_new_tokens=n)
        assert got.tokens == want[:n]
        assert set(blocks) == set(range(k + 1))
        # accepted drafts are counted before the max_tokens cut: exactly the schedule's
        assert spec.spec_stats["accepted"] - before["accepted"] == sum(blocks)
        assert spec.spec_stats["slot_steps"] - before["slot_steps"] == len(blocks)
    # its own (random) drafter: acceptance is whatever it is, the output is still plain greedy
    spec.steps.drafting.draft = own_draft
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


def test_prefix_cache_stores_the_drafter_rings(tmp_path):
    """`save_prefix(rings=)` stores a row of the drafter's rings bit for bit and
    `load_rings` reads it back; a file without rings gives None (it resumes without speculating);
    rings of another drafter shape are refused naming the arrays."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import dspark
    from dsv41_jax.serving import prefix_cache
    from dsv41_jax.serving.buckets import empty_cache

    cfg = _tiny(False)
    rng = np.random.default_rng(0)
    state = dspark.init_state(cfg, 3)
    state["rings"] = [type(r)(*(jnp.asarray(rng.integers(0, 256, a.shape, np.uint8)).view(a.dtype) for a in r))
                      for r in state["rings"]]
    cache, fp = empty_cache(cfg, 3, 64), "ab" * 32
    prefix_cache.save_prefix(tmp_path / "r.dsv41", cfg, cache, [], fingerprint=fp, row=2, rings=state)
    got = prefix_cache.load_rings(tmp_path / "r.dsv41", cfg, fingerprint=fp)
    want = jax.tree.map(lambda a: a[2:3], state)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    prefix_cache.load_prefix(tmp_path / "r.dsv41", cfg, fingerprint=fp)  # the cache loads as before
    prefix_cache.save_prefix(tmp_path / "n.dsv41", cfg, cache, [], fingerprint=fp)
    assert prefix_cache.load_rings(tmp_path / "n.dsv41", cfg, fingerprint=fp) is None
    prefix_cache.save_prefix(tmp_path / "s.dsv41", cfg, cache, [], fingerprint=fp, rings={"rings": state["rings"][:2]})
    with pytest.raises(prefix_cache.PrefixCacheError, match="dspark.ring2"):
        prefix_cache.load_rings(tmp_path / "s.dsv41", cfg, fingerprint=fp)
    with pytest.raises(prefix_cache.PrefixCacheError, match="other weights"):
        prefix_cache.load_rings(tmp_path / "r.dsv41", cfg, fingerprint="cd" * 32)


# ------------------------------------------------------------------------------ in the engine
@pytest.mark.slow
def test_engine_with_speculation_equals_the_engine_without():
    """Exact numerics: concurrent requests of different lengths (greedy, one at
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

    spec = Engine(model, speculative=K, spec_acceptance="match", **kw)  # the T = 1 request: plain's own draws
    schedule, blocks = [K, 0, 3, K, 1, 4, 2, K], []
    own_draft = spec.steps.drafting.draft

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
    spec.steps.drafting.draft = follower
    assert [r.tokens for r in spec.run(reqs)] == want
    stats = dict(spec.spec_stats)
    assert stats["accepted"] > stats["steps"] and stats["drafted"] > 0  # long blocks were accepted
    spec.steps.drafting.draft = own_draft
    reqs = requests(stop)
    assert [r.tokens for r in spec.run(reqs)] == want

    _resume_case(plain, spec, prompts[0], cfg.vocab_size)

    # the runtime's finite guard covers the verify positions: NaN logits at the first position of the
    # first request's verify fail that request alone, naming the position; the others go on
    verify = spec.steps.drafting.verify
    calls = []

    def poisoned(p, tokens, cache, ids):
        logits, pending, taps = verify(p, tokens, cache, ids)
        calls.append(len(calls))
        return (logits.at[0, 0].set(np.nan) if len(calls) == 2 else logits), pending, taps

    spec.steps.drafting.verify, spec.runtime = poisoned, dataclasses.replace(spec.runtime, check_finite=True)
    reqs = requests(stop)
    ids = [spec.submit(r) for r in reqs]
    while not spec.idle():
        spec.step()
    got = [spec.done.pop(i) for i in ids]
    assert got[0].finish_reason == "error" and isinstance(got[0].exception, FloatingPointError)
    assert "non-finite logits for position" in got[0].error
    assert got[0].tokens == want[0][:len(got[0].tokens)]
    assert [r.tokens for r in got[1:]] == want[1:]


def _resume_case(plain, spec, prompt, vocab):
    """A follow-up turn resumed from a conversation cache: the speculating engine's file holds the
    drafter's rings, so the turn speculates from its first decode step; its tokens equal the plain
    engine's resumed from its own file (which has no rings). The speculating engine resumed from the
    plain file (no rings: an older file) decodes without speculating, with the same tokens."""
    import tempfile

    from dsv41_jax.serving import prefix_cache
    from dsv41_jax.serving.engine import Request
    from dsv41_jax.serving.sampling import SamplingParams

    kinds = []
    verify, decode = spec.steps.drafting.verify, spec.steps.decode
    spec.steps.drafting.verify = lambda *a: kinds.append("spec") or verify(*a)
    spec.steps.decode = lambda *a: kinds.append("plain") or decode(*a)
    with tempfile.TemporaryDirectory() as tmp:
        files = {e: f"{tmp}/{name}.dsv41" for e, name in ((plain, "plain"), (spec, "spec"))}
        turn1 = {e: e.run([Request(list(prompt), SamplingParams(max_tokens=9), save_to=files[e])])[0].tokens
                 for e in (plain, spec)}
        assert turn1[plain] == turn1[spec]
        assert "plain" in kinds  # the last step (one token left) was a plain one: the rings kept up with it
        assert prefix_cache.load_rings(files[plain], plain.cfg, fingerprint=plain.fingerprint) is None
        assert prefix_cache.load_rings(files[spec], spec.cfg, fingerprint=spec.fingerprint) is not None
        nxt = [turn1[plain][-1]] + [(7 * t + 3) % vocab for t in prompt[:5]]  # the last sampled token, then a reply
        turn2 = lambda e, f: e.run([Request(list(nxt), SamplingParams(max_tokens=14), resume_from=f)])[0].tokens
        want = turn2(plain, files[plain])
        assert turn2(plain, files[spec]) == want  # a file with rings serves an engine without speculation
        kinds.clear()
        before = dict(spec.spec_stats)
        assert turn2(spec, files[spec]) == want
        assert kinds[0] == "spec" and kinds.count("spec") == spec.spec_stats["slot_steps"] - before["slot_steps"]
        kinds.clear()
        assert turn2(spec, files[plain]) == want
        assert set(kinds) == {"plain"}  # no rings stored: no speculation
    spec.steps.drafting.verify, spec.steps.decode = verify, decode


@pytest.mark.slow
def test_speculation_after_the_split_prefill():
    """An engine with the CED split prefill speculates. Its rings after prefill equal those
    written from `split_prefill`'s own taps of the tail (the oracle: Graph A over the whole prompt in
    one call, Graph B over the tail), with target layers on both sides of the split (exact numerics,
    one prefill piece on both sides: bitwise). Requests longer than the tail then give the plain split
    engine's tokens (greedy), speculating from their first decode step."""
    import jax

    with jax.enable_x64(True):
        _split_case()


def _split_case():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.model import dspark
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving.buckets import empty_cache
    from dsv41_jax.serving.engine import Engine, Request
    from dsv41_jax.serving.sampling import SamplingParams
    from dsv41_jax.serving.split_prefill import split_prefill

    cfg = _tiny(False).replace(dspark_target_layer_ids=(2, 5, 6))  # layer 2 in Graph A, 5 and 6 in Graph B
    assert cfg.decoder_start == 4
    model = synthetic_model(cfg, seed=5)
    K, rt = cfg.dspark_block_size, Runtime(mode="exact")
    kw = dict(slots=2, runtime=rt, min_capacity=64)
    spec, plain = Engine(model, speculative=K, **kw), Engine(model, **kw)
    assert not spec.exact and spec.tail < 32
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, 32)]  # one piece of 32 (a power of two)
    spec.prefill(Request(prompt))
    got = spec.row_rings

    gd, params = nnx.split(model)

    @jax.jit
    def oracle(params, tokens):
        m = nnx.merge(gd, params)
        _, _, aux = split_prefill(m, tokens, empty_cache(cfg, 1, spec.capacity), tail=spec.tail, runtime=rt, taps=True)
        start = jnp.full((1,), tokens.shape[1] - spec.tail, jnp.int32)
        return dspark.write_rings(m, dspark.init_state(cfg, 1), dspark.main_x(m, aux["main_hidden"], "exact"), start,
                                  jnp.full((1,), spec.tail, jnp.int32), "exact")

    want = oracle(params, jnp.asarray([prompt], jnp.int32))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    assert all(np.asarray(leaf).view(np.uint8).any() for leaf in jax.tree.leaves(want))  # the oracle wrote rows

    steps = []
    step = spec._speculative_step

    def recorded(active, flags):
        steps.append([(len(st.generated), f) for st, f in zip(spec.table, flags) if st is not None])
        return step(active, flags)

    spec._speculative_step = recorded
    other = [int(t) for t in rng.integers(3, cfg.vocab_size, 21)]  # 16 + 4 + 1: three Graph A pieces
    reqs = lambda: [Request(list(prompt), SamplingParams(max_tokens=12)), Request(list(other), SamplingParams(max_tokens=9))]
    assert [r.tokens for r in spec.run(reqs())] == [r.tokens for r in plain.run(reqs())]
    assert steps[0] == [(1, True), (1, True)]  # both speculate from their first decode step


@pytest.mark.slow
def test_warm_split_speculating_engine_never_compiles_again():
    """The warm-up of a speculating engine on the split prefill (Graph A with taps, Graph B writing
    the rings, the exact pieces with rings inside the tail, the speculative step): afterwards
    requests of every prompt length, speculating, run without a compile."""
    from test_serve_warmup import count_compiles

    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.serving.engine import Engine, Request
    from dsv41_jax.serving.sampling import SamplingParams
    from dsv41_jax.serving.warmup import program_list, warm

    cfg = _tiny(False).replace(dspark_target_layer_ids=(2, 5, 6), max_seq_len=40)
    K = cfg.dspark_block_size
    engine = Engine(synthetic_model(cfg, seed=5), slots=2, max_seq_len=cfg.max_seq_len, min_capacity=8,
                    prefill_chunk=8, speculative=K)
    kinds = [k for k, _ in program_list(engine)]
    # speculation is data: the prefill programs carry the rings, no second set of them
    assert {"graph_a", "graph_b", "exact", "speculate"} <= set(kinds) and not any(k.endswith("_rings") for k in kinds)
    warm(engine)
    engine.spec_stats.update(dict.fromkeys(engine.spec_stats, 0))
    with count_compiles() as seen:
        reqs = [Request([(7 * n + i) % cfg.vocab_size for i in range(n)], SamplingParams(max_tokens=K + 3))
                for n in range(1, cfg.max_seq_len - K - 3)]
        engine.run(reqs)
    assert seen == [], f"{len(seen)} programs compiled after warm()"
    assert engine.spec_stats["slot_steps"] >= len(reqs)


# ------------------------------------------------------------------ T > 0: rejection sampling
SUPPORT = (11, 22, 33)  # a logit bias of +100 keeps (almost) all the mass on these: a 3 x 3 joint to test


def _rejection_requests(prompt, n, seed0=0):
    from dsv41_jax.serving.engine import Request
    from dsv41_jax.serving.sampling import SamplingParams

    bias = tuple((t, 100.0) for t in SUPPORT)
    return [Request(list(prompt), SamplingParams(temperature=1.0, logit_bias=bias, max_tokens=3, seed=seed0 + s))
            for s in range(n)]


def _joint_of_tokens_2_and_3(model, cfg, prompt):
    """P(t2, t3) over SUPPORT x SUPPORT from model.forward's logits (the oracle): t1 ~ p(. | prompt),
    t2 ~ p(. | prompt, t1), t3 ~ p(. | prompt, t1, t2), each the biased softmax at T = 1, t1 summed out."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.model.transformer import init_cache, make_step

    gd, params = nnx.split(model)
    step = make_step(gd)

    def p(tokens):
        logits = np.asarray(step(params, jnp.asarray([tokens], jnp.int32), init_cache(cfg, 1))[0][0, -1], np.float64)
        logits[list(SUPPORT)] += 100.0
        e = np.exp(logits - logits.max())
        e /= e.sum()
        assert e[list(SUPPORT)].sum() > 1 - 1e-9
        return e[list(SUPPORT)] / e[list(SUPPORT)].sum()

    p1 = p(prompt)
    joint = np.zeros((3, 3))
    for i, x1 in enumerate(SUPPORT):
        p2 = p(prompt + [x1])
        for j, x2 in enumerate(SUPPORT):
            joint[j] += p1[i] * p2[j] * p(prompt + [x1, x2])
    return joint.reshape(-1)


def _chi2_pvalue(tokens, want):
    got = np.zeros(9)
    for t in tokens:
        got[SUPPORT.index(t[1]) * 3 + SUPPORT.index(t[2])] += 1
    n = got.sum()
    keep = want * n >= 5  # cells expected below 5 are pooled
    obs = np.append(got[keep], got[~keep].sum())
    exp = np.append(want[keep], want[~keep].sum()) * n
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    from scipy import stats

    return stats.chisquare(obs, exp).pvalue


@pytest.mark.slow
def test_rejection_sampling_in_the_engine_keeps_the_target_distribution():
    """T > 0: many seeded requests on a speculating engine (64 slots, the model's
    own drafter, rejection sampling on the processed distributions: logit bias and temperature).
    Their second and third tokens (the first two a speculative step emits: t1 comes from the
    prefill) follow model.forward's joint distribution by a chi-square test; the same engine with
    an always-accept rule (the drafts and the drafter's q kept) fails it."""
    import jax.numpy as jnp

    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.serving.engine import Engine

    cfg = _tiny(False)
    model = synthetic_model(cfg, seed=5)
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, cfg.vocab_size, 6)]
    want = _joint_of_tokens_2_and_3(model, cfg, prompt)
    eng = Engine(model, slots=64, exact_prefill=True, speculative=cfg.dspark_block_size, min_capacity=64,
                 prefill_chunk=8)
    got = [r.tokens for r in eng.run(_rejection_requests(prompt, 1000))]
    assert all(len(t) == 3 and set(t) <= set(SUPPORT) for t in got)
    s = eng.spec_stats
    assert 0 < s["accepted"] < s["drafted"], s  # both branches ran: accepted drafts and residual draws
    p_ours = _chi2_pvalue(got, want)

    real = eng.steps.drafting.reject

    def always_accept(logits, a, drawn, history, chunk, active, banned, masks, q):
        out, n = real(logits, a, drawn, history, chunk, active, banned, masks, q)
        return jnp.concatenate([chunk[:, 1:], chunk[:, 1:2]], 1), jnp.full_like(n, chunk.shape[1] - 1)

    eng.steps.drafting.reject = always_accept
    wrong = [r.tokens for r in eng.run(_rejection_requests(prompt, 500, seed0=10_000))]
    p_wrong = _chi2_pvalue(wrong, want)
    assert p_ours > 1e-3, (p_ours, want)
    assert p_wrong < 1e-4, (p_wrong, want)
