"""Kernels on a mesh (`partition.per_device`): on 8 CPU devices, interpreted, the same bits as on one device.

The oracle is the same kernel call without a mesh. Each wrapper splits rows (and attention heads)
that the kernel computes independently, so any mistake in the specs (a wrong axis, a dimension
split that the kernel reduces over, an output put back in the wrong place) changes values.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from dsv41_jax.numerics import kv_layout, quant
from pallas_kernels import fp8_block_gemm, indexer_scores, sparse_sink_attention, sparse_sink_attention_values
from pallas_kernels.common import partition
from pallas_kernels.sparse_attention.testing import make_inputs

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices, as conftest.py sets")


def _mesh():
    return jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"), axis_types=(AxisType.Auto,) * 3)


def _both(fn, args, mesh, specs):
    """(fn on one device, fn jitted on `mesh` with the kernels per device and args laid out by specs)."""
    one = jax.jit(fn)(*args)

    def traced(*a):
        with partition.kernel_mesh(mesh, batch=("data", "expert"), heads=("tensor",)):
            return fn(*a)

    placed = [a if s is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    lowered = jax.jit(traced).lower(*placed)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    return one, lowered.compile()(*placed)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_attention_split_over_batch_and_heads_is_bitwise():
    rng = np.random.default_rng(0)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, 4, 2, 4, 64, 24, 16, 8, 6)

    def f(q, window, compressed, widx, cidx, sink):
        return sparse_sink_attention(q, window, compressed, widx, cidx, sink, 0.125, impl="pallas", interpret=True)

    b = P(("data", "expert"))
    one, many = _both(f, (q, window, compressed, widx, cidx, sink), _mesh(),
                      (P(("data", "expert"), None, "tensor"), b, b, b, b, P("tensor")))
    _same(one, many)
    assert float(jnp.max(jnp.abs(one.astype(jnp.float32)))) > 0


def test_attention_batch_not_divisible_runs_whole_on_every_device():
    rng = np.random.default_rng(1)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, 1, 1, 4, 64, 24, 16, 8, 6)

    def f(q, window, widx, sink):
        return sparse_sink_attention(q, window, None, widx, None, sink, 0.125, impl="pallas", interpret=True)

    one, many = _both(f, (q, window, widx, sink), _mesh(), (None,) * 4)
    _same(one, many)


def test_training_attention_values_and_gradients_on_a_mesh():
    rng = np.random.default_rng(2)
    q, _, _, widx, cidx, sink = make_inputs(rng, 4, 2, 4, 64, 24, 16, 8, 6)
    wraw = jnp.asarray(rng.standard_normal((4, 24, 64)), jnp.float32)
    craw = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.float32)

    def f(q, wraw, craw, widx, cidx, sink):
        def loss(q, wraw, craw, sink):
            out = sparse_sink_attention_values(q, wraw, craw, widx, cidx, sink, 0.125, impl="pallas", interpret=True)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, wraw, craw, sink)

    b = P(("data", "expert"))
    one, many = _both(f, (q, wraw, craw, widx, cidx, sink), _mesh(), (b, b, b, b, b, None))
    (g1, out1), (g2, out2) = one, many
    _same(out1, out2)
    _same(g1[:3], g2[:3])  # per row: the same bits
    np.testing.assert_allclose(np.asarray(g1[3]), np.asarray(g2[3]), rtol=1e-5)  # the sink's: summed over rows


def test_indexer_split_over_batch_is_bitwise():
    rng = np.random.default_rng(3)
    B, S, Hi, Di, G = 4, 2, 4, 64, 40
    qp, qs = quant.quant_fp4_mx(jnp.asarray(rng.standard_normal((B, S, Hi, Di)), jnp.float32), 32)
    keys = kv_layout.quantize_index_keys(jnp.asarray(rng.standard_normal((B, G, Di)), jnp.float32))
    w = jnp.asarray(rng.standard_normal((B, S, Hi)), jnp.float32)
    clen = jnp.asarray(rng.integers(0, G + 1, (B, S)), jnp.int32)
    pool = jnp.asarray(rng.random((B, S, G)) < 0.6)

    def f(*a):
        return indexer_scores(*a, bf16_rounding=True, impl="pallas", interpret=True)

    b = P(("data", "expert"))
    one, many = _both(f, (qp, qs, keys, w, clen, pool), _mesh(), (b,) * 6)
    _same(one, many)
    assert np.isfinite(np.asarray(one)).any()


def test_fp8_gemm_split_over_rows_is_bitwise():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((8, 96)), jnp.bfloat16)
    w8, s8 = quant.quant_fp8_weight(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32))

    def f(x, w, s):
        return fp8_block_gemm(x, w, s, impl="pallas", interpret=True)

    one, many = _both(f, (x, w8, s8), _mesh(), (P(("data", "expert")), None, None))
    _same(one, many)


def test_no_mesh_or_inside_a_shard_map_calls_the_kernel_as_it_is():
    mesh = _mesh()
    assert partition.active() is None
    with partition.kernel_mesh(mesh, batch=("data",)):
        assert partition.active() is not None
        seen = []

        def body(x):
            seen.append(partition.active())
            return x

        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))(
            jnp.ones((8, 2)))
        assert seen == [None]
    one_device = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    with partition.kernel_mesh(one_device, batch=("data",)):
        assert partition.active() is None
