"""The engine in fast numerics at long context against `model.forward` in fast and exact numerics.

    python bench/long_context_fast.py [--lengths 4096x3072] [--json] [--ties]

The five-layer layout of tests/serving/test_engine_long_context.py (every decoder role, tiny width):
the engine (split prefill in padded pieces of 1,024, the lean decode with packed index scoring)
generates 3 greedy tokens per prompt, once as served (the split prefill, whose decoder layers see only
the tail's window: approximate by design, docs/REFERENCE.md §5) and once with `exact_prefill` (every
layer over every token: what differs is numerics only); `model.forward` is fed the same prompt in
unpadded pieces and then the engine's tokens. Prints, per reported row, max |dlogprob| of engine vs
forward (both fast) and of forward fast vs forward exact, and whether the greedy tokens are the
forward's argmax.

Where the engine's decode differs, `decode_decisions` says why: from the forward's own cache, one
decode step with the engine's plan (the packed index scoring, `split_prefill.decode_plan`) and one
with the plan that keeps `Indexer.scores`' rounding (packed=False, model.forward's numerics bit for
bit); per step the logprob difference and, per indexer layer, how many of the top-k picks differ.
A measurement, not a test: fast numerics round where the kernels do, so no bound is asserted here.

Whether such a swap is a near-tie, `--ties` says (`index_ties`, no engines): the first decode step
from the forward's cache, with each plan, scores every index source's candidates three ways on the
same inputs (the packed scoring, `Indexer.scores`, and float64 from the same FP4 query and key values
and bf16 head weights); per layer the picks that differ from the float64 top-k, each swapped pair's
exact margin beside the fast scores' errors there, and `golden.fast_report.near_ties` (the bound of
docs/NUMERICS.md "fast numerics": exact margin <= 2 x the row's largest score error).
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.golden import fast_report
from dsv41_jax.layers import fast_index
from dsv41_jax.model import block as body
from dsv41_jax.model.probe import Probe
from dsv41_jax.model.transformer import init_cache, make_step
from dsv41_jax.runtime import COMPILER_OPTIONS, Runtime
from dsv41_jax.serving import sampling
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.random_weights import random_model
from dsv41_jax.serving.split_prefill import decode_plan, decode_step
from dsv41_jax.serving.steps import forward_logprob_rows, pieces

CHUNK, NEW = 1024, 3
# the engine as served (the split prefill: Graph B sees only the tail's window, docs/REFERENCE.md §5,
# approximate by design) and with every layer over every prompt token (numerics only)
ENGINES = {"split prefill": False, "exact prefill": True}


def decode_decisions(graphdef, params, cfg, prompt: list[int], generated: list[int]) -> list[dict]:
    """Per decode step from model.forward's fast cache: max |dlogprob| of the engine's packed plan
    against the unpacked one (= model.forward), and per indexer layer the top-k picks (out of
    rows x k) the packed scoring chooses differently."""
    rt = Runtime(mode="fast")
    cache, _ = forward_cache(graphdef, params, cfg, prompt)

    @functools.partial(jax.jit, static_argnums=(3,), compiler_options=COMPILER_OPTIONS)
    def decode(params, tokens, cache, plan):
        return decode_step(nnx.merge(graphdef, params), tokens, cache, plan, collect_topk=True)

    packed, plain = decode_plan(rt, packed=True), decode_plan(rt, packed=False)
    out = []
    for tok in generated[:-1]:
        tokens = jnp.asarray([[tok]], jnp.int32)
        lp, _, aux_p = decode(params, tokens, cache, packed)
        lu, cache, aux_u = decode(params, tokens, cache, plain)
        picks = {}
        for layer, idx in aux_u["topk"].items():
            a, b = np.sort(np.asarray(aux_p["topk"][layer]), -1), np.sort(np.asarray(idx), -1)
            differ = sum(len(set(x.tolist()) ^ set(y.tolist())) // 2
                         for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])))
            picks[int(layer)] = f"{differ}/{b.size}"
        rows = [np.asarray(jax.nn.log_softmax(r[0, -1].astype(jnp.float32))) for r in (lp, lu)]
        out.append({"dlogprob": float(np.abs(rows[0] - rows[1]).max()), "topk_picks_differ": picks})
    return out


class IndexScoreProbe(Probe):
    """At each index source, after it selected: the query side (MXFP4 query values q, bf16 head weights
    w), the index keys as float32 (the FP4 values, exact), the visible length, the candidate pool (in-pool
    layers), the indexer's input x, and both fast scorings over every cached key on these same inputs:
    the packed one (`fast_index.scores_packed`) and `Indexer.scores` (model.forward's rounding).

    The body's scoring context exposes its inputs only through `score(pick, keys)`, which applies `pick`
    to x, qr, cos, sin and visible in that order: a recording `pick` gets them without a second path."""

    def scored(self, l, ctx, inputs) -> dict:
        c, seen = ctx(), []
        keys = c["store"].stored_index_keys(c["src"])
        unpacked = c["score"](lambda a: seen.append(a) or a, body.decode_index_keys(keys))
        x, qr, cos, sin, visible = seen
        q, w = fast_index.query_and_weights(c["attn"].indexer, x, qr, cos, sin)
        return {"index": {"x": x, "q": q, "w": w, "k": fast_index.index_keys_f32(keys), "visible": visible,
                          "pool": c["pool"], "unpacked": unpacked,
                          "packed": fast_index.scores_packed(c["attn"].indexer, x, qr, keys, cos, sin, visible)}}


def probed_decode(graphdef, cfg):
    """jit (params, tokens, cache, plan) -> (logits, {layer: top-k}, {layer: `IndexScoreProbe` record}):
    `decode_step`'s body (embed, the layers on the cache, head) with the probe attached; `index_ties`
    checks its logits and picks against `decode_step`'s, bit for bit."""
    @functools.partial(jax.jit, static_argnums=(3,), compiler_options=COMPILER_OPTIONS)
    def run(params, tokens, cache, plan):
        model = nnx.merge(graphdef, params)
        h, pre = body.embed(model, tokens)
        state = body.LayerState.first(h, pre, body.QuantStore(cfg, cache))
        state, rec = body.run_layers(model, state, body.Span.at(cache["length"], tokens.shape[1]), plan,
                                     range(cfg.n_layers), IndexScoreProbe())
        return body.head(model, state.h, state.pre, plan.runtime.mode)[0], rec["topk"], rec["index"]

    return run


def _topk(scores: np.ndarray, k: int) -> set[int]:
    """The k best finite positions, ties to the lower position (as `select_topk`)."""
    order = np.lexsort((np.arange(scores.size), -scores))[:k]
    return {int(g) for g in order if np.isfinite(scores[g])}


def _scores(r: dict, pool: bool = True) -> dict:
    """{"exact", "packed", "unpacked"}: an `IndexScoreProbe` record's scores [G], -inf past the visible
    length and (pool) outside the candidate pool; "exact" = sum_h w_h relu(q_h . k_g) in float64 from
    the same q, w and keys (their FP4 and bf16 values make every product and sum exact to ~1e-16)."""
    q, w, kf = (np.asarray(r[n], np.float64) for n in ("q", "w", "k"))
    out = {"exact": np.einsum("h,hg->g", w[0, 0], np.maximum(np.einsum("hd,gd->hg", q[0, 0], kf[0]), 0.0))}
    out.update({n: np.asarray(r[n], np.float64)[0, 0] for n in ("packed", "unpacked")})
    keep = np.arange(out["exact"].size) < int(np.asarray(r["visible"])[0, 0])
    if pool and r["pool"] is not None:
        keep &= np.asarray(r["pool"])[0, 0]
    return {n: np.where(keep, v, -np.inf) for n, v in out.items()}


def _ties(scores: dict, own: set[int], k: int) -> dict:
    """A selection of k (`own`) against the float64 top-k of the same scores: per swapped pair (the
    weakest own-only pick against the strongest exact-only one) the exact scores, their margin and
    each fast scoring's error there; and the project's near-tie test (`fast_report.near_ties`: the
    exact boundary margin <= 2 x the row's largest |fast - exact|) per fast scoring."""
    exact = scores["exact"]
    ref = _topk(exact, k)
    fast = {n: v for n, v in scores.items() if n != "exact"}
    pairs = [{"picked": a, "exact_pick": b, "exact_scores": [float(exact[b]), float(exact[a])],
              "exact_margin": float(exact[b] - exact[a]),
              **{f"{n}_err": [float(f[b] - exact[b]), float(f[a] - exact[a])] for n, f in fast.items()}}
             for a, b in zip(sorted(own - ref, key=lambda g: exact[g]), sorted(ref - own, key=lambda g: -exact[g]))]
    with np.errstate(invalid="ignore"):  # -inf - -inf where a position is out of reach: not a score
        tests = {n: fast_report.near_ties(exact[None], f[None], k) for n, f in fast.items()}
    return {"candidates": int(np.isfinite(exact).sum()), "picks_differ_from_exact": len(own - ref), "swaps": pairs,
            "boundary_margin": float(next(iter(tests.values()))[0][0]),
            "score_err": {n: float(t[1][0]) for n, t in tests.items()},
            "near_tie": {n: bool(t[2][0]) for n, t in tests.items()},
            "own_is_topk_of": [n for n, f in fast.items() if _topk(f, k) == own]}


def _pool_ties(r: dict, pool: np.ndarray, cfg) -> dict:
    """The candidate source's pool (`candidate_pool`: the blocks of the best maxima, the newest block
    pinned) against the float64 block scores' choice: `_ties` over the unpinned blocks."""
    bs, visible = cfg.candidate_block_size, int(np.asarray(r["visible"])[0, 0])
    blocks = {}
    for n, v in _scores(r, pool=False).items():
        b = np.pad(v, (0, -v.size % bs), constant_values=-np.inf).reshape(-1, bs).max(-1)
        b[(visible - 1) // bs] = -np.inf  # pinned: in every pool, so not a decision
        blocks[n] = b
    own = {int(g) // bs for g in np.flatnonzero(pool[0, 0])} - {(visible - 1) // bs}
    return _ties(blocks, own, cfg.candidate_topk_blocks - 1)


def index_ties(graphdef, params, cfg, prompt: list[int]) -> dict:
    """The first decode step from model.forward's fast cache (its token: the forward's argmax), once with
    the packed plan and once unpacked: per index source, its picks against the float64 top-k of the same
    inputs (`_layer_ties`), and how far its input x is from the other plan's (0: the same inputs)."""
    cache, last = forward_cache(graphdef, params, cfg, prompt)
    tokens = jnp.asarray([[int(np.argmax(last))]], jnp.int32)
    rt, run = Runtime(mode="fast"), probed_decode(graphdef, cfg)

    @functools.partial(jax.jit, static_argnums=(3,), compiler_options=COMPILER_OPTIONS)
    def served(params, tokens, cache, plan):
        return decode_step(nnx.merge(graphdef, params), tokens, cache, plan, collect_topk=True)

    out, recs, picks, rows = {}, {}, {}, {}
    for name, packed in (("packed", True), ("unpacked", False)):
        plan = decode_plan(rt, packed=packed)
        logits, picks[name], recs[name] = run(params, tokens, cache, plan)
        rows[name] = np.asarray(jax.nn.log_softmax(logits[0, -1].astype(jnp.float32)))
        topk = picks[name]
        ref_logits, _, aux = served(params, tokens, cache, plan)
        same = bool(np.array_equal(np.asarray(logits), np.asarray(ref_logits))
                    and all(np.array_equal(np.asarray(topk[l]), np.asarray(aux["topk"][l])) for l in aux["topk"]))
        layers = {}
        for l, r in recs[name].items():
            own = {int(g) for g in np.asarray(topk[l])[0, 0] if g >= 0}
            sc = _scores(r)
            layers[int(l)] = {"in_pool": r["pool"] is not None, **_ties(sc, own, cfg.index_topk),
                              # the oracle's decisions follow the reference's roundings (`Indexer.scores`): the
                              # same test with those scores as the reference, as golden-check's fast report does
                              "vs_reference_rounding": _ties({"exact": sc["unpacked"], "packed": sc["packed"]}, own,
                                                             cfg.index_topk)}
            if r["pool"] is not None:  # the pool it searched: its candidate source's decision
                layers[int(l)]["pool_of_source"] = _pool_ties(recs[name][cfg.candidate_source_layer], r["pool"], cfg)
        out[name] = {"equals_decode_step": same, "layers": layers}
    for l in recs["packed"]:  # what `decode_decisions` counts, and whether the inputs were the same
        dx = np.abs(np.asarray(recs["packed"][l]["x"], np.float32) - np.asarray(recs["unpacked"][l]["x"], np.float32))
        sets = [set(np.asarray(picks[n][l]).ravel().tolist()) for n in ("packed", "unpacked")]
        out["packed"]["layers"][int(l)].update(picks_vs_unpacked_run=len(sets[0] - sets[1]),
                                               input_vs_unpacked_run=float(dx.max()))
    return {"prompt": len(prompt), "token": int(tokens[0, 0]),
            "dlogprob_packed_vs_unpacked": float(np.abs(rows["packed"] - rows["unpacked"]).max()), **out}


def forward_cache(graphdef, params, cfg, prompt: list[int]):
    """(model.forward's fast cache after `prompt` fed in the exact prefill's unpadded pieces, the
    prompt's last logits row [V])."""
    step = make_step(graphdef, Runtime(mode="fast"))
    cache, start = init_cache(cfg, 1), 0
    for n in pieces(len(prompt), CHUNK, padded=False):
        logits, cache, _ = step(params, jnp.asarray([prompt[start:start + n]], jnp.int32), cache, None)
        start += n
    return cache, np.asarray(logits[0, -1], np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096x3072", help="prompt lengths, batched, e.g. 4096x3072")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ties", action="store_true",
                    help="only `index_ties` (the first decode step's index scores, packed and unpacked, against "
                         "float64), per prompt on its own; no engines")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split("x")]
    cfg = ModelConfig.tiny(engram_layer_ids=(), max_seq_len=max(lengths) + 64, n_layers=5,
                           compress_ratios=(0, 2, 1, 1, 1), kv_source_layers=(1, 2), index_source_layers=(1, 2, 3),
                           candidate_source_layer=2, hc_sinkhorn_iters=3, n_routed_experts=4, vocab_size=256)
    model = random_model(cfg, seed=7)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(11)  # the prompts are drawn in order: "4096" alone is the first of "4096x3072"
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in lengths]
    t0 = time.time()
    if a.ties:
        out = [index_ties(graphdef, params, cfg, p) for p in prompts]
        print(json.dumps({"ties": out, "seconds": time.time() - t0}, indent=None if a.json else 1))
        return 0 if all(r[n]["equals_decode_step"] for r in out for n in ("packed", "unpacked")) else 1
    runs = {name: run_engine(model, prompts, exact_prefill=exact) for name, exact in ENGINES.items()}
    rows: dict[tuple, tuple] = {}  # forward (fast, exact) rows per (prompt, tokens)

    def forward_rows(prompt, tokens):
        key = (tuple(prompt), tuple(tokens))
        if key not in rows:
            fast = forward_logprob_rows(graphdef, params, cfg, Runtime(mode="fast"), prompt, tokens, CHUNK)
            with jax.enable_x64(True):
                exact = forward_logprob_rows(graphdef, params, cfg, Runtime(mode="exact"), prompt, tokens, CHUNK)
            rows[key] = fast, exact
        return rows[key]

    out = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": lengths[i]}
        for name, results in runs.items():
            tokens, seen = results[i]
            fast, exact = forward_rows(prompt, tokens)
            row[name] = {"tokens": tokens, "tokens_are_forward_argmax": tokens == [int(np.argmax(r)) for r in fast],
                         "engine_vs_forward_fast": [float(np.abs(a - b).max()) for a, b in zip(seen, fast)],
                         "forward_fast_vs_exact": [float(np.abs(a - b).max()) for a, b in zip(fast, exact)]}
        row["packed_vs_unpacked_decode"] = decode_decisions(graphdef, params, cfg, prompt, runs["split prefill"][i][0])
        out.append(row)
        if not a.json:
            print(json.dumps(row), flush=True)
    if a.json:
        print(json.dumps({"runs": out, "seconds": time.time() - t0}))
    return 0 if all(r[name]["tokens_are_forward_argmax"] for r in out for name in ENGINES) else 1


def run_engine(model, prompts, exact_prefill: bool) -> list[tuple[list[int], list[np.ndarray]]]:
    """(greedy tokens, logprob rows) per prompt from one batched run of a fast-numerics engine."""
    seen = [[] for _ in prompts]
    eng = Engine(model, slots=len(prompts), prefill_chunk=CHUNK, min_capacity=64, runtime=Runtime(mode="fast"),
                 exact_prefill=exact_prefill)
    results = eng.run([Request(p, sampling.SamplingParams(max_tokens=NEW), want_logprobs=True,
                               on_token=lambda tok, lp, i=i: seen[i].append(np.asarray(lp)))
                       for i, p in enumerate(prompts)])
    return [(res.tokens, rows) for res, rows in zip(results, seen)]


if __name__ == "__main__":
    raise SystemExit(main())
