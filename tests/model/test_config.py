"""ModelConfig: readers/writers, presets, derived roles, and refusals of malformed configs."""
import json
import pathlib

import pytest

from dsv41_jax.config import ConfigError, ModelConfig

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "reference"


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


def _info(path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "info", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_wrong_types_and_absurd_sizes_are_rc2_naming_the_field(tmp_path):
    """The issue's probes, through `dsv41 info` (real CLI): each config is refused at once, rc 2,
    with the field (and its HF name) in the message. 10**6 layers used to hang info for > 10 min."""
    flat = ModelConfig.tiny().to_flat_dict()
    hf = ModelConfig.tiny().to_hf_dict()
    cases = {
        "str_vocab": (dict(flat, vocab_size="512"), "vocab_size: must be an integer, got '512' (string)"),
        "null_vocab": (dict(flat, vocab_size=None), "vocab_size: must be an integer, got None (null)"),
        "float_hidden": (dict(hf, text_config=dict(hf["text_config"], hidden_size=128.5)),
                         "dim (HF config.json: hidden_size): must be an integer, got 128.5 (number)"),
        "zero_experts": (dict(flat, n_routed_experts=0), "n_routed_experts: must be at least 1, got 0"),
        "zero_groups": (dict(flat, o_groups=0), "o_groups: must be at least 1, got 0"),
        "a_list": ([flat], "holds a JSON list, not an object of config fields"),
        "str_text_config": (dict(hf, text_config="deepseek"), "text_config: must be an object of model fields, got a string"),
        "million_layers": (dict(flat, n_layers=10**6, compress_ratios=[0] * 10**6),
                           "n_layers (HF config.json: num_hidden_layers): 1000000 is beyond any V4.1 model (at most 1024"),
        "huge_vocab": (dict(flat, vocab_size=10**30), "vocab_size: 1000000000000000000000000000000 is beyond any V4.1 model"),
        "float_vocab": (dict(flat, vocab_size=1e30), "vocab_size: must be an integer, got 1e+30 (number)"),
        "bool_flag": (dict(flat, norm_topk_prob="yes"), "norm_topk_prob: must be true or false"),
        "bad_ratios": (dict(flat, compress_ratios=[0, 2.5]), "compress_ratios: must be a list of integers"),
    }
    for name, (config, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        if name in ("million_layers", "float_hidden", "a_list"):  # one real CLI run per kind of probe
            out = _info(path)
            assert out.returncode == 2 and out.stderr.startswith("dsv41 info: ") and message in out.stderr, (name, out.stderr)
            assert "Traceback" not in out.stderr
        else:
            with pytest.raises(ConfigError) as e:
                ModelConfig.from_file(path)
            assert message in str(e.value), (name, str(e.value))


def test_misspelt_keys_warn_with_a_suggestion(tmp_path):
    flat = ModelConfig.tiny().to_flat_dict()
    path = tmp_path / "typo.json"
    # the warning comes as the keys are read; o_groups=0 then stops info before JAX is imported (cheap)
    path.write_text(json.dumps(dict(flat, vocab_szie=7, dspark_block_size=4, hidden_act="silu", o_groups=0)))
    out = _info(path)
    assert out.returncode == 2 and "o_groups: must be at least 1" in out.stderr, out.stderr
    assert "dsv41: warning: config key 'vocab_szie' is not a V4.1 field; did you mean 'vocab_size'?" in out.stderr
    assert "dspark_block_size" not in out.stderr and "hidden_act" not in out.stderr  # released extras are no typos
    hf = ModelConfig.tiny().to_hf_dict()
    with pytest.warns(UserWarning, match="'num_hiden_layers' is not a V4.1 field; did you mean 'num_hidden_layers'"):
        loaded = ModelConfig.from_dict(dict(hf, text_config=dict(hf["text_config"], num_hiden_layers=3)))
    assert loaded.n_layers == ModelConfig.tiny().n_layers  # loads, with the field's own value
