"""Test-session setup: 8 fake CPU devices for sharding tests, and the golden folder."""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent


def golden_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DSV41_GOLDEN_DIR", REPO.parent / "shared" / "golden"))


@pytest.fixture(scope="session")
def golden_root() -> pathlib.Path:
    root = golden_dir()
    if not root.is_dir():
        pytest.skip(f"golden folder {root} not found; set DSV41_GOLDEN_DIR to run golden tests")
    return root
