"""The Triton-lowered kernels compiled and run on a CUDA GPU, against the jnp references.

Deselected by default (marker `gpu`); run with `python -m pytest -m gpu pallas_kernels/common/test_gpu_kernels.py`.
"""
import jax
import pytest

from pallas_kernels.common.device_checks import CHECKS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_on_gpu(name):
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU backend, found {jax.default_backend()}")
    CHECKS[name]("gpu")
