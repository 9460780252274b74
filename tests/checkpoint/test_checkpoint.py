"""HF shard checkpoints: bitwise round trips, the release census, hand-decoded FP8/FP4 blocks,
error reporting, placement on a mesh, orbax, the golden weights through the HF path, and
the peak host memory of a load."""
import json
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter

import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.checkpoint import load, placement, safetensors_file
from dsv41_jax.checkpoint.hf_loader import INDEX_FILE, CheckpointError, load_checkpoint
from dsv41_jax.checkpoint.hf_writer import model_entries, save_hf_checkpoint, write_hf_folder
from dsv41_jax.checkpoint.names import check_name_mapping, disk_tensors
from dsv41_jax.checkpoint.safetensors_file import SafetensorsError, TensorEntry, read_header, write_file
from dsv41_jax.checkpoint.synthetic import fake_extra_entries, model_from_params, random_entries, random_params
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.checkpoint.weights import WeightError
from dsv41_jax.model.param_names import flat_params

TINY = ModelConfig.tiny()  # 7 layers: every layer role, Engram on layers 1 and 3
RUNTIME_FIELDS = {"max_seq_len": TINY.max_seq_len, "max_batch_size": TINY.max_batch_size}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint8)


def assert_params_bit_equal(want: dict, model):
    got = flat_params(model)
    assert set(got) == set(want)
    for path, v in want.items():
        g = np.asarray(got[path].get_value())
        assert g.dtype == np.asarray(v).dtype, path
        assert g.shape == np.asarray(v).shape, path
        assert np.array_equal(_bits(g), _bits(v)), f"{path} differs"


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=1)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_params):
    folder = tmp_path_factory.mktemp("tiny_hf")
    model = model_from_params(TINY, tiny_params)
    save_hf_checkpoint(model, folder, narrow="strict", extra=fake_extra_entries(TINY), max_shard_bytes=256 << 10,
                       overwrite=True)
    return folder


# ------------------------------------------------------------------------------ round trips
def test_multi_shard_round_trip_is_bitwise(tiny_ckpt, tiny_params):
    shards = sorted(p.name for p in tiny_ckpt.glob("*.safetensors"))
    assert len(shards) >= 5 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    cfg, model, report = load_checkpoint(tiny_ckpt, progress=False, config_overrides=RUNTIME_FIELDS)
    assert cfg == TINY
    assert_params_bit_equal(tiny_params, model)
    assert sorted(report.skipped) == sorted(e.name for e in fake_extra_entries(TINY))
    assert len(report.dequantized) == TINY.n_layers  # every wo_a was FP8 + scale on disk
    assert any("compressor.wkv" in n for n in report.upcast)
    assert report.shards == len(shards)


def test_files_carry_the_release_dtypes_and_are_standard_safetensors(tiny_ckpt):
    from safetensors import safe_open

    index = json.loads((tiny_ckpt / INDEX_FILE).read_text())
    infos = {}
    for shard in set(index["weight_map"].values()):
        infos.update(read_header(tiny_ckpt / shard)[0])
    assert set(infos) == set(index["weight_map"])
    expected = {  # docs/REFERENCE.md §9 tensor families
        "layers.1.attn.wq_a.weight": "F8_E4M3", "layers.1.attn.wq_a.scale": "F8_E8M0",
        "layers.1.attn.wo_a.weight": "F8_E4M3", "layers.1.attn.wo_a.scale": "F8_E8M0",
        "layers.1.ffn.experts.5.w2.weight": "I8", "layers.1.ffn.experts.5.w2.scale": "F8_E8M0",
        "layers.1.engram.embed.weight": "F8_E4M3", "layers.1.engram.embed.scale": "F8_E8M0",
        "layers.1.attn.compressor.wkv.weight": "BF16", "layers.1.attn.compressor.wgate.weight": "BF16",
        "layers.1.attn.indexer.wk.weight": "BF16", "embed.weight": "BF16", "head.weight": "BF16",
        "layers.1.attn.attn_sink": "F32", "layers.1.hc_attn_fn": "F32", "layers.1.ffn.gate.bias": "F32",
    }
    assert {n: infos[n].dtype for n in expected} == expected
    assert infos["layers.1.ffn.experts.0.w1.weight"].shape == (TINY.moe_inter_dim, TINY.dim // 2)
    assert infos["layers.1.ffn.experts.0.w1.scale"].shape == (TINY.moe_inter_dim, TINY.dim // 32)
    # the safetensors library itself parses our files and agrees on every dtype it can materialise
    shard = index["weight_map"]["layers.1.attn.attn_sink"]
    ours = safetensors_file.SafetensorsFile(tiny_ckpt / shard)
    with safe_open(str(tiny_ckpt / shard), "numpy") as f:
        assert set(f.keys()) == set(ours.tensors)
        for name in f.keys():
            if ours.tensors[name].dtype in ("F32", "I8", "BF16"):
                assert np.array_equal(_bits(f.get_tensor(name)), _bits(ours.read(name))), name
    ours.close()


def test_rewrite_orbax_and_cli_convert_round_trip(tiny_ckpt, tiny_params, tmp_path):
    from dsv41_jax.checkpoint.orbax_io import load_orbax_checkpoint, save_params
    from dsv41_jax.cli.main import main

    cfg, model, _ = load_checkpoint(tiny_ckpt, progress=False)
    save_hf_checkpoint(model, tmp_path / "again", max_shard_bytes=1 << 20)
    assert_params_bit_equal(tiny_params, load_checkpoint(tmp_path / "again", progress=False)[1])
    save_params(tmp_path / "orbax", model)
    cfg2, restored, report = load_orbax_checkpoint(tmp_path / "orbax")
    assert cfg2 == cfg and report.format == "orbax"
    assert_params_bit_equal(tiny_params, restored)
    # the CLI: HF -> orbax -> HF, then load through the format-detecting entry point
    assert main(["convert", "--from", "hf", str(tiny_ckpt), "--to", "orbax", str(tmp_path / "cli_orbax"), "--quiet"]) == 0
    assert main(["convert", "--from", "orbax", str(tmp_path / "cli_orbax"), "--to", "hf", str(tmp_path / "cli_hf"),
                 "--max-shard-size", "300KiB", "--narrow", "strict", "--quiet"]) == 0
    assert len(list((tmp_path / "cli_hf").glob("*.safetensors"))) > 1
    assert_params_bit_equal(tiny_params, load(tmp_path / "cli_hf", progress=False)[1])


def test_cli_convert_rejects_bad_requests(tiny_ckpt, tmp_path, capsys):
    from dsv41_jax.cli.main import main

    assert main(["convert", "--from", "orbax", str(tiny_ckpt), "--to", "hf", str(tmp_path / "x")]) == 2
    assert "is an hf checkpoint, not orbax" in capsys.readouterr().err
    assert main(["convert", "--from", "safetensors", str(tiny_ckpt), "--to", "hf", str(tmp_path / "x")]) == 2
    assert "format must be one of" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert main(["convert", "--from", "hf", str(tiny_ckpt), "--to", "orbax", str(tmp_path / "full")]) == 2
    assert "--force" in capsys.readouterr().err


def test_writer_narrowing_policies(tiny_params):
    params = dict(tiny_params)
    path = ("layers", 2, "attn", "wo_a", "weight")
    params[path] = (params[path].astype(np.float32) * np.float32(1 + 2 ** -7)).astype(ml_dtypes.bfloat16)  # not FP8-exact
    model = model_from_params(TINY, params)
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.wo_a\.weight.*narrow='auto'"):
        model_entries(model, narrow="strict")
    kinds = {e.name: e.dtype for e in model_entries(model, narrow="auto")}
    assert kinds["layers.2.attn.wo_a.weight"] == "BF16" and "layers.2.attn.wo_a.scale" not in kinds
    assert kinds["layers.1.attn.wo_a.weight"] == "F8_E4M3"
    assert {e.name: e.dtype for e in model_entries(model, narrow="round")}["layers.2.attn.wo_a.weight"] == "F8_E4M3"


# ------------------------------------------------------------------------------ placement
def test_sharded_load_reads_blocks_for_each_device(tiny_ckpt, tiny_params, monkeypatch):
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = placement.data_mesh(8)
    monkeypatch.setattr(safetensors_file, "CHUNK_BYTES", 4096)  # force chunked column-slice reads

    def rules(path, shape, dtype):
        if len(shape) >= 2 and shape[-1] % 8 == 0 and path[-1] in ("fn", "embed"):
            return NamedSharding(mesh, P(*([None] * (len(shape) - 1)), "data"))  # split the last axis
        if shape and shape[0] % 8 == 0:
            return NamedSharding(mesh, P("data"))  # split rows (experts for stacked tensors)
        return NamedSharding(mesh, P())

    _, model, _ = load_checkpoint(tiny_ckpt, shardings=rules, progress=False)
    assert_params_bit_equal(tiny_params, model)
    flat = flat_params(model)
    experts = flat[("layers", 1, "ffn", "experts", "w1")].get_value()
    assert experts.sharding.spec == P("data") and len(experts.sharding.device_set) == 8
    assert experts.addressable_shards[0].data.shape[0] == TINY.n_routed_experts // 8
    fn = flat[("layers", 1, "hc_attn", "fn")].get_value()
    assert fn.addressable_shards[0].data.shape[-1] == fn.shape[-1] // 8
    sink = flat[("layers", 0, "attn", "attn_sink")].get_value()
    assert sink.sharding.is_fully_replicated and len(sink.sharding.device_set) == 8


def test_large_blocks_stream_in_chunks_on_one_device(tiny_ckpt, tiny_params, monkeypatch):
    monkeypatch.setattr(placement, "CHUNK_BYTES", 100_000)  # embed, head and the Engram tables exceed it
    calls = []
    real = placement._streamed
    monkeypatch.setattr(placement, "_streamed", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    _, model, _ = load_checkpoint(tiny_ckpt, progress=False)
    assert_params_bit_equal(tiny_params, model)
    assert len(calls) >= 3


# ------------------------------------------------------------------------------ hand-decoded blocks
def e4m3_value(b: int) -> float:
    """E4M3FN from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; exponent 0 is subnormal."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_value(nibble: int) -> float:
    return (-1.0 if nibble & 0x8 else 1.0) * E2M1[nibble & 0x7]


def test_loader_decodes_hand_made_fp8_and_fp4_blocks(tiny_params, tmp_path):
    import jax.numpy as jnp

    rng = np.random.default_rng(7)
    model = model_from_params(TINY, tiny_params)
    n, k = TINY.q_lora_rank, TINY.dim
    fp8 = rng.integers(0, 256, (n, k), dtype=np.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x38  # no NaN codes
    fp8[0, :4] = [0x01, 0x08, 0x38, 0xC4]  # smallest subnormal, smallest normal, 1.0, -3.0
    fp8_scale = rng.integers(118, 134, (n // 32, k // 32), dtype=np.uint8)
    f, d = TINY.moe_inter_dim, TINY.dim
    fp4 = rng.integers(0, 256, (f, d // 2), dtype=np.uint8)
    fp4[0, 0] = 0x9A  # low nibble 0xA = -1.0 (element 0), high nibble 0x9 = -0.5 (element 1)
    fp4_scale = rng.integers(120, 132, (f, d // 32), dtype=np.uint8)
    wo_shape = (TINY.o_groups * TINY.o_lora_rank, TINY.n_heads * TINY.head_dim // TINY.o_groups)
    wo = rng.integers(0, 256, wo_shape, dtype=np.uint8)
    wo[(wo & 0x7F) == 0x7F] = 0x40
    wo_scale = rng.integers(120, 134, (-(-wo_shape[0] // 32), -(-wo_shape[1] // 32)), dtype=np.uint8)
    hand = {"layers.2.attn.wq_a.weight": ("F8_E4M3", fp8), "layers.2.attn.wq_a.scale": ("F8_E8M0", fp8_scale),
            "layers.2.ffn.experts.3.w1.weight": ("I8", fp4), "layers.2.ffn.experts.3.w1.scale": ("F8_E8M0", fp4_scale),
            "layers.2.attn.wo_a.weight": ("F8_E4M3", wo), "layers.2.attn.wo_a.scale": ("F8_E8M0", wo_scale)}
    entries = [TensorEntry(e.name, *hand[e.name][:1], e.shape, (lambda b=hand[e.name][1]: b)) if e.name in hand else e
               for e in model_entries(model)]
    write_hf_folder(tmp_path, TINY, entries, max_shard_bytes=1 << 20)
    _, loaded, _ = load_checkpoint(tmp_path, progress=False)

    # independent float64 decoding: value = code * 2^(scale byte - 127)
    want_fp8 = np.vectorize(e4m3_value)(fp8) * np.exp2(np.repeat(np.repeat(fp8_scale.astype(np.float64) - 127, 32, 0), 32, 1))
    got_fp8 = np.asarray(loaded.layers[2].attn.wq_a.dequantized(), np.float64)
    assert np.array_equal(got_fp8, want_fp8)
    assert list(got_fp8[0, :4] / np.exp2(fp8_scale[0, 0] - 127.0)) == [2.0 ** -9, 2.0 ** -6, 1.0, -3.0]

    codes = np.stack([fp4 & 0xF, fp4 >> 4], axis=-1).reshape(f, d)  # low nibble = even element
    want_fp4 = np.vectorize(e2m1_value)(codes) * np.exp2(np.repeat(fp4_scale.astype(np.float64) - 127, 32, 1))
    got_fp4 = np.asarray(loaded.layers[2].ffn.experts.dense_weights()[0][3].astype(jnp.float32), np.float64)
    assert np.array_equal(got_fp4, want_fp4)
    assert got_fp4[0, 0] == -1.0 * 2.0 ** (fp4_scale[0, 0] - 127.0) and got_fp4[0, 1] == -0.5 * 2.0 ** (fp4_scale[0, 0] - 127.0)

    want_wo = np.vectorize(e4m3_value)(wo) * np.exp2(np.repeat(np.repeat(wo_scale.astype(np.float64) - 127, 32, 0), 32, 1)[
        : wo_shape[0], : wo_shape[1]])
    got_wo = loaded.layers[2].attn.wo_a.weight.get_value()
    assert got_wo.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got_wo, np.float64), want_wo)  # E4M3 x 2^k is exact in bf16


# ------------------------------------------------------------------------------ census
def test_full_size_census_matches_the_release():
    from dsv41_jax.model.info import abstract_model

    tensors = disk_tensors(abstract_model(ModelConfig.v41_flash()))
    check_name_mapping(tensors)  # param_names.our_path maps every listed name back to its parameter
    families = Counter(re.sub(r"\.\d+\.", ".*.", t.name) for t in tensors)
    assert families["layers.*.attn.compressor.wkv.weight"] == 4
    assert families["layers.*.attn.compressor.wgate.weight"] == 3
    assert families["layers.*.attn.indexer.wq_b.weight"] == 8
    assert families["layers.*.attn.indexer.wk.weight"] == 4
    assert families["layers.*.engram.embed.weight"] == 2
    per_layer = Counter(t.name.split(".")[1] for t in tensors if re.fullmatch(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight", t.name))
    assert len(per_layer) == 40 and set(per_layer.values()) == {384 * 3}
    by_name = {t.name: t for t in tensors}

    def spec(name):
        return by_name[name].dtype, by_name[name].shape

    assert spec("layers.7.ffn.experts.100.w1.weight") == ("I8", (2304, 2560))  # docs/REFERENCE.md §9
    assert spec("layers.7.ffn.experts.100.w2.weight") == ("I8", (5120, 1152))
    assert spec("layers.7.ffn.experts.100.w1.scale") == ("F8_E8M0", (2304, 5120 // 32))
    assert spec("layers.7.attn.wq_a.weight") == ("F8_E4M3", (1280, 5120))
    assert spec("layers.7.attn.wq_a.scale") == ("F8_E8M0", (40, 160))
    assert spec("layers.7.attn.wo_a.weight")[0] == "F8_E4M3" and "layers.7.attn.wo_a.scale" in by_name
    assert spec("layers.14.engram.embed.weight") == ("F8_E4M3", (384016682, 256))
    assert spec("layers.14.engram.embed.scale") == ("F8_E8M0", (384016682, 8))
    assert spec("layers.2.attn.compressor.wgate.weight")[0] == "BF16"
    assert spec("layers.2.attn.attn_sink")[0] == "F32" and spec("layers.2.hc_ffn_base")[0] == "F32"
    assert spec("head.weight") == ("BF16", (129280, 5120))
    # the VL part (docs/VISION.md): 32 ViT blocks, aligner, delimiters, one bias_vl per layer
    assert families["layers.*.ffn.gate.bias_vl"] == 40 and spec("layers.3.ffn.gate.bias_vl") == ("F32", (384,))
    assert families["vision.blocks.*.attn.wqkv.weight"] == 32 and families["vision.blocks.*.mlp.w2.weight"] == 32
    assert spec("vision.blocks.31.attn.wqkv.weight") == ("BF16", (3072, 1024))
    assert spec("vision.blocks.0.attn.wqkv.bias") == ("BF16", (3072,))
    assert spec("vision.blocks.0.mlp.w1.weight") == ("BF16", (5632, 1024)) and "vision.blocks.0.mlp.w1.bias" not in by_name
    assert spec("vision.blocks.0.norm1.weight") == ("F32", (1024,)) and spec("vision.norm.weight") == ("F32", (1024,))
    assert spec("vision.patch_embed.proj.weight") == ("BF16", (1024, 3 * 14 * 14))
    assert spec("aligner.w1.weight") == ("BF16", (5120, 9 * 1024)) and spec("aligner.w2.bias") == ("BF16", (5120,))
    assert all(spec(n) == ("BF16", (5120,)) for n in ("image_start", "image_end", "image_newline"))
    vl = [t for t in tensors if t.name.startswith(("vision.", "aligner.", "image_"))]
    assert len(vl) == 3 + 4 + 3 + 32 * 8


# ------------------------------------------------------------------------------ errors
def _patched(src: pathlib.Path, dst: pathlib.Path, *, add=(), drop=(), config=None) -> pathlib.Path:
    """A copy of a checkpoint with tensors dropped from the index and others added in an extra shard."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_FILE).read_text())
    for name in drop:
        del index["weight_map"][name]
    if add:
        write_file(dst / "model-extra.safetensors", list(add))
        index["weight_map"].update({e.name: "model-extra.safetensors" for e in add})
    (dst / INDEX_FILE).write_text(json.dumps(index))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _entry(name, dtype, shape):
    return TensorEntry(name, dtype, shape, lambda: np.zeros(shape, safetensors_file.DTYPES[dtype]))


def test_bad_tensors_fail_with_their_names(tiny_ckpt, tmp_path):
    cases = {
        "missing": dict(drop=["layers.3.attn.indexer.wq_b.scale"]),
        "unexpected": dict(add=[_entry("layers.3.attn.extra_proj.weight", "BF16", (4, 4))]),
        "shape": dict(add=[_entry("layers.4.attn.attn_sink", "F32", (TINY.n_heads + 1,))]),
        "dtype": dict(add=[_entry("layers.4.attn.wq_b.weight", "BF16", (TINY.n_heads * TINY.head_dim, TINY.q_lora_rank))]),
    }
    expect = {"missing": r"1 missing tensors: \['layers\.3\.attn\.indexer\.wq_b\.scale'\]",
              "unexpected": r"unexpected tensors: \['layers\.3\.attn\.extra_proj\.weight'\]",
              "shape": r"layers\.4\.attn\.attn_sink: shape \[5\], expected \[4\]",
              "dtype": r"layers\.4\.attn\.wq_b\.weight: dtype BF16 on disk, expected F8_E4M3"}
    for kind, patch in cases.items():
        with pytest.raises(WeightError, match=expect[kind]):
            load_checkpoint(_patched(tiny_ckpt, tmp_path / kind, **patch), progress=False)


def test_v4_checkpoints_are_refused(tiny_ckpt, tmp_path):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    v4 = dict(cfg, model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])
    v4["text_config"] = dict(cfg["text_config"], model_type="deepseek_v4")
    with pytest.raises(ConfigError, match=r"config\.json: model_type 'deepseek_v4' is not supported.*V4 checkpoints have per-layer"):
        load_checkpoint(_patched(tiny_ckpt, tmp_path / "v4cfg", config=v4), progress=False)
    # a V4-style census under a V4.1 config: compressors on layers that are not KV sources
    per_layer = [_entry(f"layers.{l}.attn.compressor.wkv.weight", "BF16", (TINY.head_dim, TINY.dim)) for l in (2, 3)]
    with pytest.raises(WeightError, match=r"Layers \[2, 3\] carry their own compressor.*DeepSeek-V4"):
        load_checkpoint(_patched(tiny_ckpt, tmp_path / "v4census", add=per_layer), progress=False)


def test_broken_folders_fail_clearly(tiny_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", progress=False)
    broken = _patched(tiny_ckpt, tmp_path / "noshard")
    first = sorted(broken.glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(CheckpointError, match=f"shard files that are not in .*{first.name}"):
        load_checkpoint(broken, progress=False)
    truncated = _patched(tiny_ckpt, tmp_path / "truncated")
    last = sorted(truncated.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-10])
    with pytest.raises(SafetensorsError, match=f"{last.name}: tensor .* past the end of the file"):
        load_checkpoint(truncated, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_ckpt / "config.json", empty)
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_checkpoint(empty, progress=False)


# ------------------------------------------------------------------------------ golden weights
def _golden_as_hf(golden_root: pathlib.Path, out: pathlib.Path):
    """The golden main_fp8 weights (reference names, raw U8 bytes) written as a release-format folder.

    The golden `wo_a` is plain bf16 (not FP8-derived), so it stays BF16, the form convert.py
    leaves; the FP8 `wo_a` path is covered by the hand-made bytes test."""
    from safetensors import safe_open

    from dsv41_jax.golden.data import discover

    gc = next(g for g in discover(golden_root) if g.name == "main_fp8")
    logical = gc.raw["tensors"]
    disk = {"F8_E4M3FN": "F8_E4M3", "F8_E8M0FNU": "F8_E8M0", "F4_E2M1FN_X2": "I8"}
    entries = []
    with safe_open(str(gc.weights_path), "flax") as f:
        for name in f.keys():
            arr = np.asarray(f.get_tensor(name))
            dt = disk.get(logical[name]["dtype"], logical[name]["dtype"])
            entries.append(TensorEntry(name, dt, tuple(arr.shape), lambda a=arr: a))
    write_hf_folder(out, gc.cfg, entries, max_shard_bytes=1 << 20)
    return gc


def test_golden_weights_through_the_hf_path_equal_the_reference_path(golden_root, tmp_path):
    gc = _golden_as_hf(golden_root, tmp_path)
    cfg, model, report = load_checkpoint(tmp_path, progress=False,
                                         config_overrides={"max_seq_len": gc.cfg.max_seq_len, "max_batch_size": gc.cfg.max_batch_size})
    assert cfg == gc.cfg and report.dequantized == [] and report.skipped == []
    want = {p: np.asarray(v.get_value()) for p, v in flat_params(gc.load_model()).items()}
    assert_params_bit_equal(want, model)


@pytest.mark.slow
def test_golden_logits_through_the_hf_path_equal_the_reference_path(golden_root, tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.model.transformer import init_cache, make_step
    from dsv41_jax.runtime import Runtime

    gc = _golden_as_hf(golden_root, tmp_path)
    cfg, hf_model, _ = load_checkpoint(tmp_path, progress=False,
                                       config_overrides={"max_seq_len": gc.cfg.max_seq_len, "max_batch_size": 1})
    graphdef, ref_params = nnx.split(gc.load_model())
    _, hf_params = nnx.split(hf_model)
    step = make_step(graphdef, Runtime(mode="fast"))
    tokens = jnp.asarray([gc.cases[0]["tokens"][:12]], jnp.int32)
    ref = np.asarray(step(ref_params, tokens, init_cache(cfg, 1))[0])
    got = np.asarray(step(hf_params, tokens, init_cache(cfg, 1))[0])
    assert np.isfinite(ref).all()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


# ------------------------------------------------------------------------------ host memory
RSS_PROBE = textwrap.dedent("""
    import json, resource, sys
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    import jax
    jax.devices()
    after_jax = rss()
    from dsv41_jax.checkpoint.hf_loader import load_checkpoint
    base = rss()
    cfg, model, report = load_checkpoint(sys.argv[1], progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"after_jax": after_jax, "base": base, "peak": peak, "loaded": report.bytes_read}))
""")
# Linux carries the parent's resident-set high-water mark into a child's ru_maxrss at exec
# (the forked copy of the parent's memory counts), so a probe started straight from a large
# pytest process would report pytest's peak. A small launcher in between resets it.
RSS_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]]).returncode)"


@pytest.mark.slow
def test_peak_rss_stays_below_twice_the_largest_shard(tmp_path):
    rows = 6_600_000  # one Engram table of 211 MB, alone in its shard, as in the release
    cfg = ModelConfig.tiny(n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                           candidate_source_layer=-1, engram_layer_ids=(0,), engram_num_embeddings=(rows,))
    write_hf_folder(tmp_path, cfg, random_entries(cfg, seed=3), max_shard_bytes=64 << 20)
    largest = max(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert largest >= 200e6
    import os

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", RSS_LAUNCHER, RSS_PROBE, str(tmp_path)], capture_output=True, text=True, env=env,
                         check=True, cwd=pathlib.Path(__file__).resolve().parents[2])
    m = json.loads(out.stdout.strip().splitlines()[-1])
    above = m["peak"] - m["base"]
    print(f"largest shard {largest / 2**20:.1f} MiB, loaded {m['loaded'] / 2**20:.1f} MiB, "
          f"peak RSS above the JAX+package baseline {above / 2**20:.1f} MiB "
          f"({above / largest:.2f} x largest shard; above bare jax {(m['peak'] - m['after_jax']) / 2**20:.1f} MiB)")
    assert above < 2 * largest
