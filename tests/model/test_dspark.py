"""DSpark (the mtp.* drafter): config fields under both naming schemes, the release census of its
tensors, bitwise HF / orbax round trips, a checkpoint without it, and the drafter's block
semantics (no causal mask inside the block, rings written only where told)."""
import json
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.checkpoint.hf_loader import INDEX_FILE, load_checkpoint
from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint
from dsv41_jax.checkpoint.names import check_name_mapping, disk_tensors
from dsv41_jax.checkpoint.synthetic import model_from_params, random_params
from dsv41_jax.model.param_names import flat_params
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.model import dspark

DSPARK = dict(n_mtp_layers=3, dspark_block_size=5, dspark_noise_token_id=500, dspark_target_layer_ids=(4, 5, 6),
              dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=3)
TINY_DS = ModelConfig.tiny(**DSPARK)


def _bits(a):
    return np.asarray(a).reshape(-1).view(np.uint8)


def _assert_bit_equal(want: dict, model):
    got = flat_params(model)
    assert set(got) == set(want)
    for path, v in want.items():
        g = np.asarray(got[path].get_value())
        assert g.dtype == v.dtype and g.shape == v.shape and np.array_equal(_bits(g), _bits(v)), path


# ------------------------------------------------------------------------------------ config
def test_config_reads_hf_and_reference_names():
    text = TINY_DS.to_hf_dict()["text_config"]
    assert text["num_nextn_predict_layers"] == 3 and text["dspark_num_experts_per_tok"] == 3
    again = ModelConfig.from_dict(TINY_DS.to_hf_dict()).replace(max_seq_len=TINY_DS.max_seq_len,
                                                                max_batch_size=TINY_DS.max_batch_size)
    assert again == TINY_DS and again.has_dspark
    flat = ModelConfig.from_dict(TINY_DS.to_flat_dict())
    assert flat == TINY_DS and flat.to_flat_dict()["dspark_n_activated_experts"] == 3
    release = ModelConfig.v41_flash()
    assert (release.n_mtp_layers, release.dspark_block_size, release.dspark_target_layer_ids) == (3, 5, (37, 38, 39))
    assert release.dspark_moe == (128, 3) and release.dspark_noise_token_id == 128799
    assert not TINY_DS.without_dspark().has_dspark


@pytest.mark.parametrize("overrides, message", [
    (dict(dspark_target_layer_ids=(4, 9)), "dspark_target_layer_ids: layer 9 is outside"),
    (dict(dspark_target_layer_ids=()), "at least one target layer"),
    (dict(dspark_n_activated_experts=5), "dspark_n_activated_experts: 5 exceeds dspark_n_routed_experts 4"),
    (dict(dspark_noise_token_id=512), "dspark_noise_token_id: 512 is outside"),
    (dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1, 0, 2, 0)), "DSpark stages .* window-only"),
])
def test_bad_dspark_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.tiny(**{**DSPARK, **overrides})


# ------------------------------------------------------------------------------------ census
def test_full_size_census_of_the_drafter():
    """The released stages' tensors, from the abstract stages alone (the backbone census is in test_checkpoint)."""
    from flax import nnx

    from dsv41_jax.layers.basic import KeyStream

    cfg = ModelConfig.v41_flash()
    stages = nnx.eval_shape(lambda: dspark.build_stages(cfg, KeyStream(0)))
    flat = {("mtp",) + p: v for p, v in flat_params(stages).items()}
    tensors = disk_tensors(flat)
    check_name_mapping(tensors)
    by_name = {t.name: (t.dtype, t.shape) for t in tensors}
    families = Counter(re.sub(r"\.\d+\.", ".*.", re.sub(r"^mtp\.\d+\.", "mtp.K.", t.name)) for t in tensors)
    assert families["mtp.K.ffn.experts.*.w1.weight"] == 3 * 128  # 128 routed experts in each of 3 stages
    assert by_name["mtp.1.ffn.experts.127.w2.weight"] == ("I8", (5120, 1152))
    assert by_name["mtp.1.ffn.experts.127.w2.scale"] == ("F8_E8M0", (5120, 2304 // 32))
    assert by_name["mtp.0.main_proj.weight"] == ("F8_E4M3", (5120, 3 * 5120))
    assert by_name["mtp.0.main_proj.scale"] == ("F8_E8M0", (160, 480))
    assert by_name["mtp.0.main_norm.weight"] == ("BF16", (5120,))
    assert by_name["mtp.2.norm.weight"] == ("BF16", (5120,))
    assert by_name["mtp.2.markov_head.embed.weight"] == ("BF16", (129280, 256))
    assert by_name["mtp.2.markov_head.head.weight"] == ("BF16", (129280, 256))
    assert by_name["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 5120 + 256))
    assert by_name["mtp.1.ffn.gate.weight"] == ("BF16", (128, 5120)) and by_name["mtp.1.ffn.gate.bias"] == ("F32", (128,))
    assert by_name["mtp.1.attn.wq_a.weight"] == ("F8_E4M3", (1280, 5120))
    assert by_name["mtp.1.attn.wo_a.weight"][0] == "F8_E4M3" and "mtp.1.attn.wo_a.scale" in by_name
    assert by_name["mtp.1.attn.attn_sink"] == ("F32", (64,)) and by_name["mtp.1.hc_ffn_fn"] == ("F32", (24, 4 * 5120))
    # window-only stages: no compressor, indexer or Engram; embed and head are the backbone's, not stored again
    assert not any(re.search(r"compressor|indexer|engram|\.embed\.weight$|\.head\.weight$", n) and "markov" not in n
                   for n in by_name)
    assert {n.split(".")[1] for n in by_name} == {"0", "1", "2"}
    assert "mtp.1.main_proj.weight" not in by_name and "mtp.0.markov_head.embed.weight" not in by_name


# --------------------------------------------------------------------------------- round trips
@pytest.fixture(scope="module")
def ds_params():
    return random_params(TINY_DS, seed=3)


@pytest.fixture(scope="module")
def ds_ckpt(tmp_path_factory, ds_params):
    folder = tmp_path_factory.mktemp("tiny_dspark")
    save_hf_checkpoint(model_from_params(TINY_DS, ds_params), folder, narrow="strict", max_shard_bytes=512 << 10,
                       overwrite=True)
    return folder


@pytest.mark.slow  # compiles the drafter; kept out of the 20-minute default suite
def test_hf_and_orbax_round_trips_with_the_drafter_are_bitwise(ds_ckpt, ds_params, tmp_path):
    from dsv41_jax.checkpoint.orbax_io import load_orbax_checkpoint, save_params

    index = json.loads((ds_ckpt / INDEX_FILE).read_text())["weight_map"]
    mtp = [n for n in index if n.startswith("mtp.")]
    assert "mtp.0.main_proj.scale" in mtp and "mtp.2.ffn.experts.3.w3.weight" in mtp and "mtp.0.embed.weight" not in mtp
    runtime = {"max_seq_len": TINY_DS.max_seq_len, "max_batch_size": TINY_DS.max_batch_size}
    cfg, model, report = load_checkpoint(ds_ckpt, progress=False, config_overrides=runtime)
    assert cfg == TINY_DS and not report.skipped
    _assert_bit_equal(ds_params, model)
    save_params(tmp_path / "orbax", model)
    cfg2, restored, _ = load_orbax_checkpoint(tmp_path / "orbax", config_overrides=runtime)
    assert cfg2 == cfg
    _assert_bit_equal(ds_params, restored)


def test_checkpoint_without_the_drafter_loads_and_refuses_speculation(ds_params, tmp_path):
    """A config that describes DSpark over shards that hold no mtp.* tensors (the backbone alone)."""
    backbone = TINY_DS.without_dspark()
    params = {p: v for p, v in ds_params.items() if p[0] != "mtp"}
    save_hf_checkpoint(model_from_params(backbone, params), tmp_path / "nomtp", narrow="strict")
    (tmp_path / "nomtp" / "config.json").write_text(json.dumps(TINY_DS.to_hf_dict()))
    assert not any(n.startswith("mtp.") for n in json.loads((tmp_path / "nomtp" / INDEX_FILE).read_text())["weight_map"])
    runtime = {"max_seq_len": TINY_DS.max_seq_len, "max_batch_size": TINY_DS.max_batch_size}
    cfg, model, _ = load_checkpoint(tmp_path / "nomtp", progress=False, config_overrides=runtime)
    assert cfg.n_mtp_layers == 0 and model.mtp is None and cfg == TINY_DS.without_dspark()
    with pytest.raises(dspark.DSparkUnavailable, match="needs the DSpark drafter.*mtp.\\* tensors"):
        dspark.require_dspark(model)


# ------------------------------------------------------------------------------ block semantics
@pytest.mark.slow  # compiles the drafter; kept out of the 20-minute default suite
def test_block_is_not_causal_and_rings_take_only_valid_rows(ds_params):
    """Every block query sees the valid ring slots and all block tokens (no causal mask inside the
    block); rows past n_valid never reach a ring."""
    from flax import nnx

    cfg = TINY_DS
    graphdef, params = nnx.split(model_from_params(cfg, ds_params))

    @jax.jit
    def run(params, taps):
        model = nnx.merge(graphdef, params)
        state = dspark.init_state(cfg, 1)
        mx = dspark.main_x(model, taps, "fast")
        full = dspark.write_rings(model, state, mx, jnp.asarray([0]), jnp.asarray([6]), "fast")
        part = dspark.write_rings(model, state, mx, jnp.asarray([0]), jnp.asarray([4]), "fast")
        _, _, _, aux = dspark.draft(model, full, jnp.asarray([7]), jnp.asarray([5]), mode="fast", collect=True)
        return full["rings"][1].values, part["rings"][1].values, aux["trace"]["stage0.attn_topk_idxs"]

    taps = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 3 * cfg.dim)), jnp.bfloat16)
    rf, rp, idx = (np.asarray(a, np.float32) for a in run(params, taps))
    assert np.array_equal(rf[0, :4], rp[0, :4]) and not rp[0, 4:].any() and rf[0, 4:6].any()
    stage0 = idx[0]
    assert stage0.shape == (5, cfg.window_size + 5)
    assert (stage0[:, :6] >= 0).all() and (stage0[:, 6:cfg.window_size] == -1).all() and (stage0[:, cfg.window_size:] >= 0).all()


def test_every_drafter_parameter_has_logical_axes():
    from flax import nnx

    from dsv41_jax.model.transformer import Transformer
    from sharding.rules import param_logical_axes

    abstract = nnx.eval_shape(lambda: Transformer(TINY_DS, rngs=0))
    mtp = {p: v for p, v in flat_params(abstract).items() if p[0] == "mtp"}
    assert len(mtp) > 100
    for path, var in mtp.items():
        assert len(param_logical_axes(path, len(var.shape))) == len(var.shape)
    assert param_logical_axes(("mtp", 1, "ffn", "experts", "w2_scale"))[0] == "expert"


@pytest.mark.slow  # two abstract full-size models: minutes on a loaded 2-core box
def test_speculative_cost_at_the_released_shapes():
    """Draft + verify vs plain decode from the real shapes: six verified tokens read more distinct
    experts than one, so the break-even acceptance length by bytes grows with the batch."""
    from dsv41_jax.serving.spec_cost import break_even, distinct_experts

    assert distinct_experts(384, 6, 1) == pytest.approx(6)
    assert distinct_experts(384, 6, 6) < 36 and distinct_experts(384, 6, 10_000) == pytest.approx(384)
    b1, b8 = break_even(ModelConfig.v41_flash(), 1), break_even(ModelConfig.v41_flash(), 8)
    assert b1["verify"]["tokens"] == 6 and b1["draft"]["tokens"] == 5
    assert b1["verify"]["flops"] == pytest.approx(6 * b1["plain"]["flops"])
    assert b1["plain"]["bytes"] < b1["verify"]["bytes"] < 6 * b1["plain"]["bytes"]
    assert 1 < b1["break_even_tokens_per_step"]["bytes"] < b8["break_even_tokens_per_step"]["bytes"] < 6
