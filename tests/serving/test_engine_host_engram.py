"""The serving engine with its Engram tables in host memory (`sharding.serving.HostTables`,
`dsv41 serve --engram host`) against the same engine with the tables in HBM.

Oracle: the HBM engine (row-sharded tables on a mesh). The host engine gathers each step's rows
on the host into a compact table and remaps the ids (`sharding.engram_shard.HostEngramTables`);
every number must be the HBM engine's bit for bit: greedy tokens, the logprobs of every emitted
token for a batch of concurrent requests, and a prompt's echo logprobs (`prompt_logprobs`), on
one device and on 8 fake CPU devices (expert=4,tensor=2; the root conftest provides them), in
exact numerics (slow) and fast numerics. And the devices hold none of the tables.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import sampling
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.prompt_logprobs import prompt_logprobs
from dsv41_jax.serving.random_weights import random_model
from sharding.mesh import make_mesh
from sharding.serving import bytes_per_device
from sharding.serving import engine_strategies

# one sliding-window layer with Engram, MoE (8 experts: 2 per device at expert=4) and mHC: the
# engine's host-table path at the compile time of the smallest model (exact prefill)
SMALL = ModelConfig.tiny(vocab_size=64, n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                         candidate_source_layer=-1, engram_layer_ids=(0,), max_seq_len=32, max_batch_size=2)
# every decoder role, Engram on two layers (tests/serving/test_engine_mesh.py's model): split prefill,
# Graph B's tail and a conversation resume's replay read Engram ids too
FULL = ModelConfig.tiny(max_seq_len=64, n_layers=5, compress_ratios=(0, 2, 1, 1, 1), kv_source_layers=(1, 2),
                        index_source_layers=(1, 2, 3), candidate_source_layer=2, hc_sinkhorn_iters=3,
                        n_routed_experts=8, vocab_size=256, engram_layer_ids=(1, 3))


def _engram(cfg):
    from dsv41_jax.engram.hashing import EngramLayout

    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim,
                                cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id)
    return layout, np.arange(cfg.vocab_size, dtype=np.int64) % cfg.engram_compressed_vocab_size


def _serve(model, spec, host, prompts, *, exact_prefill, mode, chunk=8, tmp_path=None):
    """(tokens per request, logprob rows per request, echo logprobs, engine) of one engine."""
    cfg = model.cfg
    eng = Engine(model, slots=2, min_capacity=cfg.max_seq_len, prefill_chunk=chunk, exact_prefill=exact_prefill,
                 runtime=Runtime(mode=mode), engram=_engram(cfg),
                 **engine_strategies(None if spec is None else make_mesh(spec), engram_host=host))
    rows: dict[str, list] = {}
    greedy = sampling.SamplingParams(max_tokens=3)

    def request(i, p, **kw):
        return Request(p, greedy, request_id=f"r{i}", want_logprobs=True,
                       on_token=lambda tok, lp, i=i: rows.setdefault(f"r{i}", []).append(lp), **kw)

    save = (lambda i: str(tmp_path / f"{host}{i}") if i == 1 else None) if tmp_path is not None else (lambda i: None)
    res = eng.run([request(i, p, save_to=save(i)) for i, p in enumerate(prompts)])
    tokens = [r.tokens for r in res]
    if tmp_path is not None:  # the next turn of request 1's conversation: the replayed window reads Engram ids
        turn2 = eng.run([request(9, [res[1].tokens[-1]] + prompts[0][:3], resume_from=str(tmp_path / f"{host}1"))])
        tokens.append(turn2[0].tokens)
    return tokens, rows, prompt_logprobs(eng, prompts[-1]), eng


def _compare(model, spec, prompts, **kw):
    hbm, host = (_serve(model, spec, h, prompts, **kw) for h in (False, True))
    assert hbm[0] == host[0]
    assert hbm[1].keys() == host[1].keys()
    for rid in hbm[1]:
        assert len(hbm[1][rid]) == len(host[1][rid])
        for a, b in zip(hbm[1][rid], host[1][rid]):
            np.testing.assert_array_equal(a, b)
    assert hbm[2] == host[2]  # echo logprobs and top entries, as floats: bitwise
    eng = host[3]
    assert eng.fingerprint == hbm[3].fingerprint  # prefix-cache files move between the two
    # the device holds no table row: the host engine's devices hold the HBM engine's bytes less the tables
    tables = sum(v.nbytes + s.nbytes for v, s in eng.tables.host.tables.values())
    rows = dict(zip(model.cfg.engram_layer_ids, (t[0].shape[0] for t in eng.tables.host.tables.values())))
    assert rows == {l: model.layers[l].engram.embed.shape[0] for l in model.cfg.engram_layer_ids}
    held, held_hbm = bytes_per_device(eng.params), bytes_per_device(hbm[3].params)
    assert sum(held_hbm.values()) - sum(held.values()) >= tables  # >=: a mesh pads HBM tables to equal shards
    return hbm, host


@pytest.fixture(scope="module")
def small():
    return random_model(SMALL, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "expert=4,tensor=2"])
def test_host_engram_equals_hbm(small, spec):
    """In fast numerics (the host path changes no arithmetic, so it is bitwise in either mode) and
    one prefill shape (chunks of 4): a batch of two requests and an echo, on one device, then on
    the 8-device mesh. `heavy pytest -n 2` with the serving tests (08:09 UTC): 41 s (one device),
    79 s (mesh): over the default suite's budget, so slow; the default suite runs
    tests/serving/test_generate.py::test_generate_with_engram_in_host_memory (the CLI through the same path)."""
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, SMALL.vocab_size, n))) for n in (4, 8)]
    _compare(small, spec, prompts, exact_prefill=True, mode="fast", chunk=4)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "expert=4,tensor=2"])
def test_host_engram_equals_hbm_exact(small, spec):
    """Exact numerics, a batch of two requests (5 and 11 tokens: a chunk of 8 and power-of-two
    remainders) and an echo; one device, then the 8-device mesh.
    `heavy pytest -q tests/serving/test_engine_host_engram.py` (07:39 UTC, shared machine; then with
    max_tokens 4): passed, 175 s (one device), 233 s (mesh)."""
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, SMALL.vocab_size, n))) for n in (5, 11)]
    with jax.enable_x64(True):
        _compare(small, spec, prompts, exact_prefill=True, mode="exact")


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "expert=4,tensor=2"])
def test_host_engram_equals_hbm_split_prefill(spec, tmp_path):
    """The five-layer model: split prefill (Graph A pieces, Graph B's tail), a conversation resume
    (the replayed window), concurrent decode and an echo (fast numerics: bitwise all the same).
    `heavy pytest -q -m slow tests/serving/test_engine_host_engram.py -k split` (08:13 UTC, main 775c20d + the
    host-Engram commits): 2 passed in 623 s (263 s one device, 358 s expert=4,tensor=2)."""
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(0, FULL.vocab_size, n))) for n in (5, 13, 24)]
    _compare(random_model(FULL, seed=7), spec, prompts, exact_prefill=False, mode="fast", tmp_path=tmp_path)


def test_host_engram_needs_engram_layers():
    cfg = SMALL.replace(engram_layer_ids=())
    with pytest.raises(ValueError, match="no Engram layers"):
        Engine(random_model(cfg), slots=1, exact_prefill=True, **engine_strategies(engram_host=True))


def test_plan_prints_engram_host_in_the_serve_command(capsys):
    import argparse

    from dsv41_jax.cli import serve
    from dsv41_jax.cli.main import main

    assert main(["plan", "--config", "tiny", "--mesh", "expert=4,tensor=2", "--engram", "host", "--no-compile"]) == 0
    cmd = capsys.readouterr().out.strip().splitlines()[-1]
    assert cmd.startswith("serve it: dsv41 serve ") and cmd.endswith(" --engram host"), cmd
    sub = argparse.ArgumentParser().add_subparsers()
    serve.register(sub)
    args = sub.choices["serve"].parse_args(cmd.split("dsv41 serve ")[1].split())
    assert (args.engram, args.mesh) == ("host", "expert=4,tensor=2")
    with pytest.raises(SystemExit) as e:
        sub.choices["serve"].parse_args(["--checkpoint", "x", "--engram", "ssd"])
    assert e.value.code == 2 and "--engram: invalid choice: 'ssd'" in capsys.readouterr().err
