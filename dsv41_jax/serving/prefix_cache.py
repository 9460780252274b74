"""Persistent prefix cache: one sequence's global cache on disk (docs/REFERENCE.md §5 "Persistent storage").

Only the global parts are stored: each KV source's compressed entries and index keys (the
packed 288 B / 68 B rows, exactly as cached), its compressor's partial group, and the token
ids. The window rings are disposable; after a restore they are rebuilt by replaying the last
window of tokens (`split_prefill.replay_window`). A speculating engine also stores the DSpark
drafter's rings of the sequence (`dspark.init_state`'s one-row window rings of main_x keys, arrays
`dspark.ring<i>.<field>`): a replay cannot rebuild them (its window is truncated, so its taps differ
from the original run's), and with them a resumed request speculates from its first decode step
(`load_rings`). A file without them (older, or written without speculation) loads as before;
`load_rings` returns None for it.

File layout (little endian):
    magic b"DSV41PFX" | u32 format version | u64 header length | header (UTF-8 JSON)
    | SHA-256 of the header (32 B) | payload (the arrays, back to back)
The header names the config (every architecture field), the model fingerprint (a digest of
every byte of every weight, `model_fingerprint`), and
each array's dtype, shape, offset, size and SHA-256. Writes go to a temporary file in the same
folder that is renamed over the target, so a reader never sees half a file. A file that is
truncated, corrupt, or written for another config or model is refused with the reason.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import struct

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.checkpoint.atomic import atomic_file
from dsv41_jax.numerics import kv_layout
from dsv41_jax.config import ModelConfig
from dsv41_jax.model import dspark
from dsv41_jax.serving.buckets import capacity_for, empty_cache

MAGIC = b"DSV41PFX"
VERSION = 1
_RUNTIME_FIELDS = ("max_seq_len", "max_batch_size", "extra")
_PREFIX = struct.Struct("<8sIQ")


class PrefixCacheError(ValueError):
    """A prefix-cache file that cannot be used with this model."""


# Pass as `fingerprint=` to load a cache without checking which weights wrote it (a deliberate choice).
UNCHECKED = "unchecked"


def _checked_fingerprint(fingerprint, who: str) -> str:
    if fingerprint == UNCHECKED and who == "load_prefix":
        return fingerprint
    if not (isinstance(fingerprint, str) and len(fingerprint) == 64 and all(c in "0123456789abcdef" for c in fingerprint)):
        extra = " or prefix_cache.UNCHECKED to skip the check" if who == "load_prefix" else ""
        raise ValueError(f"{who}: fingerprint must be model_fingerprint(params) (64 hex digits){extra}, got {fingerprint!r}")
    return fingerprint


def config_fields(cfg: ModelConfig) -> dict:
    """The architecture fields a stored cache depends on (runtime limits excluded)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name in _RUNTIME_FIELDS:
            continue
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Two position-weighted byte sums per tensor, modulo 2^32: changing any one byte changes the first
# (its weight 2i+1 is odd, hence invertible), and the second's pseudo-random odd weights make
# compensating edits elsewhere in the tensor unlikely to cancel in both.
_GOLDEN = 0x9E3779B1


def tensor_digest(x) -> tuple[int, int]:
    """A cheap 64-bit digest of every byte of one array, computed where the array lives.

    On an accelerator, or for a tensor spread over several processes: one fused reduction over the
    tensor's bytes (no copy to the host), so the digests of a whole checkpoint cost about one read
    of the weights; the sums are integer (mod 2^32), so any reduction order gives the same pair.
    Host arrays (numpy, or jax arrays on CPU) take the same sums in numpy, chunk by chunk, to skip
    a compile per shape.
    """
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or any(d.platform != "cpu" for d in x.devices())):
        out = _digest(x)  # a mesh across processes: no process can read the tensor, each gets the sums
        if not out.is_fully_addressable:  # replicated: every process holds the whole pair
            out = out.addressable_data(0)
        return tuple(int(v) for v in jax.device_get(out))
    data = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
    first = second = np.uint32(0)
    with np.errstate(over="ignore"):
        for start in range(0, data.size, _CHUNK):
            b = data[start:start + _CHUNK].astype(np.uint32)
            i = np.arange(start, start + b.size, dtype=np.uint64).astype(np.uint32)
            first += np.sum(b * (np.uint32(2) * i + np.uint32(1)), dtype=np.uint32)
            second += np.sum((b + np.uint32(1)) * ((i * np.uint32(_GOLDEN)) | np.uint32(1)), dtype=np.uint32)
    return int(first), int(second)


_CHUNK = 1 << 24


@jax.jit
def _digest(x: jax.Array) -> jax.Array:
    data = x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)
    b = data.reshape(-1).astype(jnp.uint32)
    i = jnp.arange(b.size, dtype=jnp.uint32)
    first = jnp.sum(b * (jnp.uint32(2) * i + jnp.uint32(1)), dtype=jnp.uint32)
    second = jnp.sum((b + jnp.uint32(1)) * ((i * jnp.uint32(_GOLDEN)) | jnp.uint32(1)), dtype=jnp.uint32)
    return jnp.stack([first, second])


def model_fingerprint(params) -> str:
    """The identity of a set of weights: every parameter's path, shape, dtype and the digest of
    all its bytes (`tensor_digest`), combined with SHA-256. Computed once when an engine loads
    its weights; any changed byte of any tensor changes it."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(f"model_fingerprint needs the weights themselves; {jax.tree_util.keystr(path)} is abstract")
        first, second = tensor_digest(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{tuple(leaf.shape)}|{leaf.dtype}|{first:08x}{second:08x};".encode())
    return h.hexdigest()


def _host(a) -> np.ndarray:
    """One (sliced) cache array as numpy. On a mesh across processes no process holds it whole: it is
    gathered, a collective every process joins (the engines save the same row at the same point of
    their lockstep steps: `serving.lockstep`)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(jax.device_get(a))


# Rows of a cache array cross between device and host in blocks of this many, at a start the device
# takes as data: one small program per array shape whatever a conversation's length (slicing to each
# length on the device compiled new programs at every new length, after a server's warm-up).
_BLOCK = 1024


@functools.partial(jax.jit, static_argnums=(3,))
def _get_block(a, row, start, size: int):
    return jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(a, row, 0, keepdims=False), start, size, 0)


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_block(a, block, start):
    return jax.lax.dynamic_update_slice_in_dim(a, block[None].astype(a.dtype), start, 1)


def _starts(g: int, total: int) -> tuple[int, list[int]]:
    """(block size, starts) of the blocks covering rows 0..g of an axis of `total` rows; the last
    block starts early rather than run past the end."""
    size = min(_BLOCK, total)
    return size, [min(k, total - size) for k in range(0, g, size)]


def _rows(a, row: int, g: int) -> np.ndarray:
    """a[row, :g] on the host, copied in `_BLOCK` blocks."""
    size, starts = _starts(g, a.shape[1])
    out = np.zeros((g, *a.shape[2:]), a.dtype)
    for s in starts:
        block = _host(_get_block(a, jnp.int32(row), jnp.int32(s), size))
        out[s:min(s + size, g)] = block[:min(size, g - s)]
    return out


def _set_rows(a, data: np.ndarray):
    """a (one row, empty after data's rows) with a[0, :len(data)] = data, copied in `_BLOCK` blocks."""
    g = len(data)
    size, starts = _starts(g, a.shape[1])
    padded = np.zeros((max([s + size for s in starts], default=0), *data.shape[1:]), data.dtype)
    padded[:g] = data
    for s in starts:
        a = _put_block(a, jnp.asarray(padded[s:s + size]), jnp.int32(s))
    return a


def _global_arrays(cfg: ModelConfig, cache: dict, row: int, n: int) -> dict[str, np.ndarray]:
    """The persistent parts of one cache row, cut to the n cached positions."""
    out = {}
    for s in cfg.kv_source_layers:
        key, m = f"layer{s}", cfg.compress_ratios[s]
        g = n // m
        for part, container in (("compressed", cache["compressed"].get(key)), ("index_keys", cache["index_keys"].get(key))):
            if container is None:
                continue
            # files hold bytes, whatever form the cache keeps (the rows converted on the host side)
            rows = kv_layout.bytes_of(type(container)(*(jnp.asarray(_rows(a, row, g)) for a in container)))
            for name, a in zip(rows._fields, rows):
                out[f"{part}.{key}.{name}"] = np.asarray(a)
        if key in cache["compressor"]:
            for name, a in cache["compressor"][key].items():
                out[f"compressor.{key}.{name}"] = _host(a)[row]
    return out


def save_prefix(path, cfg: ModelConfig, cache: dict, tokens, *, fingerprint: str, row: int = 0,
                match_key=None, rings: dict | None = None) -> dict:
    """Write row `row` of `cache` (holding exactly `tokens`) to `path`, atomically. Returns the header.

    fingerprint: `model_fingerprint` of the weights that computed the cache (checked on load).
    match_key: optional int32 [n] that conversation caches match on instead of the token ids (an
    image prompt's positions keyed by the image's pixels: every image position has the same id).
    rings: the drafter's state (`dspark.init_state` layout) holding this sequence's positions, row
    `row` is stored (`load_rings` reads it back).
    """
    fingerprint = _checked_fingerprint(fingerprint, "save_prefix")
    path = pathlib.Path(path)
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = int(_host(cache["length"])[row])
    if n != tokens.size:
        raise PrefixCacheError(f"the cache row holds {n} positions but {tokens.size} token ids were given; "
                               "pass exactly the tokens that went through the model")
    arrays = {"tokens": tokens, **_global_arrays(cfg, cache, row, n)}
    if match_key is not None:
        arrays["match_key"] = np.asarray(match_key, np.int32).reshape(-1)
        if arrays["match_key"].size != n:
            raise PrefixCacheError(f"match_key has {arrays['match_key'].size} entries for {n} tokens")
    if rings is not None:
        arrays.update(_ring_arrays(rings, row))
    entries, blobs, offset = [], [], 0
    for name, a in arrays.items():
        data = np.ascontiguousarray(a).tobytes()
        entries.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offset,
                        "nbytes": len(data), "sha256": _sha(data)})
        blobs.append(data)
        offset += len(data)
    header = {"format": "dsv41-prefix-cache", "version": VERSION, "config": config_fields(cfg),
              "model_fingerprint": fingerprint, "n_tokens": n,
              "published": int(_host(cache["published"])[row]), "payload_bytes": offset, "arrays": entries}
    hb = json.dumps(header, sort_keys=True).encode()
    if path.is_dir():
        raise PrefixCacheError(f"prefix cache path {path} is a folder; give a file path (e.g. {path / 'prefix.dsv41'})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:  # a crash leaves the old file or none, never a prefix of the new one
        f.write(_PREFIX.pack(MAGIC, VERSION, len(hb)))
        f.write(hb)
        f.write(hashlib.sha256(hb).digest())
        for data in blobs:
            f.write(data)
    return header


def _read(path: pathlib.Path) -> tuple[dict, bytes]:
    if path.is_dir():
        raise PrefixCacheError(f"prefix cache {path} is a folder, not a prefix cache file; give the file's path")
    if not path.is_file():
        raise PrefixCacheError(f"prefix cache {path} does not exist")
    raw = path.read_bytes()
    if len(raw) < _PREFIX.size:
        raise PrefixCacheError(f"prefix cache {path} is truncated: {len(raw)} bytes, shorter than the file prefix")
    magic, version, hlen = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise PrefixCacheError(f"{path} is not a dsv41 prefix cache (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise PrefixCacheError(f"prefix cache {path} has format version {version}; this build reads version {VERSION}")
    hend = _PREFIX.size + hlen
    if len(raw) < hend + 32:
        raise PrefixCacheError(f"prefix cache {path} is truncated inside its header ({len(raw)} bytes)")
    hb = raw[_PREFIX.size:hend]
    if hashlib.sha256(hb).digest() != raw[hend:hend + 32]:
        raise PrefixCacheError(f"prefix cache {path} is corrupt: the header checksum does not match")
    header = json.loads(hb)
    payload = raw[hend + 32:]
    if len(payload) != header["payload_bytes"]:
        raise PrefixCacheError(f"prefix cache {path} is truncated or padded: payload has {len(payload)} bytes, "
                               f"the header says {header['payload_bytes']}")
    return header, payload


def read_header(path) -> dict:
    """The header of a prefix-cache file (validated framing, arrays not checked)."""
    return _read(pathlib.Path(path))[0]


def _check_identity(path, header: dict, cfg: ModelConfig, fingerprint: str | None) -> None:
    want = config_fields(cfg)
    got = header["config"]
    diff = [f"{k} (file {got.get(k)!r}, model {want.get(k)!r})" for k in sorted(set(want) | set(got)) if got.get(k) != want.get(k)]
    if diff:
        raise PrefixCacheError(f"prefix cache {path} was written for another model config; differing fields: "
                               + "; ".join(diff[:8]) + (" ..." if len(diff) > 8 else ""))
    stored = header.get("model_fingerprint")
    if fingerprint == UNCHECKED:
        return
    if stored is None:
        raise PrefixCacheError(f"prefix cache {path} records no model fingerprint, so it cannot be matched to these "
                               "weights; write it again, or pass fingerprint=prefix_cache.UNCHECKED to accept it")
    if stored != fingerprint:
        raise PrefixCacheError(f"prefix cache {path} was written by other weights (fingerprint {stored[:16]}..., "
                               f"this model {fingerprint[:16]}...)")


def _check_counts(path, header: dict) -> int:
    n, published = header.get("n_tokens"), header.get("published")
    for name, v, low in (("n_tokens", n, 0), ("published", published, -1)):  # -1: nothing published yet
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise PrefixCacheError(f"prefix cache {path}: header field {name} is {v!r}, not a count")
    if published > n:
        raise PrefixCacheError(f"prefix cache {path}: header says {published} positions are published but only "
                               f"{n} tokens are cached; the file is inconsistent, write it again")
    return n


def _arrays(path, header: dict, payload: bytes, prefix: str = "") -> dict[str, np.ndarray]:
    """The file's arrays whose names start with `prefix`, each checked against its checksum."""
    arrays = {}
    for e in header["arrays"]:
        if not e["name"].startswith(prefix):
            continue
        lo, hi = e["offset"], e["offset"] + e["nbytes"]
        if hi > len(payload):
            raise PrefixCacheError(f"prefix cache {path} is truncated: array {e['name']} ends at {hi}, payload has {len(payload)} bytes")
        data = payload[lo:hi]
        if _sha(data) != e["sha256"]:
            raise PrefixCacheError(f"prefix cache {path} is corrupt: array {e['name']} fails its checksum")
        arrays[e["name"]] = np.frombuffer(data, dtype=jnp.dtype(e["dtype"])).reshape(e["shape"])
    return arrays


def _ring_arrays(rings: dict, row: int) -> dict[str, np.ndarray]:
    return {f"dspark.ring{i}.{name}": _host(a)[row]
            for i, ring in enumerate(rings["rings"]) for name, a in zip(ring._fields, ring)}


def load_rings(path, cfg: ModelConfig, *, fingerprint: str) -> dict | None:
    """The DSpark rings stored with a prefix cache (`save_prefix(rings=...)`), one row in
    `dspark.init_state(cfg, 1)`'s layout, or None when the file has none (written before rings were
    stored, or by an engine without speculation: such a resumed request decodes without speculating).
    The file's identity is checked as `load_prefix` checks it."""
    fingerprint = _checked_fingerprint(fingerprint, "load_prefix")
    path = pathlib.Path(path)
    header, payload = _read(path)
    _check_identity(path, header, cfg, fingerprint)
    arrays = _arrays(path, header, payload, "dspark.")
    if not arrays:
        return None
    state = dspark.init_state(cfg, 1)
    expect = _ring_arrays(state, 0)
    if set(arrays) != set(expect):
        raise PrefixCacheError(f"prefix cache {path} holds DSpark rings {sorted(arrays)}, expected {sorted(expect)} "
                               f"for this config's {cfg.n_mtp_layers} drafter stages")
    for name, ref in expect.items():
        if arrays[name].shape != ref.shape or arrays[name].dtype != ref.dtype:
            raise PrefixCacheError(f"prefix cache {path}: array {name} is {arrays[name].dtype}{list(arrays[name].shape)}, "
                                   f"expected {ref.dtype}{list(ref.shape)}")
    rings = [type(ring)(*(jnp.asarray(arrays[f"dspark.ring{i}.{f}"])[None] for f in ring._fields))
             for i, ring in enumerate(state["rings"])]
    return {**state, "rings": rings}


def load_prefix(path, cfg: ModelConfig, *, fingerprint: str, capacity: int | None = None, min_capacity: int = 256):
    """Read a prefix cache into a fresh one-row cache. Returns (cache, tokens int32 [N]).

    fingerprint: `model_fingerprint` of the weights that will continue from the cache; a file
    written by other weights (or with no fingerprint) is refused. `UNCHECKED` skips the check.
    The window rings are empty: rebuild them with `replay_window` on the last window of tokens.
    """
    fingerprint = _checked_fingerprint(fingerprint, "load_prefix")
    path = pathlib.Path(path)
    header, payload = _read(path)
    _check_identity(path, header, cfg, fingerprint)
    n = _check_counts(path, header)
    capacity = capacity or capacity_for(cfg, n, min_capacity, maximum=max(n, cfg.max_seq_len))
    if n > capacity:
        raise PrefixCacheError(f"prefix cache {path} holds {n} tokens, more than the capacity {capacity}")
    arrays = _arrays(path, header, payload)
    cache = empty_cache(cfg, 1, capacity)
    expect = _global_arrays(cfg, cache, 0, n)
    missing = sorted(set(expect) - set(arrays))
    if missing or "tokens" not in arrays:
        raise PrefixCacheError(f"prefix cache {path} lacks arrays {missing or ['tokens']}")
    for name, ref in expect.items():
        if arrays[name].shape != ref.shape or arrays[name].dtype != ref.dtype:
            raise PrefixCacheError(f"prefix cache {path}: array {name} is {arrays[name].dtype}{list(arrays[name].shape)}, "
                                   f"expected {ref.dtype}{list(ref.shape)} for {n} tokens")
    tokens = arrays["tokens"]
    if tokens.shape != (n,):
        raise PrefixCacheError(f"prefix cache {path}: tokens have shape {tokens.shape}, expected ({n},)")
    for part in ("compressed", "index_keys"):
        for key, container in cache[part].items():
            g = n // cfg.compress_ratios[int(key[5:])]
            cache[part][key] = type(container)(*(_set_rows(a, arrays[f"{part}.{key}.{f}"])
                                                 for f, a in zip(container._fields, container)))
    for key, state in cache["compressor"].items():
        cache["compressor"][key] = {k: jnp.asarray(arrays[f"compressor.{key}.{k}"])[None] for k in state}
    cache["length"] = jnp.full((1,), n, jnp.int32)
    cache["published"] = jnp.full((1,), header["published"], jnp.int32)
    return cache, tokens.copy()


def read_tokens(path, name: str = "tokens") -> np.ndarray:
    """The token ids a prefix-cache file holds (framing and the tokens' checksum verified; the
    cache arrays are checked by `load_prefix`). name="match_key": the key conversation caches
    match on (`save_prefix`'s match_key; the token ids when the file has none)."""
    path = pathlib.Path(path)
    header, payload = _read(path)
    entry = next((e for e in header["arrays"] if e["name"] == name), None)
    if entry is None and name == "match_key":
        return read_tokens(path)
    if entry is None:
        raise PrefixCacheError(f"prefix cache {path} lacks its {name}")
    data = payload[entry["offset"]:entry["offset"] + entry["nbytes"]]
    if _sha(data) != entry["sha256"]:
        raise PrefixCacheError(f"prefix cache {path} is corrupt: its {name} fails its checksum")
    return np.frombuffer(data, dtype=np.int32).copy()
