"""Both sparse-attention kernels lower for their hardware from this CPU machine (V4.1-Flash shapes)."""
import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.numerics import kv_layout
from pallas_kernels import sparse_sink_attention
from pallas_kernels.common.lowering import custom_call_targets, lower_for
from pallas_kernels.sparse_attention.specs import FLASH

sds = jax.ShapeDtypeStruct
TARGET = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


def _shapes(B, S, G):
    H, D, W, K = FLASH["heads"], FLASH["head_dim"], FLASH["window"], FLASH["topk"]
    return (sds((B, S, H, D), jnp.bfloat16), sds((B, W, D), jnp.float8_e4m3fn), sds((B, W, D // 32), jnp.uint8),
            sds((B, G, D // 2), jnp.uint8), sds((B, G, D // 16), jnp.float8_e4m3fn), sds((B, S, W), jnp.int32),
            sds((B, S, K), jnp.int32), sds((H,), jnp.float32))


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("B,S,G", [(8, 1, 2048), (1, 4, 1024)], ids=["decode", "prefill"])
def test_lowers(platform, B, S, G):
    def f(q, wv, ws, cp, cs, widx, cidx, sink):
        return sparse_sink_attention(q, kv_layout.WindowKV(wv, ws), kv_layout.CompressedKV(cp, cs), widx, cidx, sink,
                                     FLASH["head_dim"] ** -0.5, impl="pallas", interpret=False, platform=platform)

    text = lower_for(platform, f, *_shapes(B, S, G))
    assert TARGET[platform] in custom_call_targets(text)


def test_a_layer_of_stacked_rings_lowers_for_tpu():
    """Decode over one layer of a scanned run's stacked rings (word views, the layer a traced scalar)."""
    B, G, L = 8, 2048, 3
    q, wv, ws, cp, cs, widx, cidx, sink = _shapes(B, 1, G)
    rings = jax.eval_shape(lambda v, s: jax.tree.map(lambda a: jnp.stack([a] * L),
                                                     kv_layout.words_of(kv_layout.WindowKV(v, s))), wv, ws)

    def f(q, rings, layer, cp, cs, widx, cidx, sink):
        return sparse_sink_attention(q, kv_layout.LayerRing(rings, layer), kv_layout.CompressedKV(cp, cs), widx, cidx,
                                     sink, FLASH["head_dim"] ** -0.5, impl="pallas", interpret=False, platform="tpu")

    text = lower_for("tpu", f, q, rings, sds((), jnp.int32), cp, cs, widx, cidx, sink)
    assert TARGET["tpu"] in custom_call_targets(text)
