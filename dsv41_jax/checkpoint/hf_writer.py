"""Write a model as an HF-format folder in the release's layout (docs/REFERENCE.md §9), for tests and export.

The folder holds `config.json` (`cfg.to_hf_dict()`), `model.safetensors.index.json` and shards
`model-0000i-of-0000n.safetensors` with the release's names and dtype strings: F8_E4M3 weights
with F8_E8M0 scales, I8 packed E2M1 experts, BF16 and F32 (`names.py`). Two tensors are kept
wider by the model than on disk: `attn.wo_a` (bf16 in the model, FP8 + scale on disk) and the
ratio>1 compressor weights (fp32 in the model, BF16 on disk). `narrow` says what to do when
those values do not fit the release dtype: "auto" keeps the model's dtype for that tensor (the
loader accepts both), "strict" raises, "round" rounds.

Tensors are produced one at a time while a shard is written, so writing needs one tensor of
host memory, and `TensorEntry` producers may yield row chunks for tensors too big for that.
"""
from __future__ import annotations

import json
import pathlib
from typing import Iterable, Sequence

import jax
import numpy as np
from flax import nnx

from dsv41_jax.checkpoint import atomic, fp8_tiles
from dsv41_jax.checkpoint.hf_loader import INDEX_FILE, weight_map
from dsv41_jax.checkpoint.names import disk_tensors, DiskTensor, is_compressor_weight, is_wo_a, wo_a_scale_shape
from dsv41_jax.checkpoint.safetensors_file import DTYPES, read_header, SafetensorsFile, TensorEntry, write_file
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.param_names import flat_params
from dsv41_jax.text import special_tokens as st

DEFAULT_SHARD_BYTES = 5 << 30
NARROW_POLICIES = ("auto", "strict", "round")


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _group(entries: Sequence[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive entries packed into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        shards.append(cur)
    return shards


def tokenizer_file(tokenizer) -> pathlib.Path | None:
    """The tokenizer.json a writer copies: a file, or a folder holding one (None: no tokenizer)."""
    if tokenizer is None:
        return None
    tok = pathlib.Path(tokenizer)
    tok = tok / "tokenizer.json" if tok.is_dir() else tok
    if not tok.is_file():
        raise FileNotFoundError(f"tokenizer file {tok} does not exist")
    return tok


def tokenizer_config(tok: pathlib.Path, cfg: ModelConfig) -> str:
    """tokenizer_config.json beside a copied tokenizer.json: the one next to the source file when
    there is one, else the few fields Hugging Face's `AutoTokenizer` needs to load the file alone
    (the fast tokenizer class, the special tokens, the context length), so clients that read the
    checkpoint's tokenizer that way (lm-eval, transformers) tokenize as the server does."""
    beside = tok.parent / "tokenizer_config.json"
    if beside.is_file():
        return beside.read_text(encoding="utf-8")
    return json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": st.BOS, "eos_token": st.EOS,
                       "pad_token": st.PAD, "add_bos_token": True, "add_eos_token": False,
                       "model_max_length": cfg.max_seq_len, "clean_up_tokenization_spaces": False},
                      indent=2, ensure_ascii=False)


def write_hf_folder(out_dir, cfg: ModelConfig, entries: Sequence[TensorEntry], *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tokenizer=None, overwrite: bool = False, progress: bool = False, sources=()) -> dict:
    """Write config.json, the shards and the index, as a whole (`atomic.atomic_folder`): the
    folder is built beside out_dir and replaces it only when complete. Returns the index dict.

    tokenizer: optional path to a tokenizer.json (or a folder holding one) to copy alongside.
    overwrite: replace a non-empty out_dir (only one that holds a checkpoint, `atomic.check_destination`).
    sources: folders being read while writing (e.g. convert's source), which out_dir must not hold or lie in.
    """
    from tqdm.auto import tqdm

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes} (CLI: --max-shard-size, e.g. 5GB)")
    names = [e.name for e in entries]
    dup = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    if dup:
        raise ValueError(f"tensor names written twice: {dup[:10]}")
    tok = tokenizer_file(tokenizer)
    shards = _group(entries, max_shard_bytes)
    shard_of, total = {}, 0
    with atomic.atomic_folder(out_dir, overwrite=overwrite, sources=sources) as out:
        atomic.write_text(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=2))
        if tok is not None:
            atomic.copy_file(tok, out / "tokenizer.json")
            atomic.write_text(out / "tokenizer_config.json", tokenizer_config(tok, cfg))
        with tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc="writing", disable=not progress) as bar:
            for i, shard in enumerate(shards):
                fname = shard_name(i, len(shards))
                total += write_file(out / fname, shard, metadata={"format": "pt"})
                shard_of.update({e.name: fname for e in shard})
                bar.update(sum(e.nbytes for e in shard))
        index = {"metadata": {"total_size": total}, "weight_map": shard_of}
        atomic.write_text(out / INDEX_FILE, json.dumps(index, indent=2))
    return index


# ------------------------------------------------------------------------ model -> entries
def _bf16_exact(v: np.ndarray) -> bool:
    return np.array_equal(v.astype(DTYPES["BF16"]).astype(np.float32).view(np.uint32), v.view(np.uint32))


def _narrow_fail(name: str, what: str):
    raise ValueError(f"{name}: the values do not fit {what} exactly; pass narrow='auto' to keep the model's dtype for it "
                     "or narrow='round' to round (CLI: --narrow auto|round)")


def model_entries(model: nnx.Module, *, narrow: str = "auto", wo_a_fp8: bool | None = None) -> list[TensorEntry]:
    """The model's tensors as checkpoint entries (release names and dtypes, per `narrow`)."""
    if narrow not in NARROW_POLICIES:
        raise ValueError(f"narrow must be one of {NARROW_POLICIES}, got {narrow!r}")
    cfg: ModelConfig = model.cfg
    wo_a_fp8 = cfg.dtype == "fp8" if wo_a_fp8 is None else wo_a_fp8
    params = flat_params(model)
    cache: dict[tuple, np.ndarray] = {}

    def host(path) -> np.ndarray:  # one parameter on the host at a time, in write order
        if path not in cache:
            cache.clear()
            cache[path] = np.asarray(jax.device_get(params[path].get_value()))
        return cache[path]

    fp8: dict[tuple, tuple] = {}

    def wo_a_fp8_part(path, i):  # (q, scale) of one wo_a, computed again when written
        if path not in fp8:
            fp8.clear()
            fp8[path] = fp8_tiles.exact_fp8(host(path))[:2]
        return fp8[path][i]

    entries = []
    for t in disk_tensors(model, wo_a_fp8=False):
        if is_wo_a(t.path) and wo_a_fp8:
            exact = fp8_tiles.exact_fp8(host(t.path))[2]
            if exact or narrow == "round":
                scale = t.name[: -len("weight")] + "scale"
                entries.append(TensorEntry(t.name, "F8_E4M3", t.shape, lambda p=t.path: wo_a_fp8_part(p, 0)))
                entries.append(TensorEntry(scale, "F8_E8M0", wo_a_scale_shape(t.shape), lambda p=t.path: wo_a_fp8_part(p, 1)))
                continue
            if narrow == "strict":
                _narrow_fail(t.name, "FP8 with 32x32 E8M0 tiles")
            entries.append(TensorEntry(t.name, "BF16", t.shape, lambda p=t.path: host(p)))
            continue
        if is_compressor_weight(t.path) and t.dtype == "BF16" and np.dtype(params[t.path].dtype) == np.float32:
            v = host(t.path)
            if not _bf16_exact(v):
                if narrow == "strict":
                    _narrow_fail(t.name, "bf16")
                if narrow == "auto":
                    entries.append(TensorEntry(t.name, "F32", t.shape, lambda p=t.path: host(p)))
                    continue
            entries.append(TensorEntry(t.name, "BF16", t.shape, lambda p=t.path: host(p).astype(DTYPES["BF16"])))
            continue
        entries.append(_param_entry(t, host))
    return entries


def _param_entry(t: DiskTensor, host) -> TensorEntry:
    disk = DTYPES[t.dtype]

    def produce(t=t):
        v = host(t.path)
        v = v[t.expert] if t.expert is not None else v
        return v.view(disk) if v.dtype.itemsize == 1 else v.astype(disk)

    return TensorEntry(t.name, t.dtype, t.shape, produce)


def save_hf_checkpoint(model: nnx.Module, out_dir, *, narrow: str = "auto", wo_a_fp8: bool | None = None,
                       extra: Iterable[TensorEntry] = (), max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                       tokenizer=None, overwrite: bool = False, progress: bool = False, sources=()) -> dict:
    """Write `model` (a Transformer) as an HF folder; `extra` adds tensors the model does not hold
    (DSpark mtp.*, vision.*, aligner.*: copied through by convert, faked by tests)."""
    entries = model_entries(model, narrow=narrow, wo_a_fp8=wo_a_fp8) + list(extra)
    return write_hf_folder(out_dir, model.cfg, entries, max_shard_bytes=max_shard_bytes, tokenizer=tokenizer,
                           overwrite=overwrite, progress=progress, sources=sources)


def copied_entries(src_folder, names: Iterable[str]) -> list[TensorEntry]:
    """Entries that copy tensors unchanged from an HF folder (convert keeps the DSpark mtp.*,
    vision.* and aligner.* tensors the model does not hold). Each is read when its turn comes."""
    src = pathlib.Path(src_folder)
    wm = weight_map(src)
    wanted = set(names)
    out = []
    for shard in sorted({wm[n] for n in wanted}):
        infos, _ = read_header(src / shard)
        for name, info in infos.items():
            if name in wanted and wm[name] == shard:
                def produce(path=src / shard, name=name):
                    with SafetensorsFile(path) as f:
                        return f.read(name)

                out.append(TensorEntry(name, info.dtype, info.shape, produce))
    return out
