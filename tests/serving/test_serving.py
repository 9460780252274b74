"""Serving: CED split prefill vs exact prefill, encoder replay, prefix cache on disk, buckets,
sampling and the continuous-batching engine (docs/REFERENCE.md §5).

A five-layer config carries every decoder role (Full r1 pool source, in-pool Reindex, Reuse)
after an SWA and a Full r2 encoder layer; compile time dominates, so compiled functions and
their results are shared through module fixtures.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.cache import cache_form
from dsv41_jax.model.transformer import Transformer, make_step
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import buckets, prefix_cache, sampling
from dsv41_jax.serving import split_prefill as sp
from dsv41_jax.serving.random_weights import random_model

N = 24  # prompt length: three windows


def micro_config(**kw) -> ModelConfig:
    base = dict(engram_layer_ids=(), max_seq_len=64, n_layers=5, compress_ratios=(0, 2, 1, 1, 1),
                kv_source_layers=(1, 2), index_source_layers=(1, 2, 3), candidate_source_layer=2,
                hc_sinkhorn_iters=3, n_routed_experts=4, vocab_size=256)
    base.update(kw)
    return ModelConfig.tiny(**base)


def same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and bool(jnp.array_equal(x, y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def micro():
    cfg = micro_config()
    model = random_model(cfg, seed=3)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, N)), jnp.int32)
    exact = sp.make_exact_prefill(graphdef, collect_topk=True)
    ex_logits, ex_cache, ex_aux = exact(params, tokens, buckets.empty_cache(cfg, 2, cfg.max_seq_len))
    return {"cfg": cfg, "model": model, "graphdef": graphdef, "params": params, "tokens": tokens,
            "exact": (ex_logits, ex_cache, ex_aux)}


def _lean_step(gd, packed_index: bool = True, runtime: Runtime = Runtime()):
    """The engine's decode step (`split_prefill.decode_step`), jitted, with its top-k."""
    @jax.jit
    def step(params, tokens, cache):
        logits, cache, aux = sp.decode_step(nnx.merge(gd, params), tokens, cache,
                                            sp.decode_plan(runtime, packed=packed_index), collect_topk=True)
        return logits, cache, aux["topk"]

    return step


@pytest.fixture(scope="module")
def decode_step(micro):
    """The engine's lean one-token step (every layer, gathered compressed rows, in-pool scoring,
    packed fast index scoring)."""
    step = _lean_step(micro["graphdef"])
    return lambda params, tokens, cache: step(params, tokens, cache)[:2]


# ------------------------------------------------------------------------------- split vs exact
@pytest.mark.slow
def test_layer_range_equals_model_forward(micro):
    """Prefill through run_layers and the lean decode step with the reference-rounded index
    scoring equal model.forward bit for bit; the production lean step (packed fast index
    scoring) differs only through the index scores, which act only through the top-k and the
    pool: on this model it picks the same positions, so the step is bitwise equal too."""
    cfg, params = micro["cfg"], micro["params"]
    step = make_step(micro["graphdef"], Runtime())
    logits, cache, _ = step(params, micro["tokens"], buckets.empty_cache(cfg, 2, cfg.max_seq_len))
    ex_logits, ex_cache, _ = micro["exact"]
    assert same(logits, ex_logits) and same(cache, ex_cache)
    nxt = micro["tokens"][:, :1]
    ref_logits, ref_cache, _ = step(params, nxt, cache)
    lean_logits, lean_cache, ref_topk = _lean_step(micro["graphdef"], packed_index=False)(params, nxt, ex_cache)
    assert same(ref_logits, lean_logits) and same(ref_cache, lean_cache)
    fast_logits, fast_cache, fast_topk = _lean_step(micro["graphdef"])(params, nxt, ex_cache)
    for part in ("compressed", "index_keys", "compressor", "length", "published"):
        assert same(fast_cache[part], ref_cache[part]), part
    assert same(fast_topk, ref_topk)
    assert same(fast_cache["window"], ref_cache["window"])
    assert same(fast_logits, ref_logits)  # the scores only act through the top-k and pool


@pytest.mark.slow
def test_lean_decode_exact_mode_ignores_packed_index(micro):
    """Exact mode: the lean step (packed_index left on) equals model.forward's exact step bit for
    bit, so the fast index scoring never reaches exact-mode numerics."""
    cfg, params, gd = micro["cfg"], micro["params"], micro["graphdef"]
    rt = Runtime(mode="exact")
    with jax.enable_x64(True):
        step = make_step(gd, rt)
        _, cache, _ = step(params, micro["tokens"], buckets.empty_cache(cfg, 2, cfg.max_seq_len))
        nxt = micro["tokens"][:, :1]
        ref_logits, ref_cache, _ = step(params, nxt, cache)
        logits, lean_cache, _ = _lean_step(gd, packed_index=True, runtime=rt)(params, nxt, cache)
    assert same(logits, ref_logits) and same(lean_cache, ref_cache)


@pytest.mark.slow
def test_forward_runs_on_a_bucketed_engine_cache(micro):
    """model.forward on a cache at a small capacity bucket (fewer compressed rows than index_topk)
    equals the engine's steps on it bit for bit: prefill (exact prefill) and one decode (lean)."""
    cfg, params, gd = micro["cfg"], micro["params"], micro["graphdef"]
    cap, P = 8, 6
    assert cfg.index_topk > cap // cfg.compress_ratios[1]  # the ratio-2 source holds fewer rows than top-k
    tokens = micro["tokens"][:, :P]
    cache = buckets.empty_cache(cfg, 2, cap)
    step = make_step(gd, Runtime())  # failed while tracing when forward took the width from the config
    logits, f_cache, _ = step(params, tokens, cache)
    ex_logits, ex_cache, _ = sp.make_exact_prefill(gd)(params, tokens, cache)
    assert same(logits, ex_logits) and same(f_cache, ex_cache)
    nxt = micro["tokens"][:, P:P + 1]
    ref_logits, ref_cache, _ = step(params, nxt, f_cache)
    lean_logits, lean_cache, _ = _lean_step(gd, packed_index=False)(params, nxt, ex_cache)
    assert same(ref_logits, lean_logits) and same(ref_cache, lean_cache)


@pytest.mark.slow
def test_commit_of_pending_writes_equals_a_chunk_of_the_accepted_tokens(micro):
    """A verify chunk with pending writes, then `commit` of n_i tokens per row, leaves the cache a
    plain chunk of each row's n_i tokens leaves, bitwise in exact mode (the chunks are shorter than
    8 tokens, so torch's scalar tail covers all of them in both runs: same chunking). Two rounds: a
    13-token prompt leaves a half-full ratio-2 group (compressor state), W = 8 so the ring wraps,
    and after round 1 the rows stand at different lengths; n = 0 leaves a row untouched."""
    cfg, params, gd = micro["cfg"], micro["params"], micro["graphdef"]
    rt = Runtime(mode="exact")
    T, P = 6, 13
    rng = np.random.default_rng(5)
    chunks = [jnp.asarray(rng.integers(0, cfg.vocab_size, (2, T)), jnp.int32) for _ in range(2)]
    with jax.enable_x64(True):
        plan = sp.decode_plan(rt)
        pending_plan = dataclasses.replace(plan, writes="pending")
        step = jax.jit(lambda p, t, c: sp.decode_step(nnx.merge(gd, p), t, c, plan)[:2])
        verify = jax.jit(lambda p, t, c: sp.decode_step(nnx.merge(gd, p), t, c, pending_plan))
        commit = jax.jit(functools.partial(sp.commit, cfg))
        _, cache, _ = sp.make_exact_prefill(gd, rt)(params, micro["tokens"][:, :P],
                                                    buckets.empty_cache(cfg, 2, cfg.max_seq_len))
        for chunk, n in zip(chunks, [(2, T), (0, 5)]):
            logits, unchanged, aux = verify(params, chunk, cache)
            assert same(unchanged, cache)
            ref_logits, ref_all = step(params, chunk, cache)
            assert same(logits, ref_logits)  # the verify forward is the plain forward of the chunk
            assert same(commit(cache, aux["pending"], jnp.asarray([T, T], jnp.int32)), ref_all)
            committed = commit(cache, aux["pending"], jnp.asarray(n, jnp.int32))
            for i, n_i in enumerate(n):
                want = cache if n_i == 0 else step(params, chunk[:, :n_i], cache)[1]
                row = lambda c: jax.tree.map(lambda a: a[i], c)
                assert same(row(committed), row(want)), (i, n_i)
            assert [int(v) for v in committed["length"]] != [int(v) for v in cache["length"]]
            cache = committed
        assert [int(v) for v in cache["length"]] == [P + 2, P + T + 5]


@pytest.mark.slow
def test_padded_pieces_equal_unpadded_ones(micro):
    """The engine's padded prefill pieces (fast numerics): a piece of 11 real tokens padded to 16,
    after 5 cached ones (a ratio-2 group left half full, the W = 8 ring wrapping), leaves the cache an
    unpadded piece of those 11 leaves and gives the same logits and encoder output at every real
    position, bit for bit (exact prefill and Graph A); a replay of 5 tokens padded to the window
    rebuilds the rings an unpadded replay rebuilds."""
    cfg, params, gd = micro["cfg"], micro["params"], micro["graphdef"]
    toks, start, n, P, W = micro["tokens"][:1], 5, 11, 16, cfg.window_size
    m = lambda p: nnx.merge(gd, p)  # noqa: E731
    exact = jax.jit(lambda p, t, c, v=None: sp.exact_prefill(m(p), t, c, valid=v)[:2])
    encode = jax.jit(lambda p, t, c, v=None: sp.encoder_pass(m(p), t, c, valid=v))
    replay = jax.jit(lambda p, t, c, v=None: sp.replay_window(m(p), t, c, valid=v))
    _, cache = exact(params, toks[:, :start], buckets.empty_cache(cfg, 1, cfg.max_seq_len))
    real = toks[:, start:start + n]
    padded = jnp.concatenate([real, jnp.zeros((1, P - n), jnp.int32)], 1)
    valid = jnp.asarray([n], jnp.int32)
    logits, got = exact(params, padded, cache, valid)
    want_logits, want = exact(params, real, cache)
    assert same(logits[:, :n], want_logits) and same(got, want)
    assert not same(got, cache)  # the piece wrote something (a test that can fail)
    h, pre, got = encode(params, padded, cache, valid)
    want_h, want_pre, want = encode(params, real, cache)
    assert same((h[:, :n], pre[:, :n], got), (want_h, want_pre, want))
    k = 5
    _, rebuilt = replay(params, jnp.concatenate([toks[:, :k], jnp.zeros((1, W - k), jnp.int32)], 1),
                        sp.drop_window(exact(params, toks[:, :k], cache_k := buckets.empty_cache(cfg, 1, cfg.max_seq_len))[1]),
                        jnp.asarray([k], jnp.int32))
    _, want = replay(params, toks[:, :k], sp.drop_window(exact(params, toks[:, :k], cache_k)[1]))
    assert same(rebuilt, want)


def test_fast_index_keys_bitwise():
    """The table decode of packed index keys equals kv_layout's nibble arithmetic for every
    (byte, E8M0 scale) pair, NaN scale included."""
    from dsv41_jax.numerics import kv_layout
    from dsv41_jax.layers.fast_index import index_keys_f32

    packed = jnp.asarray(np.tile(np.arange(256, dtype=np.uint8), 256).reshape(256, 4, 64))
    scales = jnp.asarray(np.repeat(np.arange(256, dtype=np.uint8), 16).reshape(256, 4, 4))
    keys = kv_layout.IndexKeys(packed, scales)
    want = np.asarray(kv_layout.dequantize_index_keys(keys))
    got = np.asarray(jax.jit(index_keys_f32)(keys))
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def test_fast_index_scores_track_the_reference_scoring(micro):
    """scores_packed (weights folded into the query, fp32 throughout, one bf16 rounding) against
    Indexer.scores (the reference's bf16 rounding points) and the float64 math: same -inf
    pattern, error to the float64 scores no larger than the reference-rounded path's plus one
    bf16 rounding, same top-k on random keys."""
    from dsv41_jax.numerics import kv_layout
    from dsv41_jax.layers.rope import cos_sin, layer_rope
    from dsv41_jax.layers import fast_index
    from dsv41_jax.runtime import COMPILER_OPTIONS
    from dsv41_jax.model.block import decode_index_keys

    cfg = micro["cfg"]
    ind = micro["model"].layers[cfg.decoder_start].attn.indexer
    rng = np.random.default_rng(0)
    B, T, G = 2, 3, 200
    x = jnp.asarray(rng.normal(size=(B, T, cfg.dim)), jnp.bfloat16)
    qr = jnp.asarray(rng.normal(size=(B, T, cfg.q_lora_rank)), jnp.bfloat16)
    keys = kv_layout.quantize_index_keys(jnp.asarray(rng.normal(size=(B, G, cfg.index_head_dim)), jnp.float32))
    pos = jnp.asarray([[150, 151, 152], [10, 11, 199]], jnp.int32)
    cos, sin = cos_sin(pos, layer_rope(cfg, 1))
    ref = np.asarray(ind.scores(x, qr, decode_index_keys(keys), cos, sin, pos + 1, "fast"))
    # compiled as the engine compiles it: without the options XLA may drop the bf16 head-sum rounding
    packed = jax.jit(lambda *a: fast_index.scores_packed(ind, *a), compiler_options=COMPILER_OPTIONS)
    new = np.asarray(packed(x, qr, keys, cos, sin, pos + 1))
    q, w = fast_index.query_and_weights(ind, x, qr, cos, sin)
    dots = np.einsum("bthd,bgd->bthg", np.asarray(q, np.float64), np.asarray(kv_layout.dequantize_index_keys(keys), np.float64))
    exact = np.sum(np.maximum(dots, 0) * np.asarray(w, np.float64)[..., None], 2)
    vis = np.arange(G)[None, None] < np.asarray(pos + 1)[..., None]
    assert np.array_equal(np.isfinite(new), vis) and np.array_equal(np.isfinite(ref), vis)
    top = float(np.abs(exact[vis]).max())
    err_new = np.abs(new[vis] - exact[vis]).max() / top
    err_ref = np.abs(ref[vis] - exact[vis]).max() / top
    assert err_new <= max(err_ref, 2.0 ** -8)
    k = 16
    pick = lambda s: np.sort(np.asarray(jax.lax.top_k(jnp.asarray(s, jnp.float32), k)[1]), -1)
    assert np.array_equal(pick(new), pick(ref))


def test_split_prefill_global_caches_exact(micro):
    cfg, params, tokens = micro["cfg"], micro["params"], micro["tokens"]
    ex_logits, ex_cache, ex_aux = micro["exact"]
    split = sp.make_split_prefill(micro["graphdef"], collect_topk=True)
    logits, cache, aux = split(params, tokens, buckets.empty_cache(cfg, 2, cfg.max_seq_len))
    W, d = cfg.window_size, cfg.decoder_start
    assert logits.shape == (2, W, cfg.vocab_size)
    # encoder-side and layer decoder_start's global caches: identical bytes
    for part in ("compressed", "index_keys", "compressor"):
        for key in ex_cache[part]:
            assert same(cache[part][key], ex_cache[part][key]), (part, key)
    assert same(cache["length"], ex_cache["length"])
    for l in range(d):  # encoder windows are exact too
        assert same(cache["window"][l], ex_cache["window"][l]), l
    # layer decoder_start's own top-k and its candidate pool over the tail: identical
    assert same(aux["topk"][d], ex_aux["topk"][d][:, -W:])
    assert same(aux["pool"], ex_aux["pool"][:, -W:])
    # the last window of the first decoder layer is exact; later layers are approximate by design
    assert same(cache["window"][d], ex_cache["window"][d])
    # later decoder layers see only the tail's window: the logits move (a floor that were ignored
    # would give exact prefill's bits), but stay on the exact logits' scale (no blow-up, no NaN);
    # the size of the change is measured by bench/prefill.py --accuracy
    diff = float(jnp.max(jnp.abs(logits[:, -1] - ex_logits[:, -1])))
    assert 0.0 < diff < float(jnp.max(jnp.abs(ex_logits[:, -1]))), diff
    later = [l for l in cfg.index_source_layers if l > d]
    assert later
    for l in later:  # a valid selection: ascending distinct positions < visible, min(width, visible) of them
        width = int(aux["topk"][l].shape[-1])
        N_vis = N // cfg.compress_ratios[cfg.roles[l].kv_source]  # groups complete at the last position
        for row in np.asarray(aux["topk"][l][:, -1]):
            picked = row[row >= 0]
            assert np.all(np.diff(picked) > 0) and np.all(picked < N_vis), (l, row)
            assert len(picked) == min(width, N_vis), (l, row)


@pytest.mark.slow
def test_split_prefill_with_tail_covering_prompt_is_exact(micro):
    cfg, params, tokens = micro["cfg"], micro["params"], micro["tokens"]
    ex_logits, ex_cache, ex_aux = micro["exact"]
    split = sp.make_split_prefill(micro["graphdef"], tail=N, collect_topk=True)
    logits, cache, aux = split(params, tokens, buckets.empty_cache(cfg, 2, cfg.max_seq_len))
    assert same(logits, ex_logits) and same(cache, ex_cache)
    for l in aux["topk"]:
        assert same(aux["topk"][l], ex_aux["topk"][l])
    # a prompt no longer than the window, default tail (= window): split is exact prefill
    W = cfg.window_size
    split_w = sp.make_split_prefill(micro["graphdef"], collect_topk=True)
    exact = sp.make_exact_prefill(micro["graphdef"], collect_topk=True)
    for n in (W, W - 3):
        lg, c, ax = split_w(params, tokens[:, :n], buckets.empty_cache(cfg, 2, cfg.max_seq_len))
        e_lg, e_c, e_ax = exact(params, tokens[:, :n], buckets.empty_cache(cfg, 2, cfg.max_seq_len))
        assert same(lg, e_lg) and same(c, e_c), n
        assert ax["topk"] and all(same(ax["topk"][l], e_ax["topk"][l]) for l in ax["topk"]), n


@pytest.mark.slow
def test_image_spans_through_exact_and_split_prefill_equal_forward():
    """Image spans reach the serving prefills and the engine: exact prefill with spans equals
    model.forward with the same spans bit for bit, and so do split prefill when the prompt fits the
    tail and the engine's prefill (exact and split); without the spans the logits move (the span
    rows and bias_vl routing act)."""
    cfg = micro_config(vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=48, vision_patch_size=4,
                       vision_max_n_token=64, vision_min_pixels=256, image_token_id=255)
    gd, params = nnx.split(random_model(cfg, seed=5))
    T = cfg.window_size  # the split's tail covers the prompt: Graph B is exact
    rng = np.random.default_rng(2)
    types = np.array([-1, -1, 0, 1, 1, 2, -1, -1])[:T]
    tokens = rng.integers(0, cfg.vocab_size - 1, (1, T))
    tokens[0, types >= 0] = cfg.image_token_id
    spans = (jnp.asarray(rng.standard_normal((1, T, cfg.dim)), jnp.bfloat16), jnp.asarray(types[None], jnp.int32))
    tokens, cache = jnp.asarray(tokens, jnp.int32), buckets.empty_cache(cfg, 1, cfg.max_seq_len)
    f_logits, f_cache, _ = make_step(gd, Runtime())(params, tokens, cache, None, None, None, spans)
    exact = sp.make_exact_prefill(gd)
    e_logits, e_cache, _ = exact(params, tokens, cache, spans=spans)
    assert same(e_logits, f_logits) and same(e_cache, f_cache)
    s_logits, s_cache, _ = sp.make_split_prefill(gd)(params, tokens, cache, spans=spans)
    assert same(s_logits, f_logits) and same(s_cache, f_cache)
    assert not same(exact(params, tokens, cache)[0], f_logits)

    # the engine (exact prefill, and split prefill for a prompt inside the tail) gives forward's last row
    from dsv41_jax.serving.engine import Engine, Request

    req = Request(prompt=[int(t) for t in tokens[0]], spans=(np.asarray(spans[0][0]), types))
    for exact_prefill in (True, False):
        engine = Engine(nnx.merge(gd, params), slots=1, min_capacity=cfg.max_seq_len, exact_prefill=exact_prefill,
                        fingerprint="test")
        logits = engine.prefill(req)[0]
        assert same(logits, f_logits[:, -1])
    with pytest.raises(ValueError, match="spans must be"):
        engine._check(Request(prompt=req.prompt, spans=(np.asarray(spans[0][0, :3]), types[:3])), 0)

    # a prompt longer than the tail: the engine's Graph A / Graph B with spans equal split_prefill's
    long_types = np.concatenate([types, types])
    long_tokens = jnp.concatenate([tokens, tokens], 1)
    long_spans = (jnp.concatenate([spans[0], spans[0][:, ::-1]], 1), jnp.asarray(long_types[None], jnp.int32))
    want = sp.make_split_prefill(gd, tail=engine.tail)(params, long_tokens, cache, spans=long_spans)[0][:, -1]
    got = engine.prefill(Request(prompt=[int(t) for t in long_tokens[0]],
                                 spans=(np.asarray(long_spans[0][0]), long_types)))[0]
    assert same(got, want)

    # split prefill's first decoder layer decides as exact prefill over the tail (CED: it reads
    # the global KV the encoder projected from every position, the image rows included)
    d, tail = cfg.decoder_start, engine.tail
    _, _, s_aux = sp.make_split_prefill(gd, tail=tail, collect_topk=True)(params, long_tokens, cache, spans=long_spans)
    exact_k = sp.make_exact_prefill(gd, collect_topk=True)
    _, e_cache, e_aux = exact_k(params, long_tokens, cache, spans=long_spans)
    n = s_aux["topk"][d].shape[1]
    assert n == tail < long_tokens.shape[1]
    assert same(s_aux["topk"][d], e_aux["topk"][d][:, -n:]) and same(s_aux["pool"], e_aux["pool"][:, -n:])
    # a chunk boundary inside a span (between the span's positions 3 and 4): every layer's top-k
    # decisions equal the one-chunk run's (bits only against the same schedule: not compared)
    cut = 4
    assert long_types[cut - 1] >= 0 and long_types[cut] >= 0
    first = (long_spans[0][:, :cut], long_spans[1][:, :cut])
    rest = (long_spans[0][:, cut:], long_spans[1][:, cut:])
    _, c1, a1 = exact_k(params, long_tokens[:, :cut], cache, spans=first)
    _, c2, a2 = exact_k(params, long_tokens[:, cut:], c1, spans=rest)
    assert set(a1["topk"]) == set(e_aux["topk"]) and e_aux["topk"]
    for l in e_aux["topk"]:
        assert np.array_equal(np.concatenate([a1["topk"][l], a2["topk"][l]], 1), e_aux["topk"][l]), l
    assert same(c2["length"], e_cache["length"])


def test_split_refuses_configs_it_cannot_serve():
    with pytest.raises(ValueError, match="come after the first decoder layer"):
        sp.check_splittable(micro_config(n_layers=5, compress_ratios=(0, 2, 1, 1, 1), kv_source_layers=(1, 2, 4),
                                         index_source_layers=(1, 2, 3, 4)))
    with pytest.raises(ValueError, match="needs a ratio-1 KV source"):
        sp.check_splittable(micro_config(compress_ratios=(0, 2, 2, 2, 2), kv_source_layers=(1,),
                                         index_source_layers=(1, 3), candidate_source_layer=-1))


# ------------------------------------------------------------------------------- prefix cache
def _turn1(micro):
    _, ex_cache, _ = micro["exact"]
    row = jax.tree.map(lambda a: a[:1], ex_cache)
    return row, np.asarray(micro["tokens"][0])


@pytest.mark.slow
def test_prefix_cache_restore_equals_uninterrupted_replay(micro, decode_step, tmp_path):
    cfg, params = micro["cfg"], micro["params"]
    W = cfg.window_size
    row, toks = _turn1(micro)
    replay = sp.make_replay(micro["graphdef"])
    fp = prefix_cache.model_fingerprint(params)
    turn2 = jnp.asarray([[5], [17]], jnp.int32)

    def continue_from(cache):
        logits, cache = replay(params, jnp.asarray(toks[None, -W:]), cache)
        replayed = cache
        outs = [logits[:, -1]]
        for t in range(turn2.shape[0]):
            lg, cache = decode_step(params, turn2[t][None], cache)
            outs.append(lg[:, -1])
        return outs, replayed, cache

    ref, ref_replayed, ref_cache = continue_from(sp.drop_window(row))
    path = tmp_path / "turn1.dsv41"
    header = prefix_cache.save_prefix(path, cfg, row, toks, fingerprint=fp)
    assert header["n_tokens"] == N and not list(tmp_path.glob(".*.tmp"))
    cache, stored = prefix_cache.load_prefix(path, cfg, capacity=cfg.max_seq_len, fingerprint=fp)
    assert np.array_equal(stored, toks)
    for part in ("compressed", "index_keys", "compressor", "length", "published"):  # byte for byte
        assert same(cache[part], row[part]), part
    got, replayed, got_cache = continue_from(cache)
    assert all(same(a, b) for a, b in zip(got, ref)) and same(got_cache, ref_cache)
    assert same(replayed, ref_replayed)
    # the replay rebuilt the windows without rewriting the global cache
    for part in ("compressed", "index_keys", "compressor", "length"):
        assert same(replayed[part], row[part]), part
    assert not same(replayed["window"], cache["window"])


def test_prefix_cache_refuses_bad_files(micro, tmp_path):
    cfg, params = micro["cfg"], micro["params"]
    row, toks = _turn1(micro)
    fp = prefix_cache.model_fingerprint(params)
    path = tmp_path / "c.dsv41"
    prefix_cache.save_prefix(path, cfg, row, toks, fingerprint=fp)
    raw = path.read_bytes()
    with pytest.raises(prefix_cache.PrefixCacheError, match="differing fields: window_size"):
        prefix_cache.load_prefix(path, micro_config(window_size=16), fingerprint=fp)
    with pytest.raises(prefix_cache.PrefixCacheError, match="other weights"):
        prefix_cache.load_prefix(path, cfg, fingerprint="0" * 64)
    cut = tmp_path / "cut.dsv41"
    cut.write_bytes(raw[:-100])
    with pytest.raises(prefix_cache.PrefixCacheError, match="truncated"):
        prefix_cache.load_prefix(cut, cfg, fingerprint=fp)
    cut.write_bytes(raw[:20])
    with pytest.raises(prefix_cache.PrefixCacheError, match="truncated"):
        prefix_cache.load_prefix(cut, cfg, fingerprint=fp)
    flipped = bytearray(raw)
    flipped[-5] ^= 0x40
    bad = tmp_path / "bad.dsv41"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(prefix_cache.PrefixCacheError, match="fails its checksum"):
        prefix_cache.load_prefix(bad, cfg, fingerprint=fp)
    flipped = bytearray(raw)
    flipped[30] ^= 0x01  # inside the JSON header
    bad.write_bytes(bytes(flipped))
    with pytest.raises(prefix_cache.PrefixCacheError, match="header checksum"):
        prefix_cache.load_prefix(bad, cfg, fingerprint=fp)
    bad.write_bytes(b"not a cache at all, just text")
    with pytest.raises(prefix_cache.PrefixCacheError, match="not a dsv41 prefix cache"):
        prefix_cache.load_prefix(bad, cfg, fingerprint=fp)
    with pytest.raises(prefix_cache.PrefixCacheError, match="does not exist"):
        prefix_cache.load_prefix(tmp_path / "missing", cfg, fingerprint=fp)
    with pytest.raises(prefix_cache.PrefixCacheError, match="token ids were given"):
        prefix_cache.save_prefix(path, cfg, row, toks[:-1], fingerprint=fp)
    # the weights check is the default: no fingerprint is no load; skipping it is spelled out
    with pytest.raises(TypeError, match="fingerprint"):
        prefix_cache.load_prefix(path, cfg)
    with pytest.raises(ValueError, match="prefix_cache.UNCHECKED to skip"):
        prefix_cache.load_prefix(path, cfg, fingerprint=None)
    assert np.array_equal(prefix_cache.load_prefix(path, cfg, fingerprint=prefix_cache.UNCHECKED)[1], toks)
    # a header that publishes more positions than it caches, or records no fingerprint, is refused
    rewritten = tmp_path / "rewritten.dsv41"
    with pytest.raises(prefix_cache.PrefixCacheError, match="5 positions are published but only 4 tokens"):
        prefix_cache.load_prefix(_with_header(raw, rewritten, n_tokens=4, published=5), cfg, fingerprint=fp)
    with pytest.raises(prefix_cache.PrefixCacheError, match="records no model fingerprint"):
        prefix_cache.load_prefix(_with_header(raw, rewritten, model_fingerprint=None), cfg, fingerprint=fp)


def _with_header(raw: bytes, path, **changes):
    """A copy of a prefix-cache file with header fields changed and a valid header checksum."""
    import hashlib
    import json
    import struct

    prefix = struct.Struct("<8sIQ")
    magic, version, hlen = prefix.unpack_from(raw)
    header = json.loads(raw[prefix.size:prefix.size + hlen])
    header.update(changes)
    hb = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(prefix.pack(magic, version, len(hb)) + hb + hashlib.sha256(hb).digest() + raw[prefix.size + hlen + 32:])
    return path


def test_model_fingerprint_covers_every_byte_of_every_tensor(micro):
    params = micro["params"]
    fp = prefix_cache.model_fingerprint(params)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    big = max(leaves, key=lambda kv: kv[1].size)
    assert big[1].size > 1 << 14  # larger than anything the old fingerprint read
    for path, leaf in (big, leaves[0]):
        raw = np.asarray(leaf).copy().reshape(-1).view(np.uint8)
        raw[raw.size // 2 + 1] ^= 0x10  # one bit of one byte in the middle
        changed = jax.tree_util.tree_map_with_path(
            lambda p, x: raw.view(leaf.dtype).reshape(leaf.shape) if p == path else x, params)
        assert prefix_cache.model_fingerprint(changed) != fp, jax.tree_util.keystr(path)
    assert prefix_cache.model_fingerprint(jax.tree.map(np.array, params)) == fp  # a copy is the same weights


def test_tensor_digest_is_the_same_sums_on_host_and_device(monkeypatch):
    import ml_dtypes  # noqa: F401  (registers the dtype names with numpy)

    for dtype, on_device in (("uint8", False), ("float32", False), ("bfloat16", True), ("float8_e4m3fn", True)):
        x = (np.random.default_rng(1).standard_normal(600) * 50).astype(dtype)
        b = [int(v) for v in x.reshape(-1).view(np.uint8)]
        # oracle: Python integers, reduced mod 2^32 at the end
        first = sum(v * (2 * i + 1) for i, v in enumerate(b)) % 2**32
        second = sum((v + 1) * (((i * 0x9E3779B1) % 2**32) | 1) for i, v in enumerate(b)) % 2**32
        assert prefix_cache.tensor_digest(x) == (first, second), dtype
        if on_device:  # the accelerator path (jit; compiled per dtype, so two of them)
            assert tuple(int(v) for v in prefix_cache._digest(jnp.asarray(x))) == (first, second), dtype
        with monkeypatch.context() as m:
            m.setattr(prefix_cache, "_CHUNK", 7)  # chunk edges do not change the sums
            assert prefix_cache.tensor_digest(x) == (first, second), dtype


# ------------------------------------------------------------------------------- buckets
def test_capacity_buckets_and_resize(micro):
    cfg = micro["cfg"]
    assert buckets.capacity_for(cfg, 1, 16) == 16
    assert buckets.capacity_for(cfg, 17, 16) == 32
    assert buckets.capacity_for(cfg, 64, 16) == 64
    with pytest.raises(ValueError, match="max_seq_len"):
        buckets.capacity_for(cfg, 65, 16)
    _, ex_cache, _ = micro["exact"]
    small = buckets.resize_cache(cfg, ex_cache, 32)
    assert buckets.capacity_of(cfg, small) == 32
    back = buckets.resize_cache(cfg, small, 64)
    for part in ("compressed", "index_keys"):
        for key, c in ex_cache[part].items():
            m = cfg.compress_ratios[int(key[5:])]
            for a, b in zip(c, back[part][key]):
                assert bool(jnp.array_equal(a[:, : N // m], b[:, : N // m]))


# ------------------------------------------------------------------------------- sampling
def _draw(logits, t, p, k, s, drawn, banned, **kw):
    """sampling.sample over a batch with one parameter set, no history, no mask (tokens only)."""
    B, V = logits.shape
    a = sampling.slot_arrays([sampling.SamplingParams(temperature=t, top_p=p, top_k=k, seed=s, **kw)] * B)
    hist = sampling.empty_history(B, V)
    masks = np.full((B, sampling.mask_words(V)), -1, np.int32)
    return sampling.sample(logits, a, drawn, hist, jnp.zeros(B, jnp.int32), jnp.zeros(B, bool), banned, masks)[0]


def test_sampling_filters_and_seeds():
    V = 50
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(4, V)) * 3, jnp.float32)
    banned = jnp.asarray(sampling.banned_mask(V, [int(np.argmax(logits[0]))]))
    zero = jnp.zeros(4, jnp.int32)
    greedy = _draw(logits, 0.0, 1.0, 0, 0, zero, banned)
    want = np.argmax(np.where(np.asarray(banned)[None], -np.inf, np.asarray(logits)), -1)
    assert np.array_equal(np.asarray(greedy), want)
    top1 = _draw(logits, 1.0, 1.0, 1, 7, zero, banned)
    assert np.array_equal(np.asarray(top1), want)  # top_k=1 is greedy
    # top_p: the sampled token is always inside the nucleus
    draws = np.stack([np.asarray(_draw(logits, 1.0, 0.5, 0, s, jnp.full((4,), s, jnp.int32), banned)) for s in range(20)])
    z = np.where(np.asarray(banned)[None], -np.inf, np.asarray(logits))
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for b in range(4):
        order = np.argsort(-probs[b], kind="stable")
        before = np.cumsum(probs[b][order]) - probs[b][order]
        nucleus = set(order[(before < 0.5) | (np.arange(V) == 0)])
        assert set(draws[:, b]) <= nucleus
    assert not np.asarray(banned)[draws].any()
    a = _draw(logits, 1.0, 1.0, 0, 3, jnp.full((4,), 2, jnp.int32), banned)
    b = _draw(logits[::-1], 1.0, 1.0, 0, 3, jnp.full((4,), 2, jnp.int32), banned)
    assert np.array_equal(np.asarray(a), np.asarray(b)[::-1])  # independent of the slot
    with pytest.raises(ValueError, match="top_p"):
        sampling.SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampling.banned_mask(V, [V])


def test_penalties_and_bias_follow_openai_and_hf():
    """`sampling.adjust` against the definitions written out in numpy: repetition (HF/vLLM) over
    prompt + generated, then frequency/presence (OpenAI) over generated, then logit_bias; a
    neutral row in the same batch is bitwise its raw logits. The history update inside `sample`
    counts `last` where active."""
    V, B = 40, 3
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    prompt, generated = [3, 5, 5, 7], [5, 9, 9, 9, 11]
    params = [sampling.SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                                      logit_bias=((2, 7.0), (11, -100.0))),
              sampling.SamplingParams(),  # neutral
              sampling.SamplingParams(logit_bias=((1, 0.0),))]  # a zero bias is neutral too
    hist = sampling.history_row(V, prompt)
    counts = np.bincount(generated, minlength=V).astype(np.int32)
    seen = hist["seen"][0] | (counts > 0)
    history = {"counts": jnp.asarray(np.stack([counts] * B)), "seen": jnp.asarray(np.stack([seen] * B))}
    banned = jnp.zeros(V, bool)
    masks = jnp.full((B, sampling.mask_words(V)), -1, jnp.int32)
    got = np.asarray(sampling.adjust(jnp.asarray(logits), sampling.slot_arrays(params), history, banned, masks))
    want = logits[0].astype(np.float64).copy()
    want[seen] = np.where(want[seen] > 0, want[seen] / np.float32(1.3), want[seen] * np.float32(1.3))
    want -= 0.25 * counts + 0.5 * (counts > 0)
    want[2] += 7.0
    want[11] -= 100.0
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-5)
    assert got[1].tobytes() == logits[1].tobytes() and got[2].tobytes() == logits[2].tobytes()
    # the step counts the token appended since the last draw, only in active rows
    a = sampling.slot_arrays(params)
    h0 = sampling.empty_history(B, V)
    _, h1 = sampling.sample(jnp.asarray(logits), a, jnp.zeros(B, jnp.int32), h0, jnp.asarray([4, 4, 6], jnp.int32),
                            jnp.asarray([True, True, False]), banned, masks)
    c = np.asarray(h1["counts"])
    assert c[0, 4] == c[1, 4] == 1 and c.sum() == 2 and np.asarray(h1["seen"]).sum() == 2
    with pytest.raises(ValueError, match="presence_penalty must be in"):
        sampling.SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias for token 3 must be in"):
        sampling.SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(ValueError, match="repetition_penalty must be in"):
        sampling.SamplingParams(repetition_penalty=0.0)


def test_packed_mask_unpacks_as_llguidance_applies_it():
    """The int32 words llguidance fills are unpacked on device to exactly the tokens
    `llguidance.numpy.apply_token_bitmask_inplace` (its own numpy reference) leaves finite."""
    lg = pytest.importorskip("llguidance.numpy")
    rng = np.random.default_rng(3)
    for V in (33, 64, 100):
        words = lg.allocate_token_bitmask(3, V)
        words[:] = rng.integers(-2**31, 2**31, size=words.shape, dtype=np.int64).astype(np.int32)
        words[2] = -1
        ref = np.zeros((3, V), np.float32)
        lg.apply_token_bitmask_inplace(ref, words)
        got = np.asarray(sampling.unpack_mask(jnp.asarray(words), V))
        assert np.array_equal(got, np.isfinite(ref)) and got[2].all()


# ------------------------------------------------------------------------------- engine
@pytest.mark.slow
def test_engine_batch_matches_alone_and_resumes(micro, tmp_path):
    from dsv41_jax.serving.engine import Engine, Request, pieces

    assert pieces(37, 16) == [16, 16, 4, 1] and pieces(8, 8) == [8]
    cfg = micro["cfg"]
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (8, 24, 16)]
    greedy = sampling.SamplingParams(max_tokens=6)
    eng = Engine(micro["model"], slots=3, min_capacity=64, prefill_chunk=8, banned_ids=[0])
    alone = [eng.run([Request(p, greedy)])[0].tokens for p in prompts]
    together = eng.run([Request(p, greedy) for p in prompts])
    assert [r.tokens for r in together] == alone
    assert all(r.finish_reason == "length" and r.timing["decode_s"] >= 0 for r in together)
    assert all(0 not in r.tokens for r in together)
    # stop tokens end a request early; sampling is reproducible from the seed
    stop = sampling.SamplingParams(max_tokens=6, stop_tokens=(alone[1][2],))
    r = eng.run([Request(prompts[1], stop)])[0]
    assert r.tokens == alone[1][:3] and r.finish_reason == "stop"
    hot = sampling.SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=4)
    assert eng.run([Request(prompts[0], hot)])[0].tokens == eng.run([Request(prompts[0], hot), Request(prompts[2], greedy)])[0].tokens
    # save after turn 1, resume from disk in turn 2
    path = str(tmp_path / "conv.dsv41")
    first = eng.run([Request(prompts[1], greedy, save_to=path)])[0]
    resumed = eng.run([Request([first.tokens[-1]] + prompts[0][:3], greedy, resume_from=path)])[0]
    assert resumed.cached_tokens == N + 5 and len(resumed.tokens) == 6
    with pytest.raises(ValueError, match="out of range"):
        eng.submit(Request([cfg.vocab_size]))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.submit(Request([1] * 60, sampling.SamplingParams(max_tokens=10)))


@pytest.mark.slow
def test_engine_steps_on_the_kernels_equal_xla_in_exact_mode(micro):
    """Exact mode: the engine's exact prefill, replay after a prefix restore and decode steps with
    impl="pallas" (the interpreted attention and indexer kernels, float64 at the oracle's rounding
    points) equal impl="xla" bit for bit, logits and caches. The decode covers both indexer paths:
    the kernel (layers 1, 2) and the in-pool scoring (layer 3: top-k 8 <= pool 12 < 64 rows)."""
    from dsv41_jax.serving.engine import Engine

    cfg, tokens, W = micro["cfg"], micro["tokens"], micro["cfg"].window_size
    out = {}
    with jax.enable_x64(True):
        for impl in ("xla", "pallas"):
            eng = Engine(micro["model"], slots=2, exact_prefill=True, runtime=Runtime(mode="exact", impl=impl))
            assert eng.decode_plan.kernel_mode == ("exact" if impl == "pallas" else None)
            whole = lambda n: jnp.full((2,), n, jnp.int32)  # noqa: E731 - every token real (no padding)
            # the cache as the engine keeps it: the kernels' word view with impl "pallas"
            assert eng.runtime.kv_words() == (impl == "pallas")
            empty = buckets.empty_cache(cfg, 2, cfg.max_seq_len, eng.runtime.kv_words())
            logits, cache, _ = eng.steps.prefill(eng.params, tokens, empty, None, None, None, whole(N))
            r_logits, cache = eng.steps.replay(eng.params, tokens[:, -W:], sp.drop_window(cache), None, None, whole(W))
            steps, nxt = [logits, r_logits], tokens[:, :1]
            for _ in range(2):
                logits, cache, _ = eng.steps.decode(eng.params, nxt, cache, None, jnp.ones(2, bool), None)
                steps.append(logits)
                nxt = jnp.argmax(logits, -1)[:, None].astype(jnp.int32)
            out[impl] = (steps, cache_form(cache, False))
    assert same(out["xla"], out["pallas"])
    assert not same(out["xla"][0][2], out["xla"][0][3])  # the steps differ (a test that can fail)


# ------------------------------------------------------------------------------- byte accounting
@pytest.mark.slow
def test_info_cache_bytes_match_the_cache_layout():
    """`dsv41 info`'s window bytes per sequence and persistent bytes per token, recounted from the
    arrays init_cache allocates at the released shapes (abstractly, nothing is allocated)."""
    from dsv41_jax.model.info import model_info

    cfg = ModelConfig.v41_flash()
    info = model_info(cfg)
    nbytes = lambda tree: sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))
    C = 8192
    cache = jax.eval_shape(lambda: buckets.empty_cache(cfg, 1, C))
    assert nbytes(cache["window"]) == info["window_bytes_per_sequence"] == 40 * 128 * 528
    per_token = (nbytes(cache["compressed"]) + nbytes(cache["index_keys"])) / C
    assert per_token == info["persistent_bytes_per_token"] == 890


def test_prefix_file_holds_only_global_parts(micro, tmp_path):
    cfg = micro["cfg"]
    row, toks = _turn1(micro)
    header = prefix_cache.save_prefix(tmp_path / "p", cfg, row, toks, fingerprint="0" * 64)
    names = {e["name"].split(".")[0] for e in header["arrays"]}
    assert names == {"tokens", "compressed", "index_keys", "compressor"}
    rows = sum(e["nbytes"] for e in header["arrays"] if e["name"].split(".")[0] in ("compressed", "index_keys"))
    from dsv41_jax.model.info import row_bytes

    rb = row_bytes(cfg)
    want = sum(N // cfg.compress_ratios[s] * (rb["compressed_kv"] + (rb["index_key"] if s in cfg.index_source_layers else 0))
               for s in cfg.kv_source_layers)
    assert rows == want


# ------------------------------------------------------------------------------- full-width cost
@pytest.mark.slow
def test_decode_cost_full_width():
    """Lean decode step at the released width (compile only): 4K within 10% of the arithmetic,
    and from 4K to 1M everything but the indexer's dot products (positions scored x 2 x 32 x
    128) constant within 2%; no loops or custom calls hide work (bench/decode.py prints the
    full table)."""
    from dsv41_jax.serving import cost

    cfg = cost.arithmetic_config(ModelConfig.v41_flash())
    lo, hi = 4096, 1 << 20
    dot = 2 * cfg.index_n_heads * cfg.index_head_dim
    m_lo = cost.decode_flops_by_role(cfg, lo)
    ar_lo = cost.arithmetic_decode(cfg, lo)
    assert abs(m_lo["flops"] / ar_lo["total"] - 1) <= 0.10
    m_hi = cost.decode_flops_by_role(cfg, hi)
    ar_hi = cost.arithmetic_decode(cfg, hi)
    rest = lambda f, ar: f - ar["positions_scored"] * dot
    assert abs(rest(m_hi["flops"], ar_hi) / rest(m_lo["flops"], ar_lo) - 1) <= 0.02
    assert 1.4 < m_hi["flops"] / m_lo["flops"] < 1.9
    for m in (m_lo, m_hi):
        assert m["hlo"] == {"while": 0, "custom_call": []}


def test_cost_analysis_counts_a_loop_body_once():
    """Why the no-loop check matters: a scan of four matmuls reports one matmul's FLOPs."""
    from dsv41_jax.serving import cost

    r = cost.loop_probe()
    assert r["unrolled"] == r["arithmetic"] and r["scan_hlo"]["while"] == 1
    assert r["scan"] < 0.3 * r["arithmetic"]


def test_info_text_reports_window_and_persistent_bytes():
    """`dsv41 info` prints the per-sequence window bytes and the persistent bytes per token."""
    from dsv41_jax.model.info import format_info, model_info

    text = format_info("v41-flash", model_info(ModelConfig.v41_flash()))
    assert "global KV per token             890.0 bytes  (persistent)" in text
    assert f"window KV per sequence     {40 * 128 * 528 / 2 ** 20:10.2f} MiB" in text


@pytest.mark.slow
def test_split_prefill_cost_full_width():
    from dsv41_jax.serving import cost

    r = cost.prefill_flops(cost.arithmetic_config(ModelConfig.v41_flash()), 65536)
    assert r["ratio"] <= 0.52
    assert r["split"]["hlo"]["while"] == 0 and r["exact"]["hlo"]["while"] == 0


@pytest.mark.slow
def test_split_prefill_on_golden_configs(golden_root):
    """Golden weights (fast mode): encoder-side caches, layer decoder_start's caches, top-k and
    pool are identical between split and exact prefill; the last-position logits differ by a
    measured amount (bench/prefill.py --golden prints the table, docs/SERVING.md records it)."""
    from dsv41_jax.engram.hashing import hash_ids
    from dsv41_jax.golden.data import discover

    checked = []
    for gc in discover(golden_root):
        stream = gc.longest_prefill()
        if stream is None:  # the DSpark and vision folders hold no text prefill case
            continue
        checked.append(gc.name)
        cfg = gc.cfg
        gd, params = nnx.split(gc.load_model())
        toks = np.asarray(stream, np.int64)[None]
        ids = None
        if gc.engram_hasher() is not None:
            layout, token_map = gc.engram_hasher()
            ids = jnp.asarray(hash_ids(layout, token_map, toks).astype(np.int32))
        t = jnp.asarray(toks, jnp.int32)
        sl, sc, sa = sp.make_split_prefill(gd, collect_topk=True)(params, t, buckets.empty_cache(cfg, 1, cfg.max_seq_len), ids)
        el, ec, ea = sp.make_exact_prefill(gd, collect_topk=True)(params, t, buckets.empty_cache(cfg, 1, cfg.max_seq_len), ids)
        d, W = cfg.decoder_start, cfg.window_size
        for part in ("compressed", "index_keys", "compressor"):
            assert same(sc[part], ec[part]), (gc.name, part)
        assert same(sa["topk"][d], ea["topk"][d][:, -W:]) and same(sa["pool"], ea["pool"][:, -W:]), gc.name
        diff = float(jnp.max(jnp.abs(sl[0, -1] - el[0, -1])))
        assert 0.0 < diff < 0.2 * float(jnp.max(jnp.abs(el[0, -1]))), (gc.name, diff)
    assert checked, f"no golden folder with a prefill case under {golden_root}"


def _runs_config():
    """SWA x2, Full r2, Reuse r2 x2, Full r1 (pool), Reindex r1, Reuse r1 x2: runs (0, 1), (3, 4), (7, 8)."""
    return ModelConfig.tiny(n_layers=9, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1), kv_source_layers=(2, 5),
                            index_source_layers=(2, 5, 6), candidate_source_layer=5, engram_layer_ids=(),
                            hc_sinkhorn_iters=2, max_seq_len=32)


def test_engine_holds_the_scanned_runs_stacked():
    """The engine's params hold each run its steps scan stacked (`stack_layers` at load), and its
    cache those runs' window rings; the params as stored, which the prefix-cache fingerprint hashes,
    stay per layer (the same fingerprint as an engine that stacks nothing); scan_layers off stacks
    nothing."""
    from dsv41_jax.model.stack import LayerStack
    from dsv41_jax.serving.engine import Engine

    model = random_model(_runs_config(), seed=1)
    held, flat = (Engine(model, slots=2, min_capacity=32, prefill_chunk=8, runtime=Runtime(scan_layers=scan))
                  for scan in (True, False))
    assert {b.run for b in nnx.merge(held.graphdef, held.params).layers if isinstance(b, LayerStack)} == {
        (0, 1), (3, 4), (7, 8)}
    assert not any(isinstance(b, LayerStack) for b in nnx.merge(flat.graphdef, flat.params).layers)
    assert held.fingerprint == flat.fingerprint
    # the same runs' window rings held stacked in the engine's cache (and only there)
    assert held.ring_runs == ((0, 1), (3, 4), (7, 8)) and flat.ring_runs == ()
    assert [type(w).__name__ for w in held.cache["window"][:5]] == ["RingStack", "NoneType", "WindowKV", "RingStack",
                                                                     "NoneType"]


@pytest.mark.slow
def test_engine_over_stacked_runs_equals_the_unrolled_engine():
    """Requests of several lengths (prefill pieces, decode) in one batch: the engine over stacked
    runs (scanned; their weights and window rings held stacked, read and written in place) gives the
    same tokens and every sampled position's logits, bit for bit, as the engine with every layer
    unrolled (`Runtime(scan_layers=False)`)."""
    from dsv41_jax.serving.engine import Engine, Request

    class Recording(Engine):
        def _emit(self, req, drawn, token, logits, row):
            self.seen.setdefault(req.request_id, []).append(np.asarray(jax.device_get(logits[row])))
            return super()._emit(req, drawn, token, logits, row)

    model = random_model(_runs_config(), seed=1)
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, model.cfg.vocab_size, n))) for n in (3, 11, 20)]
    out = []
    for scan in (True, False):
        eng = Recording(model, slots=2, min_capacity=32, prefill_chunk=8, runtime=Runtime(scan_layers=scan))
        eng.seen = {}
        assert len(eng.ring_runs) == (3 if scan else 0)
        res = eng.run([Request(p, sampling.SamplingParams(max_tokens=4), request_id=f"r{i}")
                       for i, p in enumerate(prompts)])
        out.append(([r.tokens for r in res], eng.seen))
    assert out[0][0] == out[1][0] and out[0][1].keys() == out[1][1].keys()
    for rid, rows in out[0][1].items():
        for a, b in zip(rows, out[1][1][rid], strict=True):
            np.testing.assert_array_equal(a, b)
