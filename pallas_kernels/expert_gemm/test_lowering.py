"""Both expert-GEMM kernels lower for their hardware from this CPU machine (V4.1-Flash shapes)."""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import fp8_block_gemm, grouped_fp4_gemm
from pallas_kernels.common.lowering import custom_call_targets, lower_for

sds = jax.ShapeDtypeStruct
TARGET = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("M,E,N,K", [(384, 384, 2304, 5120), (2048, 32, 5120, 2304)], ids=["w1-decode", "w2-prefill"])
def test_grouped_lowers(platform, M, E, N, K):
    def f(x, gs, wp, ws):
        return grouped_fp4_gemm(x, gs, wp, ws, impl="pallas", interpret=False, platform=platform)

    shapes = (sds((M, K), jnp.bfloat16), sds((E,), jnp.int32), sds((E, N, K // 2), jnp.uint8),
              sds((E, N, K // 32), jnp.uint8))
    assert TARGET[platform] in custom_call_targets(lower_for(platform, f, *shapes))


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("M,N,K", [(64, 32768, 1280), (7, 80, 96)], ids=["wq_b", "partial-tiles"])
def test_fp8_lowers(platform, M, N, K):
    def f(x, w, s):
        return fp8_block_gemm(x, w, s, impl="pallas", interpret=False, platform=platform)

    shapes = (sds((M, K), jnp.bfloat16), sds((N, K), jnp.float8_e4m3fn), sds((-(-N // 32), -(-K // 32)), jnp.uint8))
    assert TARGET[platform] in custom_call_targets(lower_for(platform, f, *shapes))


@pytest.mark.parametrize("M,N,K", [(64, 32768, 1280), (7, 80, 96)], ids=["wq_b", "partial-tiles"])
def test_fp8_word_view_lowers_for_tpu(M, N, K):
    """The FP8 kernel on the word view made at load (`layout.fp8_weight_view`): two blocks of one array."""
    def f(x, w, s):
        return fp8_block_gemm(x, w, s, impl="pallas", interpret=False, platform="tpu")

    shapes = (sds((M, K), jnp.bfloat16), sds((2, N, -(-K // 32) * 4), jnp.int32),
              sds((-(-N // 32), -(-K // 32)), jnp.uint8))
    assert TARGET["tpu"] in custom_call_targets(lower_for("tpu", f, *shapes))


def test_grouped_words_lower_for_tpu():
    """The expert kernel on the experts' word views made at load (`layout.fp4_weight_words`)."""
    M, E, N, K = 384, 384, 2304, 5120

    def f(x, gs, w, s):
        return grouped_fp4_gemm(x, gs, w, s, impl="pallas", interpret=False, platform="tpu")

    shapes = (sds((M, K), jnp.bfloat16), sds((E,), jnp.int32), sds((E, N, K // 8), jnp.int32),
              sds((E, N, K // 128), jnp.int32))
    assert TARGET["tpu"] in custom_call_targets(lower_for("tpu", f, *shapes))
