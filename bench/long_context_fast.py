"""The engine in fast numerics at long context against `model.forward` in fast and exact numerics.

    python bench/long_context_fast.py [--lengths 4096x3072] [--json]

The five-layer layout of tests/serving/test_engine_long_context.py (every decoder role, tiny width):
the engine (split prefill in padded pieces of 1,024, the lean decode with packed index scoring)
generates 3 greedy tokens per prompt; `model.forward` is fed the same prompt in unpadded pieces and
then the engine's tokens. Prints, per reported row, max |dlogprob| of engine vs forward (both fast)
and of forward fast vs forward exact, and whether the greedy tokens are the forward's argmax.
A measurement, not a test: fast numerics round where the kernels do, so no bound is asserted here.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import jax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import sampling
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.random_weights import random_model
from dsv41_jax.serving.steps import forward_logprob_rows

CHUNK, NEW = 1024, 3


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
    seen = [[] for _ in prompts]
    t0 = time.time()
    eng = Engine(model, slots=len(prompts), prefill_chunk=CHUNK, min_capacity=64, runtime=Runtime(mode="fast"))
    results = eng.run([Request(p, sampling.SamplingParams(max_tokens=NEW), want_logprobs=True,
                               on_token=lambda tok, lp, i=i: seen[i].append(np.asarray(lp)))
                       for i, p in enumerate(prompts)])
    out = []
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        fast = forward_logprob_rows(graphdef, params, cfg, Runtime(mode="fast"), prompt, res.tokens, CHUNK)
        with jax.enable_x64(True):
            exact = forward_logprob_rows(graphdef, params, cfg, Runtime(mode="exact"), prompt, res.tokens, CHUNK)
        out.append({"prompt": lengths[i], "tokens": res.tokens,
                    "tokens_are_forward_argmax": res.tokens == [int(np.argmax(r)) for r in fast],
                    "engine_vs_forward_fast": [float(np.abs(a - b).max()) for a, b in zip(seen[i], fast)],
                    "forward_fast_vs_exact": [float(np.abs(a - b).max()) for a, b in zip(fast, exact)]})
        if not a.json:
            print(json.dumps(out[-1]), flush=True)
    if a.json:
        print(json.dumps({"runs": out, "seconds": time.time() - t0}))
    return 0 if all(r["tokens_are_forward_argmax"] for r in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
