"""QAT with the kernels: `ForwardOptions(impl="pallas")` runs the attention kernel
through its values-in custom_vjp (gradients for q, the window and compressed rows and the sink) and
the indexer kernel for selection, interpreted on CPU. Loss and gradients equal impl="xla"'s within
fast-numerics rounding (the kernels sum in another order), on the two-layer training model (both
compressor kinds, both indexers, the candidate pool, Engram, MoE), with the indexer KL on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.train import params as P
from dsv41_jax.train import qat_modules as Q
from dsv41_jax.train.forward import ForwardOptions
from dsv41_jax.train.step import TrainConfig, loss_and_aux

from tests.support.train_fixtures import device_batch, micro_config, packed_data

T = 32


@pytest.fixture(scope="module")
def losses_and_grads():
    cfg = micro_config(T, n_layers=2, compress_ratios=(2, 1), kv_source_layers=(0, 1), index_source_layers=(0, 1),
                       candidate_source_layer=1)
    sgraph, sflat = P.serving_graph(cfg)
    formats = P.serving_formats(cfg, sflat)
    graphdef, master = Q.build_training_model(cfg, formats, seed=2)
    b = device_batch(packed_data(T, 4).batch(0))
    tcfg = TrainConfig(seq_len=T, batch_size=4, kl_positions=8)
    key = jax.random.key(0)
    out = {}
    for impl in ("xla", "pallas"):
        opts = ForwardOptions(kl_positions=8, impl=impl)
        f = jax.jit(jax.value_and_grad(lambda m: loss_and_aux(graphdef, formats, cfg, tcfg, m, b, key, opts)[0]),
                    compiler_options=COMPILER_OPTIONS)
        out[impl] = f(master)
    return out


@pytest.mark.slow  # 75 s: two training programs, one with interpreted kernels; the default suite keeps the VJP test below
def test_qat_with_kernels_equals_xla_in_loss_and_gradients(losses_and_grads):
    (lx, gx), (lp, gp) = losses_and_grads["xla"], losses_and_grads["pallas"]
    assert np.isfinite(float(lx))
    np.testing.assert_allclose(float(lp), float(lx), rtol=1e-5)
    attn_rows = 0
    for k in gx:
        a, b = np.asarray(gx[k], np.float64), np.asarray(gp[k], np.float64)
        scale = max(np.max(np.abs(a)), 1e-30)
        assert np.max(np.abs(a - b)) <= 1e-3 * scale + 1e-9, (k, np.max(np.abs(a - b)), scale)
        if "attn.wkv" in k or "compressor.wkv" in k:  # reach the loss through the attention's rows only
            attn_rows += int(np.max(np.abs(b)) > 0)
    assert attn_rows >= 2  # the kernel's VJP passes gradients to the window and compressed rows


def test_values_in_attention_vjp_equals_the_xla_math():
    """The values-in custom_vjp alone: forward equal to the XLA math within f32 rounding, gradients for
    q, both row sets and the sink equal to autodiff of the XLA math."""
    from pallas_kernels import sparse_sink_attention_values

    rng = np.random.default_rng(0)
    B, S, H, D, Nw, G = 2, 5, 2, 64, 9, 4
    q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((B, Nw, D)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((B, G, D)), jnp.bfloat16)
    wi = jnp.asarray(rng.integers(-1, Nw, (B, S, 4)), jnp.int32)
    ci = jnp.asarray(rng.integers(-1, G, (B, S, 3)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)

    def loss(impl):
        def f(q, w, c, sink):
            o = sparse_sink_attention_values(q, w, c, wi, ci, sink, D ** -0.5, impl=impl, interpret=True)
            return jnp.sum(o.astype(jnp.float32) * jnp.arange(D, dtype=jnp.float32))
        return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(q, w, c, sink)

    (vx, gx), (vp, gp) = loss("xla"), loss("pallas")
    np.testing.assert_allclose(float(vp), float(vx), rtol=1e-3)
    for a, b in zip(gx, gp):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(b)) > 0
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.max(np.abs(a)))
