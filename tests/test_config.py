"""ModelConfig: readers/writers, presets, derived roles, and refusals of malformed configs."""
import json
import pathlib

import pytest

from dsv41_jax.config import ConfigError, ModelConfig

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "reference"


def _ref(name):
    p = SHARED / name
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p


def test_hf_and_flat_configs_agree_with_the_preset():
    hf = ModelConfig.from_file(_ref("hf_config.json"))
    flat = ModelConfig.from_file(_ref("inference_config.json"))
    preset = ModelConfig.preset("v41-flash")
    assert hf == flat == preset


def test_round_trips(tmp_path):
    hf = ModelConfig.from_file(_ref("hf_config.json"))
    assert ModelConfig.from_dict(json.loads(json.dumps(hf.to_hf_dict()))) == hf
    flat = ModelConfig.from_file(_ref("inference_config.json"))
    out = tmp_path / "config.json"
    out.write_text(json.dumps(flat.to_flat_dict()))
    again = ModelConfig.from_file(out)
    assert again == flat
    # keys we carry but do not model (vision, DSpark) survive the round trip
    assert again.to_flat_dict()["vision_dim"] == 1024
    assert hf.to_hf_dict()["vision_config"]["hidden_size"] == 1024


def test_v41_flash_roles():
    roles = ModelConfig.v41_flash().roles
    kinds = [r.kind for r in roles]
    assert kinds[:2] == ["swa", "swa"]
    assert [l for l, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [l for l, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    assert kinds.count("reuse") == 40 - 2 - 4 - 4
    assert all(r.half == "encoder" for r in roles[:20]) and all(r.half == "decoder" for r in roles[20:])
    assert roles[21].kv_source == 20 and roles[21].index_source == 20
    assert roles[25].kv_source == 20 and roles[25].index_source == 24
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert roles[3].kv_source == 2 and roles[9].index_source == 8
    assert roles[1].has_engram and roles[14].has_engram


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'v5-turbo'"):
        ModelConfig.load("v5-turbo")


def test_v4_config_is_refused():
    d = json.loads(_ref("hf_config.json").read_text())
    d["model_type"] = "deepseek_v4"
    d["text_config"]["model_type"] = "deepseek_v4_text"
    with pytest.raises(ConfigError, match="deepseek_v4.*V4 checkpoints have per-layer compressors"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("overrides, message", [
    (dict(kv_source_layers=(4,), index_source_layers=(1, 3, 4, 5)), "layer 1 has compress ratio 2 but no KV source"),
    (dict(kv_source_layers=(0, 4)), "layer 0 has compress ratio 0"),
    (dict(index_source_layers=(3, 4, 5)), "layer 1 reads KV of layer 1 but no index source"),
    (dict(candidate_topk_blocks=1), "cannot supply|can guarantee only 1 visible positions"),
    (dict(candidate_source_layer=5), "layer 5 must be both a KV source and an index source"),
    (dict(head_dim=48), "head_dim: 48 must be a multiple of 32"),
    (dict(compress_ratios=(0, 2, 2)), "compress_ratios: has 3 entries but n_layers is 7"),
    (dict(compress_ratios=(0, 2, 2, 1, 1, 1, 1)), "layer 3 has ratio 1 but its KV source \\(layer 1\\) has ratio 2"),
    (dict(n_activated_experts=9), "exceeds n_routed_experts 8"),
    (dict(engram_layer_ids=(9,)), "engram_layer_ids: layer 9 is outside"),
])
def test_malformed_configs_name_field_and_layer(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.tiny(**overrides)


def test_bad_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(p)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_file(tmp_path / "missing.json")
