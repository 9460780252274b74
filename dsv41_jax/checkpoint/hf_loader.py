"""Load a released-format HF folder (config.json, index, safetensors shards) into the model.

No conversion step: the bare names of docs/REFERENCE.md §9 map onto the parameter tree (`names.py`), the
quantized tensors keep their storage (E4M3 as float8_e4m3fn, E8M0 scales and packed E2M1 as
uint8 bytes), and each parameter is placed with its target sharding while it is read, one
block at a time (`placement.place`), so a 500 GB checkpoint never sits whole in host RAM.

Everything that can be checked from the headers is checked before any data is read: missing,
unexpected, mis-shaped and mis-typed tensors are reported together, by name. DSpark (`mtp.*`) is
loaded when the config describes it; a checkpoint without mtp.* tensors loads as the backbone
alone (the returned config has n_mtp_layers 0). Vision and aligner tensors are skipped and listed
in the report. A V4 config is refused by
`ModelConfig` (its compressors are per layer; V4.1 shares them, docs/REFERENCE.md §9).
"""
from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass, field

import numpy as np
from flax import nnx

from dsv41_jax.checkpoint import fp8_tiles, placement, values
from dsv41_jax.checkpoint.names import disk_tensors, DiskTensor, is_wo_a, wo_a_scale_shape
from dsv41_jax.checkpoint.safetensors_file import normalize_index, read_header, SafetensorsFile, TensorInfo
from dsv41_jax.checkpoint.weights import config_for_names, is_ignored, WeightError
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.model.info import abstract_model
from dsv41_jax.model.param_names import flat_params

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read: missing files, broken index, wrong format."""


@dataclass
class LoadReport:
    """What a load did: tensors read and skipped, and the conversions it applied."""

    source: str
    format: str
    tensors_read: int = 0
    bytes_read: int = 0
    shards: int = 0
    skipped: list[str] = field(default_factory=list)  # DSpark / vision / aligner: not modelled
    skipped_bytes: int = 0
    dequantized: list[str] = field(default_factory=list)  # FP8 wo_a -> bf16 (docs/REFERENCE.md §4)
    upcast: list[str] = field(default_factory=list)  # bf16 on disk -> fp32 parameter (exact)
    bytes_per_device: dict[str, int] = field(default_factory=dict)  # placed parameter bytes, by device

    def summary(self) -> str:
        groups = sorted({re.sub(r"^layers\.\d+\.", "layers.*.", n) if n.startswith("layers.") else n.split(".")[0]
                         for n in self.skipped})
        where = f"{self.shards} shard(s) of {self.source}" if self.format == "hf" else f"the {self.format} checkpoint {self.source}"
        s = f"loaded {self.tensors_read} tensors ({self.bytes_read / 2**20:.1f} MiB) from {where}"
        if self.skipped:
            s += f"; skipped {len(self.skipped)} tensors not modelled ({', '.join(groups)}; {self.skipped_bytes / 2**20:.1f} MiB)"
        if self.dequantized:
            s += f"; dequantized {len(self.dequantized)} FP8 wo_a to bf16"
        if len(self.bytes_per_device) > 1:
            per = sorted(self.bytes_per_device.values())
            s += (f"; {len(per)} devices hold {per[0] / 2**20:.1f}"
                  f"{'' if per[0] == per[-1] else f'..{per[-1] / 2**20:.1f}'} MiB each")
        return s


# --------------------------------------------------------------------------------- folder
def read_config(folder: pathlib.Path, overrides: dict | None = None) -> ModelConfig:
    """The folder's config.json as a ModelConfig; the error names the file."""
    try:
        cfg = ModelConfig.from_file(folder / "config.json")
    except ConfigError as e:
        raise ConfigError(f"{folder / 'config.json'}: {e}") from None
    if not overrides:
        return cfg
    try:
        return cfg.replace(**overrides)
    except ConfigError as e:
        raise ConfigError(f"runtime settings {overrides}: {e}") from None


def weight_map(folder: pathlib.Path) -> dict[str, str]:
    """name -> shard file name: the one rule for what an HF checkpoint folder holds.

    With `model.safetensors.index.json` the index lists every shard; without one the folder
    holds exactly one `model.safetensors`. A `.safetensors` file the rule does not account for
    (stale shards next to a newer single file, a shard missing from the index) is an error,
    not something one reader uses and another ignores.
    """
    folder = pathlib.Path(folder)
    present = {p.name for p in folder.glob("*.safetensors")}
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError(f"weight_map is a {type(wm).__name__}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (need a JSON object with weight_map): {e}") from None
        missing = sorted({f for f in wm.values() if not (folder / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} lists shard files that are not in {folder}: {missing[:10]}"
                                  f"{' ...' if len(missing) > 10 else ''} ({len(missing)} missing)")
        stray = sorted(present - set(wm.values()))
        if stray:
            raise CheckpointError(f"{folder} holds .safetensors files that its index does not list: {stray[:10]}; "
                                  "they belong to another checkpoint (e.g. a newer export written next to old "
                                  "shards); remove them, or the index and its shards, so one checkpoint remains")
        return dict(wm)
    single = folder / SINGLE_FILE
    if single.is_file():
        stray = sorted(present - {SINGLE_FILE})
        if stray:
            raise CheckpointError(f"{folder} holds {SINGLE_FILE} and other .safetensors files {stray[:10]} but no "
                                  f"{INDEX_FILE}; a sharded checkpoint needs its index; remove the files that "
                                  "do not belong to the checkpoint")
        return {name: SINGLE_FILE for name in read_header(single)[0]}
    raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}; is it an HF checkpoint folder?")


def _headers(folder: pathlib.Path, wm: dict[str, str]) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for shard in sorted(set(wm.values())):
        infos_of, _ = read_header(folder / shard)
        for name, info in infos_of.items():
            if wm.get(name) == shard:
                infos[name] = info
    absent = [n for n, s in wm.items() if n not in infos]
    if absent:
        raise CheckpointError(f"the index maps {len(absent)} tensors to shards that do not contain them, e.g. "
                              f"{[(n, wm[n]) for n in absent[:5]]}; the index and the shards disagree")
    return infos


# --------------------------------------------------------------------------------- checks
def _scale_of(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "scale"


def _accepted(t: DiskTensor, param_dtype: np.dtype) -> tuple[str, ...]:
    """Disk dtypes that hold this parameter's values exactly, in the model's storage."""
    name = np.dtype(param_dtype).name
    if name == "float8_e4m3fn":
        return ("F8_E4M3",)
    if name == "uint8":
        return ("F8_E8M0", "U8") if t.name.endswith(".scale") else ("I8", "U8")
    if name == "bfloat16":
        return ("BF16",)
    if name == "float32":
        return ("F32", "BF16")
    return (t.dtype,)


def _v4_hint(unexpected: list[str], cfg: ModelConfig) -> str:
    """Per-layer compressor tensors outside the KV sources are the V4 census (docs/REFERENCE.md §9)."""
    layers = sorted({int(m.group(1)) for n in unexpected if (m := re.match(r"layers\.(\d+)\.attn\.compressor\.", n))})
    if not layers:
        return ""
    return (f" Layers {layers[:10]} carry their own compressor but are not KV sources {list(cfg.kv_source_layers)}:"
            " this looks like a DeepSeek-V4 checkpoint (per-layer compressors), which V4.1 does not load.")


def _plan(cfg: ModelConfig, params: dict, infos: dict[str, TensorInfo]):
    """Group the checkpoint tensors by parameter; raise WeightError naming every problem."""
    expected = {t.name: t for t in disk_tensors(params, wo_a_fp8=False)}
    dspark = cfg.has_dspark
    skipped = [n for n in infos if is_ignored(n, cfg.vision_enabled, dspark=dspark)]
    wo_a_scales = {_scale_of(n) for n, t in expected.items() if is_wo_a(t.path)}
    unexpected = [n for n in infos if n not in expected and n not in wo_a_scales and not is_ignored(n, cfg.vision_enabled, dspark=dspark)]
    missing = [n for n in expected if n not in infos]
    problems = []
    by_path: dict[tuple, list[DiskTensor]] = {}
    for name, t in expected.items():
        if name not in infos:
            continue
        info, want_dt = infos[name], params[t.path].dtype
        accepted = _accepted(t, want_dt)
        scale_name = _scale_of(name)
        if is_wo_a(t.path) and scale_name in infos:  # the release's FP8 wo_a
            accepted = ("F8_E4M3",)
            s = infos[scale_name]
            if s.dtype not in ("F8_E8M0", "U8") or s.shape != wo_a_scale_shape(t.shape):
                problems.append(f"{scale_name}: {s.dtype}{list(s.shape)}, expected F8_E8M0{list(wo_a_scale_shape(t.shape))}")
        if info.dtype not in accepted:
            problems.append(f"{name}: dtype {info.dtype} on disk, expected {' or '.join(accepted)} "
                            f"(the model keeps it as {np.dtype(want_dt).name})")
        if info.shape != t.shape:
            problems.append(f"{name}: shape {list(info.shape)}, expected {list(t.shape)}")
        by_path.setdefault(t.path, []).append(t)
    if missing or unexpected or problems:
        msg = []
        if missing:
            msg.append(f"{len(missing)} missing tensors: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            msg.append(f"{len(unexpected)} unexpected tensors: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
                       + _v4_hint(unexpected, cfg))
        msg.extend(problems[:40])
        raise WeightError("checkpoint does not match the config: " + "; ".join(msg))
    return by_path, skipped


# --------------------------------------------------------------------------------- reading
def _to_param(arr: np.ndarray, want: np.dtype) -> np.ndarray:
    if arr.dtype == want:
        return arr
    if arr.dtype.itemsize == 1 and want.itemsize == 1:
        return arr.view(want)  # raw bytes: E8M0 / packed E2M1
    return arr.astype(want)  # bf16 -> fp32, exact


class _Reader:
    """Reads blocks of one parameter from its checkpoint tensors (open shards are shared)."""

    def __init__(self, folder, wm, files, param, tensors: list[DiskTensor], infos, check: bool):
        self.folder, self.wm, self.files, self.check = folder, wm, files, check
        self.want = np.dtype(param.dtype)
        self.shape = tuple(param.shape)
        self.tensors, self.infos = tensors, infos

    def _file(self, name) -> SafetensorsFile:
        shard = self.wm[name]
        if shard not in self.files:
            self.files[shard] = SafetensorsFile(self.folder / shard)
        return self.files[shard]

    def _read(self, name, index):
        arr = self._file(name).read(name, index)
        if self.check:
            values.check_values(name, self.infos[name].dtype, arr)
        return arr

    def __call__(self, index: tuple) -> np.ndarray:
        t0 = self.tensors[0]
        if t0.expert is not None:  # stacked experts: rows of the block are experts
            by_expert = {t.expert: t.name for t in self.tensors}
            experts = range(*index[0].indices(self.shape[0]))
            inner = tuple(b - a for a, b in normalize_index(index[1:], self.shape[1:]))
            out = np.empty((len(experts),) + inner, self.want)
            for i, e in enumerate(experts):  # only the experts this block holds are read
                out[i] = _to_param(self._read(by_expert[e], index[1:]), self.want)
            return out
        if is_wo_a(t0.path) and _scale_of(t0.name) in self.infos:  # FP8 wo_a: small, read whole
            full = fp8_tiles.dequantize(self._read(t0.name, None), self._read(_scale_of(t0.name), None))
            return np.ascontiguousarray(full[index])
        return _to_param(self._read(t0.name, index), self.want)


def _zero_padded(read, rows: int, dtype):
    """A reader over `rows` stored rows that answers rows past them with zeros (a table padded so
    row shards are equal; those rows are never addressed)."""
    def padded(index: tuple) -> np.ndarray:
        (r0, r1), rest = (index[0].start, index[0].stop), index[1:]
        out = np.zeros((r1 - r0,) + tuple(s.stop - s.start for s in rest), dtype)
        if min(r1, rows) > r0:
            out[: min(r1, rows) - r0] = read((slice(r0, min(r1, rows)),) + rest)
        return out

    return padded


def load_checkpoint(folder, *, shardings: placement.ShardingSpec = None, progress: bool = True,
                    config_overrides: dict | None = None, check_values: bool = True, cfg: ModelConfig | None = None,
                    language_model_only: bool = False, padded_shape=None):
    """Load an HF-format folder. Returns (cfg, model, report).

    language_model_only: leave the vision tower, aligner, delimiters and `bias_vl` on disk (they
      are skipped and listed in the report); the model then refuses image inputs.
    shardings: None (first device), a Sharding for every parameter, or a callable
      (param path, shape, dtype) -> Sharding; each device reads only its block.
    config_overrides: runtime fields to change (e.g. {"max_seq_len": 8192}); they size caches only.
    check_values: refuse tensors holding NaN/inf (`values.py`), naming them; False skips the pass.
    cfg: the config to load into instead of the folder's config.json (its shapes must match the tensors).
    padded_shape: optional (param path, shape) -> shape with more rows; the parameter is created
      with that shape and the extra rows are zeros (Engram tables padded to equal row shards,
      `sharding.load`). The report's `bytes_per_device` counts what each device holds.
    """
    from tqdm.auto import tqdm

    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    cfg = cfg if cfg is not None else read_config(folder, config_overrides)
    if language_model_only:
        cfg = cfg.language_model_only()
    wm = weight_map(folder)
    infos = _headers(folder, wm)
    cfg = config_for_names(cfg, infos)  # no mtp.* tensors: the backbone alone, speculation refused later
    graphdef, state = nnx.split(abstract_model(cfg))
    params = flat_params(state)
    by_path, skipped = _plan(cfg, params, infos)
    report = LoadReport(str(folder), "hf", shards=len(set(wm.values())), skipped=skipped,
                        skipped_bytes=sum(infos[n].nbytes for n in skipped))
    where = placement.resolve(shardings)
    files: dict[str, SafetensorsFile] = {}
    skip = set(skipped)
    total = sum(i.nbytes for n, i in infos.items() if n not in skip)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress) as bar:
            for path, var in params.items():
                tensors = by_path[path]
                shape = tuple(var.shape) if padded_shape is None else tuple(padded_shape(path, tuple(var.shape)))
                if shape[1:] != tuple(var.shape)[1:] or shape[0] < var.shape[0]:
                    raise ValueError(f"padded_shape may only add rows: {path} {tuple(var.shape)} -> {shape}")
                sharding = where(path, shape, np.dtype(var.dtype))
                read = _Reader(folder, wm, files, var, tensors, infos, check_values)
                if shape != tuple(var.shape):
                    read = _zero_padded(read, var.shape[0], np.dtype(var.dtype))
                value = placement.place(shape, var.dtype, sharding, read)
                for shard in value.addressable_shards:
                    key = str(shard.device)
                    report.bytes_per_device[key] = report.bytes_per_device.get(key, 0) + shard.data.nbytes
                var.set_value(value)
                names = [t.name for t in tensors]
                if is_wo_a(path) and _scale_of(names[0]) in infos:
                    names.append(_scale_of(names[0]))
                    report.dequantized.append(names[0])
                elif tensors[0].expert is None and infos[names[0]].dtype == "BF16" and np.dtype(var.dtype) == np.float32:
                    report.upcast.append(names[0])
                nbytes = sum(infos[n].nbytes for n in names)
                report.tensors_read += len(names)
                report.bytes_read += nbytes
                bar.update(nbytes)
    finally:
        for f in files.values():
            f.close()
    model = nnx.merge(graphdef, nnx.from_flat_state([(p, v) for p, v in params.items()]))
    return cfg, model, report
