"""The engine in fast numerics at long context against `model.forward` in fast and exact numerics.

    python bench/long_context_fast.py [--lengths 4096x3072] [--json]

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
from dsv41_jax.model.transformer import init_cache, make_step
from dsv41_jax.runtime import Runtime
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
    step = make_step(graphdef, rt)
    cache, start = init_cache(cfg, 1), 0
    for n in pieces(len(prompt), CHUNK, padded=False):
        _, cache, _ = step(params, jnp.asarray([prompt[start:start + n]], jnp.int32), cache, None)
        start += n

    @functools.partial(jax.jit, static_argnums=(3,))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096x3072", help="prompt lengths, batched, e.g. 4096x3072")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split("x")]
    cfg = ModelConfig.tiny(engram_layer_ids=(), max_seq_len=max(lengths) + 64, n_layers=5,
                           compress_ratios=(0, 2, 1, 1, 1), kv_source_layers=(1, 2), index_source_layers=(1, 2, 3),
                           candidate_source_layer=2, hc_sinkhorn_iters=3, n_routed_experts=4, vocab_size=256)
    model = random_model(cfg, seed=7)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in lengths]
    t0 = time.time()
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
