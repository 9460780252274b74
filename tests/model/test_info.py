"""`dsv41 info`: figures of the released config, and that they move with the config."""
import json
import subprocess
import sys

import pytest

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.info import model_info


@pytest.fixture(scope="module")
def flash():
    return model_info(ModelConfig.v41_flash())


def test_released_figures(flash):
    assert abs(flash["backbone_params"] / 552e9 - 1) < 0.01
    assert abs(flash["engram_params"] / 196.6e9 - 1) < 0.01
    assert abs(flash["dspark_params"] / 14.2e9 - 1) < 0.01  # mtp.*: "about 14B parameters", apart from the backbone
    assert abs(flash["active_params_decode"] / 16e9 - 1) < 0.03
    assert abs(flash["active_params_prefill_split"] / 8e9 - 1) < 0.05
    assert flash["global_kv_bytes_per_token"] == 890
    assert flash["row_bytes"] == {"compressed_kv": 288, "index_key": 68, "window": 528}
    assert flash["window_bytes_per_sequence"] == 40 * 128 * 528


def test_vision_parameters_are_counted_apart(flash):
    d, f, p, D = 1024, 2816, 14, 5120  # the released vision_config
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 2 * f) + (f * d) + 2 * d
    tower = (3 * p * p * d + d) + 32 * block + d
    aligner = (9 * d * D + D) + (D * D + D)
    assert flash["vision_params"] == tower + aligner + 3 * D + 40 * 384  # + delimiters + bias_vl
    assert flash["vision"]["layers"] == 32 and flash["vision"]["max_image_tokens"] == 1024


@pytest.mark.slow  # a second full-size abstract model
def test_language_model_only_drops_exactly_the_vision_parameters(flash):
    text_only = model_info(ModelConfig.v41_flash().language_model_only())
    assert text_only["vision_params"] == 0 and text_only["vision"] is None
    assert text_only["backbone_params"] == flash["backbone_params"]


# slow: 22.6 s of the default suite (six abstract released models), which took 909.2 s of its 900 at the
# clean-clone CI of 2026-12-04; the default suite keeps the released figures (test_cli_json and the tests above)
@pytest.mark.slow
def test_figures_follow_the_config(flash):
    base = ModelConfig.v41_flash()
    fewer_experts = model_info(base.replace(n_routed_experts=192))
    per_expert = (3 * 2304 * 5120 + 5120 + 1) * 40  # three matrices, plus its gate row and bias, per layer
    assert flash["backbone_params"] - fewer_experts["backbone_params"] == 192 * per_expert
    assert fewer_experts["active_params_decode"] - flash["active_params_decode"] == pytest.approx(0, abs=2 * 5120 * 192 * 40 + 1)
    more_heads = model_info(base.replace(index_n_heads=64))
    assert more_heads["global_kv_bytes_per_token"] == flash["global_kv_bytes_per_token"]  # keys are per position, not per head
    wider_keys = model_info(base.replace(index_head_dim=256))
    assert wider_keys["row_bytes"]["index_key"] == 128 + 8
    # ratio-4 encoder sources: their share of the KV per token halves
    r4 = base.replace(compress_ratios=(0, 0) + (4,) * 18 + (1,) * 20 + (0, 0, 0))
    assert model_info(r4)["global_kv_bytes_per_token"] == 3 * (288 + 68) / 4 + (288 + 68)
    smaller_window = model_info(base.replace(window_size=64))
    assert smaller_window["window_bytes_per_sequence"] == flash["window_bytes_per_sequence"] // 2


def test_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "info", "--config", "v41-flash", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["global_kv_bytes_per_token"] == 890
    bad = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "info", "--config", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown preset 'nope'" in bad.stderr
