"""The Mosaic TPU kernels compiled and run on a TPU, against the jnp references.

Deselected by default (marker `tpu`); run with `python -m pytest -m tpu pallas_kernels/common/test_tpu_kernels.py`.
"""
import jax
import pytest

from pallas_kernels.common.device_checks import CHECKS

pytestmark = pytest.mark.tpu


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_on_tpu(name):
    if jax.default_backend() != "tpu":
        pytest.skip(f"needs a TPU backend, found {jax.default_backend()}")
    CHECKS[name]("tpu")
