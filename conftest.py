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


@pytest.fixture(scope="session")
def tiny_every_role():
    """(cfg, graphdef, params) of a tiny model with every layer role: SWA, Full r2, Reuse, Reindex r2,
    Full r1 + pool source, Reindex r1 in the pool, Reuse; a small window and few candidates make the
    window ring, pool and top-k all bind at short lengths."""
    from flax import nnx

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.model.transformer import Transformer

    cfg = ModelConfig.tiny(engram_layer_ids=(), window_size=4, index_topk=4, candidate_topk_blocks=2,
                           candidate_block_size=4, max_seq_len=32, max_batch_size=2)
    graphdef, params = nnx.split(Transformer(cfg, rngs=1))
    return cfg, graphdef, params
