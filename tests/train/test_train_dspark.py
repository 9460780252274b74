"""`dsv41 train --dspark`: the drafter's losses, the frozen backbone, export, and acceptance.

Oracles: a float64 numpy transcription of DeepSpec's DSpark loss (deepspec/modeling/dspark/loss.py:
weighted CE, L1 between distributions, BCE of the confidence head against 1 - L1/2, positional
decay exp(-j/gamma)), written here from the definitions; bitwise comparison of parameters before
and after steps; the exported folder reloaded by the one HF loader; greedy speculative decoding
through the engine for the acceptance length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.train import dspark as TD
from dsv41_jax.train.loop import prepare, train
from dsv41_jax.train.optim import OptimConfig
from dsv41_jax.train.step import TrainConfig

from tests.support.train_fixtures import TOKENIZER, micro_config, packed_data

DRAFTER = dict(n_mtp_layers=1, dspark_block_size=4, dspark_noise_token_id=TOKENIZER.pad_id, dspark_target_layer_ids=(2, 3),
               dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_n_activated_experts=2)


def _oracle(draft, target, labels, mask, conf, keep, obj: TD.DSparkLoss):
    """float64 numpy: DeepSpec's compute_dspark_loss on one device (world size 1)."""
    d, t, c = (np.asarray(a, np.float64) for a in (draft, target, conf))
    w = np.asarray(mask, np.float64)
    if obj.decay_gamma > 0:
        w = w * np.exp(-np.arange(w.shape[-1]) / obj.decay_gamma)
    den = w.sum() + 1e-6

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    pd, pt = softmax(d), softmax(t)
    ce_tok = -np.log(np.take_along_axis(pd, np.asarray(labels)[..., None], -1)[..., 0])
    l1_tok = np.abs(pd - pt).sum(-1)
    acc = np.clip(1 - 0.5 * l1_tok, 0, 1)
    sig = 1 / (1 + np.exp(-c))
    bce = -(acc * np.log(sig) + (1 - acc) * np.log(1 - sig))
    ce, l1, cb = (ce_tok * w).sum() / den, (l1_tok * w).sum() / den, (bce * w).sum() / den
    valid = np.asarray(mask, np.float64)
    blocks = np.asarray(keep) & np.asarray(mask).any(-1)
    tau = 1 + np.cumprod(acc * valid, -1).sum(-1)
    return {"loss": obj.ce_weight * ce + obj.l1_weight * l1 + obj.confidence_weight * cb, "ce": ce, "l1": l1,
            "confidence_bce": cb, "tau": tau[blocks].mean()}


@pytest.mark.parametrize("obj", [TD.DSparkLoss(), TD.DSparkLoss(ce_weight=1.0, l1_weight=0.5, confidence_weight=0.3,
                                                                 decay_gamma=0.0)])
def test_losses_match_float64_oracle(obj):
    rng = np.random.default_rng(0)
    N, bs, V = 6, 5, 40
    draft = rng.normal(size=(N, bs, V)).astype(np.float32) * 3
    target = rng.normal(size=(N, bs, V)).astype(np.float32) * 3
    target[0, 0] = draft[0, 0]  # one position where the drafter equals the target: acceptance 1
    labels = rng.integers(0, V, (N, bs))
    mask = np.cumprod(rng.random((N, bs)) < 0.85, -1).astype(bool)
    mask[0, 0] = True
    keep = np.ones(N, bool)
    keep[-1] = False
    mask[-1] = False
    conf = rng.normal(size=(N, bs)).astype(np.float32)
    _, m = jax.jit(TD.dspark_losses, static_argnums=6)(jnp.asarray(draft), jnp.asarray(target), jnp.asarray(labels),
                                                        jnp.asarray(mask), jnp.asarray(conf), jnp.asarray(keep), obj)
    want = _oracle(draft, target, labels, mask, conf, keep, obj)
    for k, v in want.items():
        assert abs(float(m[k]) - v) <= 1e-5 * max(1.0, abs(v)), (k, float(m[k]), v)


def test_loss_gradient_reaches_only_the_draft():
    """The L1 term's target is a constant: no gradient flows into the target logits."""
    rng = np.random.default_rng(1)
    d, t = (jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32) for _ in range(2))
    args = (jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool), jnp.zeros((2, 3)), jnp.ones(2, bool), TD.DSparkLoss())
    gd, gt = jax.grad(lambda d, t: TD.dspark_losses(d, t, *args)[0], argnums=(0, 1))(d, t)
    assert float(jnp.abs(gd).sum()) > 0 and float(jnp.abs(gt).sum()) == 0


def test_block_targets_stop_at_document_and_mask():
    """Labels are tokens a+1.., against the target at a..; they count as a contiguous prefix inside the
    anchor's document and the loss mask (DeepSpec's build_eval_mask)."""
    T = 10
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])  # two documents: 0..3 and 4..9
    loss_mask = np.ones((1, T), np.float32)
    loss_mask[0, 7] = 0
    batch = {"tokens": jnp.arange(T)[None], "targets": jnp.arange(1, T + 1)[None], "positions": jnp.asarray(positions),
             "loss_mask": jnp.asarray(loss_mask)}
    anchors = jnp.asarray([[1, 5, 9]])
    labels, aligned, mask = TD.block_targets(batch, anchors, jnp.ones((1, 3), bool), 4)
    assert np.asarray(labels)[0, 0].tolist() == [2, 3, 4, 5]
    assert np.asarray(aligned)[0, 1].tolist() == [5, 6, 7, 8]
    assert np.asarray(mask)[0].tolist() == [[True, True, True, False],  # row 3's label is its document's last
                                            [True, True, False, False],  # loss mask 0 at 7 stops the prefix
                                            [True, False, False, False]]  # the row ends


def test_sample_anchors_are_distinct_supervised_positions():
    mask = np.zeros((2, 12), np.float32)
    mask[0, 2:10] = 1
    mask[1, 5:7] = 1  # fewer candidates than anchors
    a, keep = TD.sample_anchors(jax.random.key(0), jnp.asarray(mask), 4)
    a, keep = np.asarray(a), np.asarray(keep)
    assert keep[0].all() and len(set(a[0])) == 4 and all(mask[0, i] for i in a[0])
    assert keep[1].tolist() == [True, True, False, False] and sorted(a[1][:2]) == [5, 6]


@pytest.fixture(scope="module")
def drafter_run():
    """Three drafter steps on the micro model (about a minute of compiling on 2 cores: the tests that use
    it are slow)."""
    cfg = micro_config(32, **DRAFTER)
    data = packed_data(32, 8)
    tcfg = TrainConfig(seq_len=32, batch_size=8, steps=3, qat=True, kl_positions=0, dspark=TD.DSparkLoss(anchors=4),
                       optim=OptimConfig(lr=1e-3, warmup_steps=1, total_steps=3, weight_decay=0.1))
    run = prepare(cfg, tcfg)
    before = {k: np.asarray(v) for k, v in jax.device_get({**run.state["master"], **run.state["bias"]}).items()}
    history = train(run, data, progress=False, log_every=0)
    return cfg, run, before, history


@pytest.mark.slow
def test_dspark_steps_change_only_the_drafter(drafter_run):
    _, run, before, history = drafter_run
    after = jax.device_get({**run.state["master"], **run.state["bias"]})
    changed = {k for k in after if not np.array_equal(before[k], np.asarray(after[k]))}
    backbone = [k for k in after if not k.startswith("mtp.")]
    assert backbone and not changed & set(backbone), sorted(changed & set(backbone))[:5]
    drafter = {k for k in after if k.startswith("mtp.")}
    assert len(changed) > 0.9 * len(drafter), sorted(drafter - changed)  # nearly all: every trained tensor moves
    assert all(np.isfinite(h["loss"]) for h in history) and history[0]["tokens"] > 0


def test_dspark_refuses_a_model_without_drafter():
    cfg = micro_config(32)
    tcfg = TrainConfig(seq_len=32, batch_size=8, steps=1, dspark=TD.DSparkLoss())
    with pytest.raises(ValueError, match="no DSpark drafter"):
        prepare(cfg, tcfg)


@pytest.mark.slow
def test_export_round_trip_drafts_identically(drafter_run, tmp_path):
    """The trained mtp.* tensors written by export load back into model.mtp bit for bit, and the
    reloaded model drafts exactly what the in-memory served model drafts."""
    from flax import nnx

    from dsv41_jax.model import dspark
    from dsv41_jax.train.export import export_checkpoint, load_exported, serving_model
    from dsv41_jax.train.params import flatten_state

    cfg, run, _, _ = drafter_run
    master = run.master()
    folder = export_checkpoint(tmp_path / "served", cfg, master, run.formats, tokenizer=TOKENIZER)
    _, loaded = load_exported(folder, cfg)
    mem = serving_model(cfg, master, run.formats)
    a, b = flatten_state(mem), flatten_state(loaded)
    mtp = [k for k in a if k.startswith("mtp.")]
    assert set(a) == set(b) and mtp and all(np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8)) for k in mtp)
    rng = np.random.default_rng(0)
    T = 12
    taps = jnp.asarray(rng.normal(size=(1, T, len(cfg.dspark_target_layer_ids) * cfg.dim)), jnp.bfloat16)
    def one_device(m):  # the same placement for both (a sharded einsum may sum in another order)
        g, st = nnx.split(m)
        return nnx.merge(g, jax.device_put(st, jax.devices()[0]))

    outs = []
    for m in (one_device(mem), one_device(loaded)):
        state = dspark.write_rings(m, dspark.init_state(cfg, 1), dspark.main_x(m, taps, "fast"), jnp.asarray([0]),
                                   jnp.asarray([T]), "fast")
        ids, logits, conf, _ = dspark.draft(m, state, jnp.asarray([7]), jnp.asarray([T - 1]), mode="fast")
        outs.append((np.asarray(ids), np.asarray(logits), np.asarray(conf)))
    for x, y in zip(*outs):
        assert np.array_equal(x, y)


@pytest.mark.slow
def test_drafter_training_raises_acceptance_length(tmp_path):
    """The demo's recipe on its model: a short backbone training, then `train_drafter`; greedy speculative
    decoding through the engine (4 slots, K=3) on held-out code from the standard library's packages
    (the demo trains on its top-level modules) accepts more drafts per step with the trained drafter than
    with the untrained one. Prints both figures (reported in the PR, not a threshold)."""
    import pathlib
    import sysconfig

    from dsv41_jax.serving.engine import Engine, Request
    from dsv41_jax.serving.sampling import SamplingParams
    from dsv41_jax.train import data as D
    from dsv41_jax.cli.demo import acceptance_length, demo_config, demo_drafter, stdlib_corpus, train_drafter
    from dsv41_jax.train.export import export_checkpoint, load_exported

    tok, seq = TOKENIZER, 128
    cfg = demo_config(tok, seq).replace(**demo_drafter(tok))
    docs = D.read_documents(stdlib_corpus(400_000), tok)
    engram = D.engram_setup(cfg, tok)
    data = D.PackedData(D.pack(docs, seq, D.alignment(cfg), tok.pad_id, 0), 8, 0, engram)
    tcfg = TrainConfig(seq_len=seq, batch_size=8, steps=40, qat=True, kl_positions=8,
                       optim=OptimConfig(lr=3e-3, warmup_steps=10, total_steps=40, weight_decay=0.01))
    run = prepare(cfg, tcfg)
    train(run, data, progress=False, log_every=0)
    untrained = run.master()
    drafter = train_drafter(cfg, untrained, data, steps=60, time_budget=1e9, print_fn=print)
    held_out = sorted((pathlib.Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    prompts = [[tok.bos_id] + tok.encode(f.read_text()[:200], split_special_tokens=True)[:48] for f in held_out[:4]]
    figures = {}
    for name, master in (("untrained", untrained), ("trained", drafter["master"])):
        folder = export_checkpoint(tmp_path / name, cfg, master, run.formats, tokenizer=tok)
        _, model = load_exported(folder, cfg.replace(max_batch_size=4))
        engine = Engine(model, slots=4, max_seq_len=seq, min_capacity=seq, prefill_chunk=16, exact_prefill=True,
                        engram=engram, speculative=cfg.dspark_block_size - 1)
        for p in prompts:
            engine.submit(Request(p, SamplingParams(temperature=0.0, max_tokens=48)))
        while not engine.idle():
            engine.step()
        figures[name] = acceptance_length(engine)
    print(f"acceptance length (greedy, K=3, 4 held-out prompts x 48 tokens): untrained {figures['untrained']:.3f}, "
          f"trained {figures['trained']:.3f}; tau {drafter['first_tau']:.3f} -> {drafter['last_tau']:.3f}")
    assert figures["trained"] > figures["untrained"]


def test_the_demo_heartbeat_names_what_it_is_still_doing():
    """`dsv41 demo` is never silent for long: once nothing was printed for `every` seconds, the
    heartbeat prints a line naming the last phase; lines printed meanwhile pass through."""
    import threading

    from dsv41_jax.cli.demo import Heartbeat

    lines, beat = [], threading.Event()

    def out(line):
        lines.append(line)
        if "still working" in line:
            beat.set()

    with Heartbeat(out, every=0.2) as say:
        say("exporting the served checkpoint ...")
        assert beat.wait(60)  # a hang guard: the heartbeat comes after 0.2 s of silence
    assert lines[0] == "exporting the served checkpoint ..."
    assert "after: exporting the served checkpoint ..." in lines[1]
