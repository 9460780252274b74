"""Reading and writing safetensors files ourselves: header, dtype strings, row-range reads.

Why not `safetensors.safe_open`: its numpy/flax frameworks cannot materialise the release's
F8_E4M3 / F8_E8M0 tensors (they look for `numpy.float8_e4m3fn`, which numpy lacks), and it
memory-maps whole shards, so every page a load touches is charged to the process RSS. The
format is small (safetensors README): an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}` padded with spaces,
then the tensors' raw little-endian bytes, offsets relative to the end of the header. Reads
here go through `readinto` into fresh buffers, in bounded row chunks when only a slice is
wanted, so a loader holds one tensor (or one slice of one) at a time.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint.atomic import atomic_file

# safetensors dtype strings (safetensors README) -> numpy storage dtypes
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz), "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "C64": np.dtype(np.complex64),
}
# every dtype the format defines -> bits per element (the sub-byte ones have no numpy storage here)
KNOWN_DTYPES: dict[str, int] = {**{k: 8 * v.itemsize for k, v in DTYPES.items()}, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
CHUNK_BYTES = 16 << 20  # bound on the scratch buffer of a partial (column-sliced) read
_MAX_HEADER = 100 << 20  # a larger header means the file is not safetensors


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a request it cannot serve."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry; `begin`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _fail(path, what: str) -> None:
    raise SafetensorsError(f"{path}: {what}; the file is damaged or not safetensors (a Git LFS pointer? "
                           "an interrupted download?), download it again")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _parse_entry(path, name: str, h) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, with the library's type rules."""
    if not isinstance(h, dict):
        _fail(path, f"header entry {name!r} is {type(h).__name__}, not an object with dtype, shape and data_offsets")
    absent = [k for k in ("dtype", "shape", "data_offsets") if k not in h]
    if absent:
        _fail(path, f"tensor {name!r} has no {', '.join(absent)} in the header")
    dt, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    if not isinstance(dt, str) or dt not in KNOWN_DTYPES:
        _fail(path, f"tensor {name!r} has dtype {dt!r}, which is not a safetensors dtype (known: {sorted(KNOWN_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        _fail(path, f"tensor {name!r} has shape {shape!r}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        _fail(path, f"tensor {name!r} has data_offsets {offsets!r}; they are two non-negative integers [begin, end]")
    return dt, tuple(shape), offsets[0], offsets[1]


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors by name, __metadata__) of one file, validated as the `safetensors` library
    validates it (safe_open accepts exactly the files this accepts, tests/checkpoint/test_checkpoint_files.py):
    typed header fields, tensor data contiguous from offset 0 in offset order (no overlap, no gap,
    nothing read from the header), each tensor's byte count equal to its shape and dtype, and
    the data ending exactly at the end of the file."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise SafetensorsError(f"{path} is a folder, not a safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file ({size} bytes); "
                                   "the file is truncated or not safetensors (a Git LFS pointer?)")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        _fail(path, f"header is not UTF-8 ({e})")
    except json.JSONDecodeError as e:
        _fail(path, f"header is not JSON ({e})")
    if not isinstance(header, dict):
        _fail(path, f"header is a JSON {type(header).__name__}, not an object")
    base, data_size = 8 + n, size - 8 - n
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        _fail(path, f"__metadata__ must map names to strings, got {str(meta)[:80]}")
    parsed = {name: _parse_entry(path, name, h) for name, h in header.items()}
    out, expect, last = {}, 0, None
    for name, (dt, shape, b, e) in sorted(parsed.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if b != expect or e < b:
            what = ("ends before it begins" if e < b else
                    "overlaps the tensor before it" if b < expect else "leaves a gap after the tensor before it")
            _fail(path, f"tensor {name!r} has data_offsets [{b}, {e}], which {what} (expected to begin at {expect})")
        bits = _numel(shape) * KNOWN_DTYPES[dt]
        if bits % 8 or e - b != bits // 8:
            _fail(path, f"tensor {name!r} spans {e - b} bytes but {dt}{list(shape)} needs {bits / 8:g}")
        expect, last = e, name
        out[name] = TensorInfo(name, dt, shape, base + b, base + e)
    if expect != data_size:
        if expect > data_size:
            raise SafetensorsError(f"{path}: tensor {last} ends at byte {base + expect}, past the end of the file "
                                   f"({size} bytes); the shard is truncated, download it again")
        _fail(path, f"the tensors cover {expect} of the {data_size} data bytes after the header")
    return out, meta


def _storage(info: TensorInfo, path) -> np.dtype:
    if info.dtype not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {info.name} has dtype {info.dtype}, a valid safetensors dtype that "
                               f"this reader cannot hold in numpy (readable: {sorted(DTYPES)})")
    return DTYPES[info.dtype]


def _readinto(f, buf: np.ndarray, where: str) -> None:
    view = memoryview(buf.reshape(-1).view(np.uint8))
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise SafetensorsError(f"{where}: file ended after {got} of {len(view)} bytes")
        got += n


def normalize_index(index, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A tuple of unit-step slices (or None for all) -> ((start, stop), ...) per dimension."""
    if index is None:
        return tuple((0, d) for d in shape)
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    out = []
    for s, d in zip(index, shape):
        start, stop, step = s.indices(d)
        if step != 1:
            raise SafetensorsError(f"only unit-step slices can be read, got {s}")
        out.append((start, max(start, stop)))
    return tuple(out)


class SafetensorsFile:
    """One open shard; `read(name, index)` returns a numpy array of the requested block."""

    def __init__(self, path: str | os.PathLike):
        if sys.byteorder != "little":
            raise SafetensorsError("safetensors data is little-endian; big-endian hosts are not supported")
        self.path = pathlib.Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._f = open(self.path, "rb", buffering=0)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read(self, name: str, index=None) -> np.ndarray:
        """The block `index` (unit-step slices; None = whole tensor) of `name`, in its disk dtype."""
        if name not in self.tensors:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        info = self.tensors[name]
        dt = _storage(info, self.path)
        rng = normalize_index(index, info.shape)
        out = np.empty(tuple(b - a for a, b in rng), dt)
        if out.size == 0:
            return out
        where = f"{self.path.name}:{name}"
        if not info.shape:
            self._f.seek(info.begin)
            _readinto(self._f, out, where)
            return out
        row = dt.itemsize * _numel(info.shape[1:])  # bytes of one dim-0 row
        (r0, r1), inner = rng[0], rng[1:]
        if all(i == (0, d) for i, d in zip(inner, info.shape[1:])):
            self._f.seek(info.begin + r0 * row)
            _readinto(self._f, out, where)
            return out
        # a column slice: read whole rows in bounded chunks and keep the wanted columns
        per = max(1, CHUNK_BYTES // row)
        scratch = np.empty(min(per, r1 - r0) * row, np.uint8)
        cols = tuple(slice(a, b) for a, b in inner)
        for c0 in range(r0, r1, per):
            c1 = min(r1, c0 + per)
            buf = scratch[: (c1 - c0) * row]
            self._f.seek(info.begin + c0 * row)
            _readinto(self._f, buf, where)
            out[c0 - r0: c1 - r0] = buf.view(dt).reshape((c1 - c0,) + info.shape[1:])[(slice(None),) + cols]
        return out


# --------------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class TensorEntry:
    """A tensor to write: its disk dtype string, shape, and a producer called once when its turn
    comes. The producer returns an array, or an iterable of row chunks (for tensors too big to
    hold twice), in any dtype of the same item size as `dtype` (bytes are written as they are)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray | Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * DTYPES[self.dtype].itemsize


def _chunks(value) -> Iterator[np.ndarray]:
    if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
        yield np.asarray(value)
    else:
        yield from (np.asarray(v) for v in value)


def write_file(path: str | os.PathLike, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file, producing tensors one at a time, atomically (`atomic.atomic_file`:
    the file appears complete or not at all). Returns the bytes of tensor data."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for e in entries:
        if e.dtype not in DTYPES:
            raise SafetensorsError(f"{e.name}: unknown safetensors dtype {e.dtype!r}")
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as the reference writer does
    itemsize = {e.name: DTYPES[e.dtype].itemsize for e in entries}
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            written = 0
            for chunk in _chunks(e.produce()):
                if chunk.dtype.itemsize != itemsize[e.name]:
                    raise SafetensorsError(f"{e.name}: producer gave dtype {chunk.dtype} for disk dtype {e.dtype}")
                chunk = np.ascontiguousarray(chunk)
                f.write(memoryview(chunk.reshape(-1).view(np.uint8)))
                written += chunk.nbytes
            if written != e.nbytes:
                raise SafetensorsError(f"{e.name}: producer wrote {written} bytes, {e.dtype}{list(e.shape)} needs {e.nbytes}")
    return offset
