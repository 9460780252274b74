"""QAT training: forward parity with serving, straight-through gradients, router-bias rule,
loss decrease, exact resume, export to the served formats.

Oracles: the serving forward (`model.forward` on FP8/FP4 weights), float64 numpy finite
differences, plain counting of routed tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.numerics import quant
from dsv41_jax.model.transformer import init_cache, make_step
from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.train import losses
from dsv41_jax.train import params as P
from dsv41_jax.train import qat_modules as Q
from dsv41_jax.train import weight_quant as W
from dsv41_jax.train.checkpoint import Checkpointer
from dsv41_jax.train.export import export_checkpoint, load_exported
from dsv41_jax.train.forward import ForwardOptions, train_forward
from dsv41_jax.train.loop import prepare, train
from dsv41_jax.train.optim import OptimConfig
from dsv41_jax.train.step import TrainConfig

from tests.support.train_fixtures import TOKENIZER, device_batch, max_abs_diff, micro_config, packed_data

T = 32


@pytest.fixture(scope="module")
def model_setup():
    cfg = micro_config(T)
    sgraph, sflat = P.serving_graph(cfg)
    formats = P.serving_formats(cfg, sflat)
    graphdef, master = Q.build_training_model(cfg, formats, seed=1, exact_mhc=True)
    return cfg, formats, sgraph, graphdef, master


def _qat_logits_fn(cfg, formats, graphdef):
    @jax.jit
    def f(master, tokens, positions, engram_ids):
        model = P.merge_model(graphdef, W.qat_view(master, formats))
        batch = {"tokens": tokens, "positions": positions, "engram_ids": engram_ids}
        return train_forward(model, batch, ForwardOptions())[0]

    return jax.jit(f.__wrapped__, compiler_options=COMPILER_OPTIONS)


def _unpacked_rows(cfg, n=2, seed=0):
    """n single-document rows filling the whole context (as a served prefill would see them)."""
    from dsv41_jax.engram.hashing import hash_ids
    from dsv41_jax.train.data import engram_setup

    rng = np.random.default_rng(seed)
    tokens = rng.integers(TOKENIZER.n_special, TOKENIZER.vocab_size, (n, cfg.max_seq_len)).astype(np.int32)
    layout, token_map = engram_setup(cfg, TOKENIZER)
    ids = hash_ids(layout, token_map, tokens).astype(np.int32)
    positions = np.broadcast_to(np.arange(cfg.max_seq_len, dtype=np.int32), tokens.shape)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(ids)


@pytest.fixture(scope="module")
def two_layer_setup():
    return _two_layer_setup()


def _two_layer_setup():
    """Full ratio-2 (+Engram) then Full ratio-1 (candidate pool): compressors of both kinds,
    indexers, the pool, Engram and MoE, at the lowest compile cost."""
    cfg = micro_config(T, n_layers=2, compress_ratios=(2, 1), kv_source_layers=(0, 1), index_source_layers=(0, 1),
                       candidate_source_layer=1)
    sgraph, sflat = P.serving_graph(cfg)
    formats = P.serving_formats(cfg, sflat)
    graphdef, master = Q.build_training_model(cfg, formats, seed=2, exact_mhc=True)
    return cfg, formats, sgraph, graphdef, master


@pytest.mark.parametrize("size", ["two_layers", pytest.param("micro", marks=pytest.mark.slow)])
def test_qat_logits_equal_serving_logits_and_export_reproduces_them(size, request, tmp_path):
    """The QAT forward on masters equals the served FP8/FP4 model built from the same weights
    (bitwise), both for weights that start on the storage grid (start-from-released) and for
    trained-looking fp32 masters exported to a checkpoint folder and loaded back."""
    setup = request.getfixturevalue("two_layer_setup" if size == "two_layers" else "model_setup")
    cfg, formats, sgraph, graphdef, master = setup
    tokens, positions, ids = _unpacked_rows(cfg)
    qat_logits = _qat_logits_fn(cfg, formats, graphdef)
    serve = make_step(sgraph)

    # 1. start from a served (quantized) model: dequantize into masters, QAT forward == serving
    served = W.export_serving_jit(master, formats)
    masters_from_served = W.import_serving_jit(served, formats)
    serving_logits = serve(served_state(sgraph, served), tokens, init_cache(cfg, 2), ids)[0]
    np.testing.assert_array_equal(np.asarray(qat_logits(masters_from_served, tokens, positions, ids)),
                                  np.asarray(serving_logits))

    # 2. fp32 masters off the grid -> exported folder -> weights.load_reference_state_dict -> same logits
    perturbed = {k: v + 0.01 * jax.random.normal(jax.random.key(7), v.shape) for k, v in master.items()}
    folder = export_checkpoint(tmp_path / "served", cfg, perturbed, formats)
    _, loaded = load_exported(folder, cfg)
    from flax import nnx

    loaded_logits = serve(nnx.split(loaded)[1], tokens, init_cache(cfg, 2), ids)[0]
    trained_logits = qat_logits(perturbed, tokens, positions, ids)
    np.testing.assert_array_equal(np.asarray(trained_logits), np.asarray(loaded_logits))
    assert max_abs_diff(trained_logits, serving_logits) > 1e-3  # the perturbation mattered


def served_state(sgraph, served_flat):
    from flax import nnx

    return nnx.split(P.merge_model(sgraph, served_flat))[1]


def test_import_export_round_trip_keeps_values(two_layer_setup):
    """Masters dequantized from storage re-export to the same values (a block whose maximum
    rounded down may pick the next smaller power-of-two scale: other bytes, same numbers)."""
    cfg, formats, *_, master = two_layer_setup
    served = W.export_serving_jit(master, formats)
    masters = W.import_serving_jit(served, formats)
    again = W.import_serving_jit(W.export_serving_jit(masters, formats), formats)
    assert set(masters) == set(again) == set(master)
    for k in masters:
        np.testing.assert_array_equal(np.asarray(masters[k]), np.asarray(again[k]), err_msg=k)
    fp8 = [k for k in formats if formats[k].kind == P.FP8_WEIGHT]
    assert fp8 and all(np.any(np.asarray(masters[k]) != np.asarray(master[k])) for k in fp8)


# ------------------------------------------------------------------------ straight-through
def _fd_grad(f, x: np.ndarray, eps: float = 1e-3) -> np.ndarray:
    """Central finite differences of a float64 function, element by element."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "fp4_stacked"])
def test_weight_ste_gradient_is_fd_of_unquantized_function(fmt):
    """d/dw sum(c * tanh(x Q(w)^T)) through the STE equals the finite differences (float64)
    of the unquantized sum(c * tanh(x w^T)), taken at w = Q(w). (Nonlinear, so the gradient
    depends on where it is taken: at w instead of Q(w) it would differ.)"""
    rng = np.random.default_rng(0)
    shape = {"fp8": (40, 64), "fp4": (8, 64), "fp4_stacked": (2, 4, 32)}[fmt]
    w = rng.normal(size=shape).astype(np.float32)
    x = rng.normal(size=(3, shape[-1])).astype(np.float32)
    c = rng.normal(size=(3,) + shape[:-1]).astype(np.float32)
    ste = W.ste_fp8_weight if fmt == "fp8" else W.ste_fp4_weight
    values = W.fake_fp8_weight_values if fmt == "fp8" else W.fake_fp4_weight_values
    spec = "bk,...nk->b...n"
    x = x / 4  # keep tanh away from saturation
    g = jax.grad(lambda w_: jnp.sum(c * jnp.tanh(jnp.einsum(spec, x, ste(w_), precision="highest"))))(jnp.asarray(w))
    wq = np.asarray(values(jnp.asarray(w)), np.float64)
    assert not np.array_equal(wq, w)  # the forward did quantize

    def unquantized(w_):
        return float(np.sum(c * np.tanh(np.einsum(spec, x.astype(np.float64), w_))))

    fd = _fd_grad(unquantized, wq)
    np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-4, atol=1e-4)
    at_w = _fd_grad(unquantized, w.astype(np.float64))  # the gradient at the unquantized point
    assert np.max(np.abs(at_w - fd)) > 100 * np.max(np.abs(np.asarray(g) - fd))


@pytest.mark.parametrize("which", ["fp8_act", "fp4_kv", "fp4_mx", "qat_linear"])
def test_activation_ste_gradient_is_fd_of_unquantized_function(which):
    """The activation/KV fake-quants of the forward pass the gradient of the unquantized
    function at the quantized point: for L = c . tanh(Q(x) w^T), dL/dx = FD of
    x' -> c . tanh(x' w^T) at x' = Q(x)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 64)).astype(np.float32)
    w = rng.normal(size=(5, 64)).astype(np.float32)
    c = rng.normal(size=(2, 5)).astype(np.float32)
    fake = {"fp8_act": lambda a: quant.fake_fp8_act(a, 32), "fp4_kv": lambda a: quant.fake_fp4_kv(a, 16),
            "fp4_mx": lambda a: quant.fake_fp4_mx(a, 32), "qat_linear": Q.fake_act}[which]
    w = w / 4
    g = jax.grad(lambda a: jnp.sum(c * jnp.tanh(jnp.matmul(fake(a), jnp.asarray(w).T, precision="highest"))))(
        jnp.asarray(x))
    xq = np.asarray(fake(jnp.asarray(x)), np.float64)
    assert not np.array_equal(xq, x)

    def unquantized(a):
        return float(np.sum(c * np.tanh(a @ w.astype(np.float64).T)))

    fd = _fd_grad(unquantized, xq)
    np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-4, atol=1e-4)
    at_x = _fd_grad(unquantized, x.astype(np.float64))
    assert np.max(np.abs(at_x - fd)) > 10 * np.max(np.abs(np.asarray(g) - fd))


def test_qat_matmul_gradient_uses_quantized_operands():
    """QATLinear's GEMM: the weight gradient is c^T Q8(x) (FD of the unquantized GEMM at Q8(x)),
    not c^T x, so an STE that skipped the activation quantizer would fail here."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(4, 64)) * 3).astype(np.float32)
    w = (rng.normal(size=(6, 64)) / 8).astype(np.float32)
    w = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))  # bf16 weights: the GEMM's operand dtype
    c = rng.normal(size=(4, 6)).astype(np.float32)
    gw = jax.grad(lambda w_: jnp.sum(c * Q.qat_matmul(jnp.asarray(x), w_, True, jnp.float32)))(jnp.asarray(w))
    xq = np.asarray(Q.fake_act(jnp.asarray(x)), np.float64)
    fd = _fd_grad(lambda w_: float(np.sum(c * (xq @ w_.T))), w.astype(np.float64))
    np.testing.assert_allclose(np.asarray(gw), fd, rtol=2e-2, atol=2e-2)  # cotangent rounds through bf16
    wrong = c.T.astype(np.float64) @ x.astype(np.float64)
    assert np.max(np.abs(wrong - fd)) > 10 * np.max(np.abs(np.asarray(gw) - fd))


@pytest.mark.slow
def test_model_ste_gradient_matches_unquantized_model_gradient(model_setup):
    """Whole model: the STE gradient (every weight/activation/KV format fake-quantized) points
    where the unquantized model's gradient points, per parameter group: each group's
    directional derivative agrees within 10% and no group is blocked (zero)."""
    from dsv41_jax.train.step import loss_and_aux

    cfg, formats, _, graphdef, master = model_setup
    g0def, _ = Q.build_training_model(cfg, formats, act_quant=False, quant_engram_rows=False, abstract=True)
    b = device_batch(packed_data(T, 4).batch(0))
    tq = TrainConfig(seq_len=T, batch_size=4, indexer_kl_weight=0.0, balance_weight=0.0)
    t0 = TrainConfig(seq_len=T, batch_size=4, indexer_kl_weight=0.0, balance_weight=0.0, qat=False)
    key = jax.random.key(0)
    gq = jax.jit(jax.grad(lambda m: loss_and_aux(graphdef, formats, cfg, tq, m, b, key)[0]),
                 compiler_options=COMPILER_OPTIONS)(master)
    on_grid = {k: W.fake_fp8_weight_values(v) if formats[k].kind == P.FP8_WEIGHT else
               W.fake_fp4_weight_values(v) if formats[k].kind == P.FP4_WEIGHT else v for k, v in master.items()}
    g0 = jax.jit(jax.grad(lambda m: loss_and_aux(g0def, formats, cfg, t0, m, b, key, ForwardOptions(act_quant=False))[0]),
                 compiler_options=COMPILER_OPTIONS)(on_grid)
    groups = {"compressor": "compressor", "window kv": "attn.wkv.weight", "routed experts": "ffn.experts",
              "shared expert": "shared_experts", "queries": "attn.wq_", "engram": "engram.embed", "head": "head"}
    for name, part in groups.items():
        keys = [k for k in master if part in k]
        assert keys, name
        ref = sum(float(jnp.sum(g0[k] * g0[k])) for k in keys)
        got = sum(float(jnp.sum(gq[k] * g0[k])) for k in keys)
        assert ref > 0, name
        assert abs(got / ref - 1) < 0.1, (name, got / ref)


# ------------------------------------------------------------------------ router bias
def test_bias_sign_rule_moves_skewed_load_toward_balance():
    """Tokens whose gate scores favour two experts: repeated sign-rule updates of the
    selection bias flatten the load (counted directly), and the weights stay unbiased."""
    rng = np.random.default_rng(0)
    E, k, n = 8, 2, 4096
    logits = rng.normal(size=(n, E)).astype(np.float32)
    logits[:, :2] += 3.0  # experts 0 and 1 win almost every token
    scores = jnp.sqrt(jax.nn.softplus(jnp.asarray(logits)))
    bias = jnp.zeros(E, jnp.float32)
    valid = jnp.ones((1, n))

    def load_of(b):
        experts = jax.lax.top_k(scores + b, k)[1]
        return losses.expert_load(experts[None], valid, E)

    start = load_of(bias)
    for _ in range(300):
        bias = losses.bias_update(bias, load_of(bias), rate=0.01)
    end = load_of(bias)
    assert float(start[:2].sum()) > 0.8 * n * k
    assert float(losses.load_imbalance(end)) < 0.5 * float(losses.load_imbalance(start))
    assert float(losses.load_imbalance(end)) < 1.3
    assert float(bias[0]) < 0 < float(bias[7])


@pytest.mark.slow
def test_train_step_bias_update_balances_skewed_routing():
    """The real train step: router biases skewed so that experts 0 and 1 win every token of
    every MoE layer (load max/mean = E/k = 2). With the optimizer effectively off (lr 1e-12),
    the step's sign-rule bias update alone brings the measured load back toward balance, and
    moves each bias against its expert's load."""
    cfg = micro_config(T, n_layers=2, compress_ratios=(2, 1), kv_source_layers=(0, 1), index_source_layers=(0, 1),
                       candidate_source_layer=1)
    data = packed_data(T, 8)
    tcfg = TrainConfig(seq_len=T, batch_size=8, steps=16, seed=0, fast_compile=True, bias_rate=0.25,
                       optim=OptimConfig(lr=1e-12, warmup_steps=1, total_steps=16))
    run = prepare(cfg, tcfg, mesh_spec="data=1")
    E = cfg.n_routed_experts
    skew = jnp.zeros(E, jnp.float32).at[:2].set(3.0)  # larger than the spread of the gate scores
    assert run.state["bias"] and all(v.shape == (E,) for v in run.state["bias"].values())
    skewed = {k: v + skew for k, v in run.state["bias"].items()}
    run.state = dict(run.state, bias=jax.device_put(skewed, run.state_shardings["bias"]))
    hist = train(run, data, progress=False, log_every=0)
    imbalance = [h["load_imbalance"] for h in hist]
    assert imbalance[0] > 1.95  # experts 0 and 1 take (almost) everything
    assert np.mean(imbalance[-4:]) < 0.75 * imbalance[0], imbalance
    for k, b in jax.device_get(run.state["bias"]).items():
        moved = np.asarray(b) - np.asarray(skew)
        assert np.all(moved[:2] < 0) and np.all(moved[2:] > 0), (k, moved)  # the loaded went down


def test_sequence_balance_loss_is_minimal_for_uniform_routing():
    """f_i P_i summed: 1 for perfectly uniform scores and routing, larger when skewed."""
    B, T, E, k = 1, 8, 4, 2
    uniform_scores = jnp.ones((B, T, E))
    experts = jnp.asarray([[[t % 4, (t + 1) % 4] for t in range(T)]])
    valid = jnp.ones((B, T))
    assert abs(float(losses.sequence_balance(uniform_scores, experts, valid)) - 1.0) < 1e-6
    skew_scores = uniform_scores.at[..., 0].set(10.0)
    skew_experts = jnp.zeros((B, T, k), jnp.int32).at[..., 1].set(1)
    assert float(losses.sequence_balance(skew_scores, skew_experts, valid)) > 1.5


# ------------------------------------------------------------------------ training runs
def _tcfg(steps=300, **kw):
    return TrainConfig(seq_len=T, batch_size=8, steps=steps, seed=0, fast_compile=True,
                       optim=OptimConfig(lr=3e-3, warmup_steps=10, total_steps=steps, weight_decay=0.01), **kw)


@pytest.mark.slow
def test_resume_is_bitwise_and_bias_follows_the_sign_rule(tmp_path):
    """Stop after 2 steps, restore from orbax, take step 3: loss and state equal an
    uninterrupted run bit for bit (data position and per-step randomness included)."""
    cfg = micro_config(T)
    data = packed_data(T, 8)
    tcfg = _tcfg(steps=3, replay_prob=0.5)
    ck = Checkpointer(tmp_path / "ck", keep=2)
    run = prepare(cfg, tcfg, mesh_spec="data=1", checkpointer=ck)
    bias0 = {k: np.asarray(v) for k, v in run.state["bias"].items()}
    train(run, data, steps=2, checkpointer=ck, progress=False, log_every=0)
    assert ck.all_steps() == [2]
    # the router bias moved by exactly +-rate per expert, opposite to its load
    for k, b in run.state["bias"].items():
        delta = np.asarray(b) - bias0[k]
        assert np.all(np.isclose(np.abs(delta), 2 * tcfg.bias_rate) | np.isclose(np.abs(delta), 0, atol=1e-7)
                      | np.isclose(np.abs(delta), tcfg.bias_rate)), delta
    h3 = train(run, data, steps=3, progress=False, log_every=0)
    straight = jax.device_get(run.state)

    ck2 = Checkpointer(tmp_path / "ck", keep=2)
    resumed = prepare(cfg, tcfg, mesh_spec="data=1", checkpointer=ck2, restore_step=2)
    assert resumed.step == 2
    h3b = train(resumed, data, steps=3, progress=False, log_every=0)
    assert h3[-1]["loss"] == h3b[-1]["loss"]
    again = jax.device_get(resumed.state)
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(straight), jax.tree_util.tree_leaves(again)
    for (path, a), b in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def trained_run():
    """The micro config QAT-trained on packed data until the CE of the last 10 steps is below
    70% of the first 10, or 300 steps: (run, per-step metrics, the initial masters)."""
    cfg = micro_config(T)
    data = packed_data(T, 8)
    tcfg = _tcfg(steps=300)
    run = prepare(cfg, tcfg, mesh_spec="data=1")
    init = jax.device_get(run.master())  # a host copy: the step donates the state's buffers
    hist = train(run, data, steps=20, progress=False, log_every=0)
    first = np.mean([h["ce"] for h in hist[:10]])
    while run.step < 300:
        if np.mean([h["ce"] for h in hist[-10:]]) < 0.7 * first:
            break
        hist += train(run, data, steps=run.step + 10, progress=False, log_every=0)
    return run, hist, init


@pytest.mark.slow
def test_loss_falls_below_70_percent_within_300_steps(trained_run):
    """Tiny config on CPU: the mean CE of the last 10 steps drops below 70% of the first 10."""
    run, hist, _ = trained_run
    first = np.mean([h["ce"] for h in hist[:10]])
    last = np.mean([h["ce"] for h in hist[-10:]])
    assert run.step <= 300 and len(hist) == run.step
    assert last < 0.7 * first, (first, last, run.step)
    assert all(np.isfinite(h["loss"]) for h in hist)


@pytest.mark.slow
def test_trained_model_exports_and_serves_its_logits(trained_run, tmp_path):
    """The masters of a real training run, exported to the FP8/FP4 checkpoint folder and loaded
    by the serving path, give the QAT forward's logits bit for bit (mHC with the served exp);
    the training graph's looped mHC with XLA's exp stays within float rounding of them; and
    the logits are not the untrained model's."""
    from flax import nnx

    run, _, init = trained_run
    cfg, formats = run.cfg, run.formats
    trained = run.master()
    tokens, positions, ids = _unpacked_rows(cfg)
    folder = export_checkpoint(tmp_path / "served", cfg, trained, formats)
    _, loaded = load_exported(folder, cfg)
    served = make_step(nnx.split(loaded)[0])(nnx.split(loaded)[1], tokens, init_cache(cfg, 2), ids)[0]

    exact_graph, _ = Q.build_training_model(cfg, formats, exact_mhc=True, abstract=True)
    qat = _qat_logits_fn(cfg, formats, exact_graph)
    np.testing.assert_array_equal(np.asarray(qat(trained, tokens, positions, ids)), np.asarray(served))
    as_trained = np.asarray(_qat_logits_fn(cfg, formats, run.graphdef)(trained, tokens, positions, ids))
    served = np.asarray(served)
    assert max_abs_diff(as_trained, served) < 2e-2 * np.max(np.abs(served)), max_abs_diff(as_trained, served)
    assert max_abs_diff(qat(init, tokens, positions, ids), served) > 0.1


def test_looped_mhc_site_matches_served_site():
    """The training mHC site (looped Sinkhorn) equals the served one bitwise with SLEEF exp,
    and within float32 rounding with XLA's exp (the training default)."""
    from dsv41_jax.layers.mhc_site import HyperSite

    cfg = micro_config(T)
    site = HyperSite(cfg, rngs=__import__("flax").nnx.Rngs(3))
    h = jax.random.normal(jax.random.key(1), (2, 5, cfg.hc_mult, cfg.dim), jnp.float32).astype(jnp.bfloat16)
    ref = site.mixes(h, "fast")
    exact = Q.LoopedHyperSite(site, exact_exp=True).mixes(h, "fast")
    fast = Q.LoopedHyperSite(site, exact_exp=False).mixes(h, "fast")
    for r, e, f in zip(ref, exact, fast):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e))
        np.testing.assert_allclose(np.asarray(r), np.asarray(f), rtol=1e-5, atol=1e-6)


def test_packed_documents_equal_separate_rows_and_replay_only_touches_the_decoder(two_layer_setup):
    """Document-aware forward: a document packed after another (at an aligned start) gets
    bit for bit the logits it gets alone. Replay-aware windows (tail start s) leave every position before s and
    the encoder untouched, and change the decoder's view after s."""
    cfg, formats, _, graphdef, master = two_layer_setup
    assert cfg.roles[-1].half == "decoder"
    layout_map = __import__("dsv41_jax.train.data", fromlist=["engram_setup"]).engram_setup(cfg, TOKENIZER)
    from dsv41_jax.train.data import engram_ids

    rng = np.random.default_rng(5)
    a = rng.integers(TOKENIZER.n_special, TOKENIZER.vocab_size, 12)
    b = rng.integers(TOKENIZER.n_special, TOKENIZER.vocab_size, 16)
    pad = TOKENIZER.pad_id
    rows = [np.concatenate([a, b, [pad] * 4]), np.concatenate([a, [pad] * 20]), np.concatenate([b, [pad] * 16])]
    pos = [np.concatenate([np.arange(12), np.arange(16), np.zeros(4)]), np.concatenate([np.arange(12), np.zeros(20)]),
           np.concatenate([np.arange(16), np.zeros(16)])]
    tokens, positions = np.stack(rows).astype(np.int32), np.stack(pos).astype(np.int32)
    ids = engram_ids(*layout_map, tokens, positions)
    view = jax.jit(lambda m: W.qat_view(m, formats))(master)

    @jax.jit
    def fwd(view, tokens, positions, ids, replay):
        model = P.merge_model(graphdef, view)
        return train_forward(model, {"tokens": tokens, "positions": positions, "engram_ids": ids}, ForwardOptions(),
                             replay_start=replay)[0]

    fwd = jax.jit(fwd.__wrapped__, compiler_options=COMPILER_OPTIONS)
    args = (view, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(ids))
    logits = np.asarray(fwd(*args, jnp.zeros(3, jnp.int32)))
    np.testing.assert_array_equal(logits[0, :12], logits[1, :12])
    np.testing.assert_array_equal(logits[0, 12:28], logits[2, :16])
    assert max_abs_diff(logits[0, 12:28], logits[1, 12:28]) > 1e-2  # different contexts do differ

    s = 20  # a tail start inside document b: decoder windows of positions >= 20 start there
    replayed = np.asarray(fwd(*args, jnp.asarray([s, 0, 0], jnp.int32)))
    np.testing.assert_array_equal(replayed[0, :s], logits[0, :s])
    np.testing.assert_array_equal(replayed[1:], logits[1:])
    assert max_abs_diff(replayed[0, s + 1:28], logits[0, s + 1:28]) > 1e-3


@pytest.mark.slow
def test_lora_with_muon_trains_adapters_only(tmp_path):
    """LoRA (rank 4) under optax's Muon: the loss falls, the masters stay bit for bit, and the
    export carries the merged adapters."""
    cfg = micro_config(T)
    data = packed_data(T, 8)
    tcfg = TrainConfig(seq_len=T, batch_size=8, steps=30, seed=0, fast_compile=True, lora_rank=4,
                       optim=OptimConfig(optimizer="muon", lr=2e-2, warmup_steps=3, total_steps=30, weight_decay=0.0))
    run = prepare(cfg, tcfg, mesh_spec="data=1")
    masters0 = jax.device_get(run.state["master"])
    hist = train(run, data, progress=False, log_every=0)
    assert np.mean([h["ce"] for h in hist[-5:]]) < 0.8 * np.mean([h["ce"] for h in hist[:5]])
    for k, v in jax.device_get(run.state["master"]).items():
        np.testing.assert_array_equal(v, masters0[k], err_msg=k)
    lora_b = [k for k in run.state["lora"] if k.endswith("lora_b")]
    assert lora_b and all(float(jnp.abs(run.state["lora"][k]).max()) > 0 for k in lora_b)
    merged = run.master()
    assert max_abs_diff(merged["layers.1.attn.wq_a.weight"], masters0["layers.1.attn.wq_a.weight"]) > 0
