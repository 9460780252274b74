"""Checkpoint files under hostile conditions: a strict safetensors reader checked
against the `safetensors` library, writers that never delete what they did not write and
never leave half a checkpoint (real processes killed mid-write), one rule for what an HF
folder holds, and NaN/inf weights refused at load time by name."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dsv41_jax.checkpoint import CheckpointError, load
from dsv41_jax.checkpoint.atomic import KILL_AFTER_ENV
from dsv41_jax.checkpoint.hf_loader import INDEX_FILE, load_checkpoint, read_config
from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint, write_hf_folder
from dsv41_jax.checkpoint.orbax_io import save_params
from dsv41_jax.checkpoint.safetensors_file import SafetensorsError, SafetensorsFile, read_header
from dsv41_jax.checkpoint.synthetic import fake_extra_entries, model_from_params, random_params
from dsv41_jax.checkpoint.weights import WeightError
from dsv41_jax.model.param_names import flat_params
from dsv41_jax.cli.main import main

from tests.support.train_fixtures import micro_config

MICRO = micro_config(32)
REPO = pathlib.Path(__file__).resolve().parents[2]
SHARD = 64 << 10  # small shards: a micro checkpoint spans several files


def _same(model, params: dict) -> bool:
    got = flat_params(model)
    return set(got) == set(params) and all(
        np.array_equal(np.asarray(got[p].get_value()).reshape(-1).view(np.uint8), np.asarray(v).reshape(-1).view(np.uint8))
        for p, v in params.items())


def _write(folder, params, *, extra=True, shard=SHARD):
    save_hf_checkpoint(model_from_params(MICRO, params), folder, extra=fake_extra_entries(MICRO) if extra else (),
                       max_shard_bytes=shard, overwrite=True)
    return pathlib.Path(folder)


@pytest.fixture(scope="module")
def params_a():
    return random_params(MICRO, seed=1)


@pytest.fixture(scope="module")
def params_b():
    return random_params(MICRO, seed=2)


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory, params_a):
    return _write(tmp_path_factory.mktemp("a") / "ckpt", params_a)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory, params_b):
    return _write(tmp_path_factory.mktemp("b") / "ckpt", params_b, shard=1 << 30)  # one shard


def _copy(src, dst) -> pathlib.Path:
    shutil.copytree(src, dst)
    return pathlib.Path(dst)


# ----------------------------------------------------------------------- the strict reader
def _file(header=None, data=b"", raw=None) -> bytes:
    hb = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + data


def _f32(b, e, shape=(2,)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [b, e]}


READER_CASES = {  # name -> (file bytes, a fragment our error must contain, or None when valid)
    "valid": (_file({"a": _f32(0, 8), "b": _f32(8, 16)}, bytes(16)), None),
    "valid, metadata and a scalar": (_file({"__metadata__": {"format": "pt"}, "s": _f32(0, 4, ())}, bytes(4)), None),
    "valid, zero-size tensor": (_file({"z": _f32(0, 0, (0,)), "a": _f32(0, 8)}, bytes(8)), None),
    "valid, F8_E8M0": (_file({"s": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)), None),
    "valid, unknown extra field": (_file({"a": {**_f32(0, 8), "note": 1}}, bytes(8)), None),
    "valid, null metadata": (_file({"__metadata__": None, "a": _f32(0, 8)}, bytes(8)), None),
    "valid, sub-byte F4": (_file({"q": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, bytes(2)), None),
    "overlapping offsets": (_file({"a": _f32(0, 8), "b": _f32(0, 8)}, bytes(8)), "overlaps the tensor before it"),
    "gap between tensors": (_file({"a": _f32(0, 8), "b": _f32(12, 20)}, bytes(20)), "leaves a gap"),
    "negative offset (reads the header)": (_file({"a": _f32(-8, 0)}, bytes(8)), "two non-negative integers"),
    "end before begin": (_file({"a": _f32(8, 0)}, bytes(8)), "ends before it begins"),
    "no dtype": (_file({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "has no dtype"),
    "no shape": (_file({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8)), "has no shape"),
    "no data_offsets": (_file({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)), "has no data_offsets"),
    "unknown dtype": (_file({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "not a safetensors dtype"),
    "negative dimension": (_file({"a": _f32(0, 8, (-2,))}, bytes(8)), "list of non-negative integers"),
    "float dimension": (_file({"a": _f32(0, 8, (2.0,))}, bytes(8)), "list of non-negative integers"),
    "bool dimension": (_file({"a": _f32(0, 4, (True,))}, bytes(4)), "list of non-negative integers"),
    "three offsets": (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, bytes(8)), "two non-negative"),
    "size does not match shape": (_file({"a": _f32(0, 4)}, bytes(4)), "needs 8"),
    "trailing bytes": (_file({"a": _f32(0, 8)}, bytes(16)), "cover 8 of the 16 data bytes"),
    "truncated data": (_file({"a": _f32(0, 8)}, bytes(4)), "past the end of the file"),
    "entry not an object": (_file({"a": 5}, bytes(8)), "not an object"),
    "header a list": (_file(raw=b"[]"), "not an object"),
    "metadata not strings": (_file({"__metadata__": {"k": 1}, "a": _f32(0, 8)}, bytes(8)), "__metadata__"),
    "header not UTF-8": (_file(raw=b'{"\xff": 1}'), "not UTF-8"),
    "header not JSON": (_file(raw=b'{"a": '), "not JSON"),
    "header longer than the file": (struct.pack("<Q", 100) + b"{}", "does not fit the file"),
    "shorter than 8 bytes": (b"abc", "too short"),
}


@pytest.mark.parametrize("case", list(READER_CASES))
def test_reader_accepts_exactly_what_the_safetensors_library_accepts(case, tmp_path):
    from safetensors import safe_open

    blob, message = READER_CASES[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    try:
        with safe_open(str(path), "numpy"):
            library_ok = True
    except Exception:  # the library raises SafetensorError (and others) for invalid files
        library_ok = False
    try:
        read_header(path)
        ours_ok, error = True, ""
    except SafetensorsError as e:
        ours_ok, error = False, str(e)
    assert ours_ok == library_ok == (message is None), (case, error)
    if message is not None:
        assert message in error and str(path) in error, error


def test_reader_reads_valid_files_and_names_what_it_cannot_hold(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(_file({"a": _f32(0, 8), "q": {"dtype": "F4", "shape": [4], "data_offsets": [8, 10]}},
                           np.array([1.5, -2.0], np.float32).tobytes() + bytes(2)))
    with SafetensorsFile(path) as f:
        assert f.read("a").tolist() == [1.5, -2.0]
        with pytest.raises(SafetensorsError, match="F4, a valid safetensors dtype that this reader cannot hold"):
            f.read("q")
        with pytest.raises(SafetensorsError, match="no tensor named 'zz'"):
            f.read("zz")
    with pytest.raises(SafetensorsError, match="is a folder"):
        read_header(tmp_path)


def test_init_from_reads_this_packages_exports(ckpt_a, params_a):
    """`dsv41 train --init-from` (`masters_from_checkpoint` -> `load_exported`) goes through the one
    HF loader, which reads F8_E8M0 scales; its old private reader did not."""
    from dsv41_jax.train.export import load_exported

    assert any(i.dtype == "F8_E8M0" for f in ckpt_a.glob("*.safetensors") for i in read_header(f)[0].values())
    assert _same(load_exported(ckpt_a, MICRO)[1], params_a)


# ------------------------------------------------------------- what a folder holds, --force
def test_one_rule_for_what_an_hf_folder_holds(ckpt_a, ckpt_b, tmp_path):
    """The probe: an export written as model.safetensors next to old shards and their index was
    served from the old shards by one reader and merged by the other. Now both refuse it."""
    from dsv41_jax.train.export import load_exported

    mixed = _copy(ckpt_a, tmp_path / "mixed")
    shutil.copy(ckpt_b / "model-00001-of-00001.safetensors", mixed / "model.safetensors")
    for loader in (lambda: load_checkpoint(mixed, progress=False), lambda: load_exported(mixed, MICRO)):
        with pytest.raises(CheckpointError, match=r"does not list: \['model.safetensors'\]"):
            loader()
    single = _copy(ckpt_b, tmp_path / "single")
    (single / INDEX_FILE).unlink()
    (single / "model-00001-of-00001.safetensors").rename(single / "model.safetensors")
    load_checkpoint(single, progress=False)  # the single-file layout is one checkpoint
    shutil.copy(next(ckpt_a.glob("model-*.safetensors")), single / "model-00002-of-00009.safetensors")
    with pytest.raises(CheckpointError, match="other .safetensors files .*model-00002-of-00009.* but no"):
        load_checkpoint(single, progress=False)


def test_export_refuses_a_non_empty_folder_before_training(ckpt_a, tmp_path, capsys):
    from dsv41_jax.train.export import export_checkpoint

    with pytest.raises(FileExistsError, match="exists and is not empty; pass --force"):
        export_checkpoint(ckpt_a, MICRO, master=None, formats=None)
    data = tmp_path / "data.txt"
    data.write_text("hello\n" * 50)
    # refused before the config is read or a step compiled
    assert main(["train", "--config", "no-such-preset", "--data", str(data), "--export", str(ckpt_a)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty; pass --force" in err and "Traceback" not in err


def test_convert_never_deletes_what_it_did_not_write(ckpt_a, params_a, tmp_path, capsys):
    """The probe: `convert parent/src -> parent --force` deleted parent/src and an unrelated file."""
    parent = tmp_path / "parent"
    src = _copy(ckpt_a, parent / "src")
    (parent / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cases = [(parent, "contains the source"), (src / "sub", "lies inside the source"), (src, "is the source")]
    for dst, message in cases:
        assert main(["convert", "--from", "hf", str(src), "--to", "hf", str(dst), "--force", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "thesis.tex").write_text("years of work")
    assert main(["convert", "--from", "hf", str(src), "--to", "orbax", str(other), "--force", "--quiet"]) == 2
    assert "not part of a checkpoint (['thesis.tex'])" in capsys.readouterr().err
    assert (other / "thesis.tex").read_text() == "years of work"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "other" not in p.parts) == before
    assert (parent / "notes.txt").read_text() == "mine" and _same(load(src, progress=False)[1], params_a)


def test_convert_force_replaces_a_checkpoint_and_keeps_unmodelled_tensors(ckpt_a, ckpt_b, params_b, tmp_path, capsys):
    dst = _copy(ckpt_a, tmp_path / "dst")  # 64 KiB shards; the new one is a single shard (convert's 5GB default)
    assert main(["convert", "--from", "hf", str(ckpt_b), "--to", "hf", str(dst), "--force", "--quiet"]) == 0
    assert "including 6 copied unchanged" in capsys.readouterr().err
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert not list(tmp_path.glob(".dst.*"))  # no temporary sibling left behind
    _, model, report = load(dst, progress=False)
    assert _same(model, params_b) and len(report.skipped) == 6
    wm_src = json.loads((ckpt_b / INDEX_FILE).read_text())["weight_map"]
    for e in fake_extra_entries(MICRO):  # mtp.*, vision.*, aligner.*: the same bytes as the source's
        with SafetensorsFile(ckpt_b / wm_src[e.name]) as a, SafetensorsFile(dst / "model-00001-of-00001.safetensors") as b:
            assert np.array_equal(a.read(e.name).view(np.uint8), b.read(e.name).view(np.uint8)), e.name
    assert read_config(dst).max_seq_len == MICRO.max_seq_len
    assert main(["convert", "--from", "hf", str(ckpt_b), "--to", "orbax", str(tmp_path / "o"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "6 tensors it does not model (aligner.*, layers.*, mtp.*, vision.*) are NOT written" in err


def test_max_shard_size_zero_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--from", "hf", "a", "--to", "hf", "b", "--max-shard-size", "0"])
    assert e.value.code == 2 and "--max-shard-size: '0' is not a positive size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_shard_bytes must be positive"):
        write_hf_folder("unused", MICRO, [], max_shard_bytes=0)


def test_hf_writer_keeps_max_seq_len(tmp_path):
    write_hf_folder(tmp_path / "x", MICRO.replace(max_seq_len=64), [])
    assert read_config(tmp_path / "x").max_seq_len == 64


def test_prefix_cache_path_that_is_a_folder_is_reported_as_a_folder(tmp_path):
    from dsv41_jax.serving.prefix_cache import PrefixCacheError, load_prefix

    with pytest.raises(PrefixCacheError, match="is a folder"):
        load_prefix(tmp_path, MICRO, fingerprint="0" * 64)


# ---------------------------------------------------------------------- NaN / inf weights
def _poison(src, dst, name: str, edit) -> pathlib.Path:
    """A copy of an HF checkpoint with the bytes of tensor `name` changed in place by edit(uint8 view)."""
    dst = _copy(src, dst)
    shard = dst / json.loads((dst / INDEX_FILE).read_text())["weight_map"][name]
    info = read_header(shard)[0][name]
    raw = bytearray(shard.read_bytes())
    view = np.frombuffer(raw, np.uint8)[info.begin:info.end].copy()
    edit(view)
    raw[info.begin:info.end] = view.tobytes()
    shard.write_bytes(bytes(raw))
    return dst


def _names_of(ckpt, dtype):
    return [n for f in sorted(ckpt.glob("*.safetensors")) for n, i in read_header(f)[0].items()
            if i.dtype == dtype and not n.startswith(("mtp.", "vision.", "aligner."))]


def test_nan_weights_are_refused_at_load_by_name(ckpt_a, params_a, tmp_path):
    """The probe: an all-NaN FP8 weight loaded silently (and gave finite logits)."""
    fp8 = _names_of(ckpt_a, "F8_E4M3")[0]

    def all_nan(v):
        v[:] = 0x7F

    bad = _poison(ckpt_a, tmp_path / "bad", fp8, all_nan)
    with pytest.raises(WeightError, match=rf"{fp8}: (\d+) of \1 FP8 E4M3 values are NaN \(all of them\).*--no-value-check"):
        load(bad, progress=False)
    load(bad, progress=False, check_values=False)  # the documented way to skip the pass
    params = dict(params_a)
    params[("norm", "weight")] = np.full_like(params[("norm", "weight")], np.inf)
    save_params(tmp_path / "orbax", model_from_params(MICRO, params), MICRO)
    with pytest.raises(WeightError, match="norm.weight: .*inf"):
        load(tmp_path / "orbax")


def test_value_check_names_what_it_found():
    """The loader applies `check_values` to every tensor it reads, in its disk dtype."""
    import ml_dtypes

    from dsv41_jax.checkpoint.values import check_values

    scales = np.full(8, 127, np.uint8)
    scales[5] = 0xFF
    bf16 = np.ones(6, ml_dtypes.bfloat16)
    bf16[[1, 2]] = np.nan
    bf16[4] = -np.inf
    fp8 = np.ones(4, ml_dtypes.float8_e4m3fn)
    fp8[0] = np.nan
    cases = [("a.scale", "F8_E8M0", scales, "a.scale: 1 of 8 E8M0 scale bytes are 0xFF"),
             ("b.weight", "BF16", bf16, "b.weight: 2 NaN and 1 inf among 6 BF16 values"),
             ("c.weight", "F8_E4M3", fp8, r"c.weight: 1 of 4 FP8 E4M3 values are NaN;"),
             ("d", "F32", np.array([np.inf], np.float32), "d: 1 inf among 1 F32 values")]
    for name, dtype, arr, message in cases:
        with pytest.raises(WeightError, match=message):
            check_values(name, dtype, arr)
    for name, dtype, arr in [("e.scale", "F8_E8M0", np.full(4, 254, np.uint8)), ("f", "I8", np.full(4, -1, np.int8)),
                             ("g", "BF16", np.ones(3, ml_dtypes.bfloat16)), ("h", "F8_E4M3", np.ones(2, ml_dtypes.float8_e4m3fn))]:
        check_values(name, dtype, arr)  # finite (and packed E2M1 bytes are always finite)


# --------------------------------------------------------------- killed mid-write (processes)
def _killed(args: list[str], kill_after: int, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, KILL_AFTER_ENV: str(kill_after), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _check_killed(proc, dest: pathlib.Path, params_old: dict) -> None:
    """The process died by SIGKILL mid-write: its temporary sibling holds a partial checkpoint,
    and the destination is the old checkpoint, intact and loadable."""
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])
    tmp = [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.tmp-")]
    assert len(tmp) == 1 and (tmp[0] / "config.json").is_file() and list(tmp[0].glob("*.safetensors*")), tmp
    assert not (tmp[0] / INDEX_FILE).exists()  # it stopped before the end
    assert _same(load(dest, progress=False)[1], params_old)


def _total_bytes(folder) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(folder).iterdir() if p.is_file())


def test_killed_convert_leaves_the_old_checkpoint(ckpt_a, ckpt_b, params_a, params_b, tmp_path):
    dest = _copy(ckpt_a, tmp_path / "dest")
    args = ["convert", "--from", "hf", str(ckpt_b), "--to", "hf", str(dest), "--force", "--quiet",
            "--max-shard-size", str(SHARD)]
    _check_killed(_killed(["-m", "dsv41_jax.cli", *args], _total_bytes(ckpt_b) // 2, tmp_path), dest, params_a)
    assert main(args) == 0  # the next write succeeds and removes the dead writer's temporary folder
    assert _same(load(dest, progress=False)[1], params_b)
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_killed_hf_writer_leaves_the_old_checkpoint(ckpt_a, params_a, tmp_path):
    dest = _copy(ckpt_a, tmp_path / "dest")
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from tests.support.train_fixtures import micro_config
        from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint
        from dsv41_jax.checkpoint.synthetic import model_from_params, random_params
        cfg = micro_config(32)
        save_hf_checkpoint(model_from_params(cfg, random_params(cfg, seed=2)), {str(dest)!r}, overwrite=True,
                           max_shard_bytes={SHARD})
    """)
    _check_killed(_killed(["-c", script], _total_bytes(ckpt_a) // 2, tmp_path), dest, params_a)


@pytest.mark.slow
def test_killed_export_leaves_the_old_checkpoint(ckpt_a, params_a, tmp_path):
    dest = _copy(ckpt_a, tmp_path / "dest")
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from tests.support.train_fixtures import micro_config
        from dsv41_jax.train.export import export_checkpoint
        from dsv41_jax.train.params import serving_formats
        from dsv41_jax.train.qat_modules import build_training_model
        cfg = micro_config(32)
        formats = serving_formats(cfg)
        _, master = build_training_model(cfg, formats, seed=5)
        export_checkpoint({str(dest)!r}, cfg, master, formats, overwrite=True)
    """)
    _check_killed(_killed(["-c", script], _total_bytes(ckpt_a) // 3, tmp_path), dest, params_a)
    proc = _killed(["-c", script], 1 << 40, tmp_path)  # a limit never reached: the export completes
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not _same(load(dest, progress=False)[1], params_a)


@pytest.mark.slow
def test_training_killed_mid_save_resumes_with_identical_losses(tmp_path):
    """The probe made a test: SIGKILL while orbax writes a step; the resumed run continues from
    the last complete step, and its logged losses equal an uninterrupted run's."""
    import re
    import signal
    import time

    (tmp_path / "config.json").write_text(json.dumps(MICRO.to_flat_dict()))
    corpus = tmp_path / "data.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(80)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cmd(ckpt, steps):
        return [sys.executable, "-m", "dsv41_jax.cli", "train", "--config", str(tmp_path / "config.json"), "--data",
                str(corpus), "--batch-size", "4", "--ckpt-dir", str(ckpt), "--save-every", "1", "--steps", str(steps),
                "--no-progress", "--log-every", "1", "--mesh", "data=2"]

    def losses(stderr: str) -> dict[int, str]:  # step -> the logged line without the timing figures
        return {int(m.group(1)): m.group(2) for m in re.finditer(r"step\s+(\d+)\s+(loss .*?)\s+lr", stderr)}

    full = subprocess.run(cmd(tmp_path / "full", 8), env=env, capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-3000:]
    ck = tmp_path / "killed"
    proc = subprocess.Popen(cmd(ck, 8), env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    caught = False
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        if ck.is_dir() and any("tmp" in p.name for p in ck.iterdir()) and any(p.name.isdigit() for p in ck.iterdir()):
            os.kill(proc.pid, signal.SIGKILL)  # a step is being written and an earlier one is complete
            caught = True
            break
        time.sleep(0.001)
    proc.wait()
    stderr_killed = proc.stderr.read()
    assert caught and proc.returncode == -9, stderr_killed[-3000:]
    steps_done = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    resumed = subprocess.run(cmd(ck, 8), env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(re.search(r"starting at step (\d+)", resumed.stderr).group(1))
    assert start >= 1 and start in steps_done
    want, got = losses(full.stderr), losses(resumed.stderr)
    assert sorted(got) == list(range(start + 1, 9))
    assert {s: want[s] for s in got} == got


# ------------------------------------------------------------ runtime guard: masked vs NaN rows
@pytest.mark.parametrize("mode", ["fast", pytest.param("exact", marks=pytest.mark.slow)])
def test_attention_guard_tells_masked_rows_from_nan_rows(mode):
    """Row 0 attends nothing (masked), row 1 attends a NaN key. By default both come out as zeros
    (the probe: NaN hidden as if masked); with keep_nonfinite only the masked row is zero."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.numerics.sparse_attention import sparse_attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 32)), jnp.bfloat16)
    kv = np.asarray(rng.standard_normal((1, 4, 32)), np.float32)
    kv[0, 2] = np.nan
    idx = jnp.asarray([[[-1, -1], [2, 3]]], jnp.int32)
    sink = jnp.zeros((2,), jnp.float32)
    with jax.enable_x64(mode == "exact"):
        hidden = np.asarray(sparse_attention(q, jnp.asarray(kv, jnp.bfloat16), sink, idx, 0.2, mode=mode), np.float32)
        shown = np.asarray(sparse_attention(q, jnp.asarray(kv, jnp.bfloat16), sink, idx, 0.2, mode=mode,
                                            keep_nonfinite=True), np.float32)
    assert np.all(hidden == 0)
    assert np.all(shown[0, 0] == 0) and np.all(np.isnan(shown[0, 1]))


@pytest.mark.slow
def test_all_nan_fp8_weight_gives_finite_logits_unless_guarded(params_a):
    """The probe end to end: an all-NaN FP8 `wkv` (loaded with the value check off) still gives
    finite logits; `Runtime(check_finite=True)` lets the NaN reach them, and the engine's guard
    (what `dsv41 generate --check-finite` runs on) raises naming the position."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.model.transformer import init_cache, make_step
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving.generate import generate, one_slot_engine

    cfg = micro_config(32, engram_layer_ids=())
    params = random_params(cfg, seed=1)
    path = next(p for p in params if p[-2:] == ("wkv", "weight") and p[1] == 0)
    params[path] = np.full_like(params[path], np.nan)
    model = model_from_params(cfg, params)
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    plain = np.asarray(make_step(graphdef, Runtime())(state, tokens, init_cache(cfg, 1))[0], np.float32)
    guarded = np.asarray(make_step(graphdef, Runtime(check_finite=True))(state, tokens, init_cache(cfg, 1))[0], np.float32)
    assert np.all(np.isfinite(plain))
    assert not np.all(np.isfinite(guarded))
    with pytest.raises(FloatingPointError, match="non-finite logits for position 4"):
        generate(one_slot_engine(model, runtime=Runtime(check_finite=True)), [1, 2, 3, 4], max_new_tokens=2)
    assert generate(one_slot_engine(model), [1, 2, 3, 4], max_new_tokens=2).tokens  # unguarded: it generates
