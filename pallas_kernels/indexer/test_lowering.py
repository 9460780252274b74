"""Both indexer kernels lower for their hardware from this CPU machine (V4.1-Flash shapes)."""
import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.numerics import kv_layout
from pallas_kernels import indexer_scores
from pallas_kernels.common.lowering import custom_call_targets, lower_for
from pallas_kernels.indexer.specs import FLASH

sds = jax.ShapeDtypeStruct
TARGET = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("B,S,G,pool", [(8, 1, 4096, False), (1, 16, 2048, True)], ids=["decode", "prefill-pool"])
def test_lowers(platform, B, S, G, pool):
    Hi, Di = FLASH["heads"], FLASH["head_dim"]
    shapes = [sds((B, S, Hi, Di // 2), jnp.uint8), sds((B, S, Hi, Di // 32), jnp.uint8),
              sds((B, G, Di // 2), jnp.uint8), sds((B, G, Di // 32), jnp.uint8),
              sds((B, S, Hi), jnp.float32), sds((B, S), jnp.int32)]
    if pool:
        shapes.append(sds((B, S, G), jnp.bool_))

    def f(qp, qs, kp, ks, w, clen, *pm):
        return indexer_scores(qp, qs, kv_layout.IndexKeys(kp, ks), w, clen, pm[0] if pm else None,
                              bf16_rounding=True, impl="pallas", interpret=False, platform=platform)

    assert TARGET[platform] in custom_call_targets(lower_for(platform, f, *shapes))
