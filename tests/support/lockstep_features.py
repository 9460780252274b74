"""One engine call of each feature whose work used to run beside the lockstep (echo's scoring pass,
the grammar matcher, the vision tower) and speculation, on any engine: the scenario of
`tests/serving/test_engine_multihost.py`.

`answers(engine)` runs it on an `Engine` (the oracle: one process holding both devices of the same
mesh, in the test's own process) or on a `LeaderEngine` (process 0 of two);
`python -m tests.support.lockstep_features COORDINATOR PID TMP` is one process of the pair (process
1 follows process 0's calls). Both run the same partitioned programs on a mesh `expert=2`, so fast
numerics give the same bits in one process as across two (a mesh against one device, in exact
numerics, is tests/http/test_serve_matrix.py's, slow, and tests/http/test_serve_mesh.py's).

Kept small, since the default suite runs it: a one-layer model, fast numerics (the exact programs
took 1.6 times the compile), every request speculating (a constrained one cannot: it decodes
token by token), prompts of 6 or 24 tokens with `prefill_chunk` 24, so each prompt is one prefill
piece: each process compiles one program per step kind (the echo's scoring pass, the tower, one
prefill, the draft, verify, targets, commit, the sampler).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys

TOKENIZER = "tokenizer.json"
STOP = 203  # the speculated reply's fourth token (`answers`)
MESH = "expert=2"  # the pair's one device each, or two of the oracle's process


def config():
    from dsv41_jax.config import ModelConfig

    return ModelConfig.tiny_vision(n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                                   candidate_source_layer=-1, engram_layer_ids=(), n_routed_experts=4,
                                   max_seq_len=128, n_mtp_layers=1, dspark_block_size=2, dspark_noise_token_id=3,
                                   dspark_target_layer_ids=(0,), dspark_markov_rank=16, dspark_n_routed_experts=4,
                                   dspark_n_activated_experts=2)


def write_tokenizer(folder) -> None:
    """The byte tokenizer with the image placeholder, where `engine` reads it."""
    from dsv41_jax.train.data import ByteTokenizer

    ByteTokenizer().save_json(os.path.join(folder, TOKENIZER), image_token=True)


def engine(folder, devices=None):
    """(engine, tokenizer, grammars): fast numerics, two slots, K=2 drafts, on a mesh `expert=2`
    over `devices` (default: every device of every process)."""
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving.constraints import Grammars
    from dsv41_jax.serving.engine import Engine
    from dsv41_jax.serving.generate import banned_ids
    from dsv41_jax.serving.random_weights import random_model
    from dsv41_jax.text.tokenizer import load_tokenizer
    from sharding.mesh import make_mesh
    from sharding.serving import engine_strategies

    tok = load_tokenizer(os.path.join(folder, TOKENIZER))
    cfg = config()
    eng = Engine(random_model(cfg, seed=7), slots=2, min_capacity=128, prefill_chunk=24, exact_prefill=True,
                 speculative=2, runtime=Runtime(mode="fast"), banned_ids=tuple(banned_ids(cfg, tok)),
                 **engine_strategies(make_mesh(MESH, devices), "inference"))
    return eng, tok, Grammars(tok, cfg.vocab_size)


def answers(eng, tok, grammars) -> dict:
    """An echo's prompt logprobs, then an image prompt twice: a regex-constrained reply and a
    speculated one (tokens and each token's logprob), and the drafter's counts; JSON's types."""
    from PIL import Image

    from dsv41_jax.serving.engine import Request
    from dsv41_jax.serving.http.images import ImageOptions, ImagePrompter
    from dsv41_jax.serving.sampling import SamplingParams

    out, rows = {"echo": eng.prompt_logprobs([0, 70, 80, 90, 100, 110])}, {}  # one piece (`steps.pieces`)
    buf = io.BytesIO()
    Image.new("RGB", (12, 9), (220, 20, 20)).save(buf, "PNG")
    look = [{"role": "user", "content": [{"type": "text", "text": "look at it"}, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}]}]
    made = ImagePrompter(eng, ImageOptions()).build(tok, look, thinking=False)
    # one prefill piece of 24, the engine's largest (`steps.piece_set`)
    assert len(made.tokens) == 24, len(made.tokens)
    regex = grammars.constraint(grammars.regex("[a-c]{2}x"))
    # admitted together, the constrained reply (token by token: three verify steps' first positions,
    # then its stop) rides on the speculated reply's steps, which stops at its fourth token (the id
    # STOP, drafts never accepted by this random drafter) in the third: every step is speculative,
    # so no plain decode program is compiled (were the tokens to change, the reply would end through
    # one plain step at max_tokens: the same checks, one program more)
    reqs = [Request(made.tokens, SamplingParams(max_tokens=6, stop_tokens=(tok.eos_id,)), request_id="regex",
                    spans=made.spans, constraint=regex),
            Request(made.tokens, SamplingParams(max_tokens=8, stop_tokens=(tok.eos_id, STOP)), request_id="speculated",
                    spans=made.spans)]
    for r in reqs:
        r.want_logprobs = True
        r.on_token = (lambda rid: lambda t, lp: rows.setdefault(rid, []).append((t, float(lp[t]))))(r.request_id)
        eng.submit(r)
    while not eng.idle():  # the calls themselves (Engine.run would reach past a LeaderEngine's publishing)
        eng.step()
    for r in reqs:
        out[r.request_id] = (eng.done[r.request_id].tokens, rows[r.request_id])
    out["spec_stats"] = dict(eng.spec_stats)
    return json.loads(json.dumps(out))  # tuples as lists, as the pair's answer comes back


def _share_programs(cache: str) -> None:
    """Process 1 loads each program process 0 compiles (`jax_share_binary_between_hosts`, through the
    coordination service) instead of compiling it too: the same executables, half the compile time.
    Sharing finds a program by its persistent-cache key (so a cache folder is needed), and JAX 0.10's
    key hashes the CPU topology's fingerprint, which differs between the processes of one CPU
    topology: the key hashes the devices' kinds instead, as JAX does for a backend without topology
    descriptions (the devices themselves are in the key's compile options, as the device assignment)."""
    import jax
    from jax._src import cache_key

    cache_key._hash_accelerator_config = cache_key._hash_devices
    # joining turns the cache off on CPU (sharding.mesh.init_distributed: a stale cache breaks gloo);
    # this run's folder is new, and sharing goes through it
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_share_binary_between_hosts", True)


def main(coordinator: str, pid: int, folder: str) -> None:
    """One process of two, one CPU device each, one mesh `expert=2` over both: process 0 answers
    through `LeaderEngine` and prints the answers as JSON; process 1 follows."""
    from dsv41_jax.cli.distributed import join

    join(argparse.Namespace(coordinator=coordinator, num_processes=2, process_id=pid), "lockstep-features")
    _share_programs(os.path.join(folder, "cache"))
    from dsv41_jax.serving.lockstep import Channel, LeaderEngine, follow

    eng, tok, grammars = engine(folder)
    channel = Channel()
    if pid == 1:
        follow(eng, channel, grammars=lambda: grammars)
        return
    print(json.dumps(answers(LeaderEngine(eng, channel), tok, grammars)), flush=True)
    channel.publish(("stop",))
    channel.drained(timeout=60)


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: jax.distributed.shutdown's barrier would wait minutes for the other process
    sys.stdout.flush()
    os._exit(0)
