"""The kernel-facing cache layout: the one place that says how cached KV is stored.

Every cached tensor is stored quantized, in the byte formats of docs/REFERENCE.md §4, so that
the model, the Pallas kernels and the byte accounting all read the same thing:

- window ring (per layer): E4M3 values + one E8M0 byte per 32 dims  -> 512 + 16 = 528 B
- compressed KV (per KV source): packed E2M1 + one E4M3 scale per 16 -> 256 + 32 = 288 B
- index keys (per KV source): packed E2M1 + one E8M0 byte per 32     ->  64 +  4 =  68 B

The serving engine's packed, paged layout replaces these containers; kernels and
model code only go through the constructors and dequantizers below. A cache may also hold the same
bytes as the TPU kernels' 32-bit word view ("kernel views" below: `WindowWords`, `CompressedWords`,
`IndexKeyWords`), so that the kernels read it as stored; every function here takes either form.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import quant


class WindowKV(NamedTuple):
    """FP8 window entries: values [..., D] float8_e4m3fn, scales [..., D/32] uint8 (E8M0)."""

    values: jax.Array
    scales: jax.Array


class CompressedKV(NamedTuple):
    """FP4 compressed entries: packed [..., D/2] uint8 (E2M1 pairs), scales [..., D/16] float8_e4m3fn."""

    packed: jax.Array
    scales: jax.Array


class IndexKeys(NamedTuple):
    """MXFP4 index keys: packed [..., Di/2] uint8, scales [..., Di/32] uint8 (E8M0)."""

    packed: jax.Array
    scales: jax.Array


def quantize_window(x: jax.Array) -> WindowKV:
    return WindowKV(*quant.quant_fp8_act(x, 32))


def dequantize_window(w) -> jax.Array:
    w = bytes_of(w)
    return quant.dequant_fp8_act(w.values, w.scales, 32)


def quantize_compressed(x: jax.Array) -> CompressedKV:
    return CompressedKV(*quant.quant_fp4_kv(x, 16))


def dequantize_compressed(c) -> jax.Array:
    c = bytes_of(c)
    return quant.dequant_fp4_kv(c.packed, c.scales, 16)


def quantize_index_keys(x: jax.Array) -> IndexKeys:
    return IndexKeys(*quant.quant_fp4_mx(x, 32))


def dequantize_index_keys(k) -> jax.Array:
    k = bytes_of(k)
    return quant.dequant_fp4_mx(k.packed, k.scales, 32)


def empty_window(batch: int, slots: int, dim: int) -> WindowKV:
    return WindowKV(jnp.zeros((batch, slots, dim), jnp.float8_e4m3fn), jnp.zeros((batch, slots, dim // 32), jnp.uint8))


def empty_compressed(batch: int, entries: int, dim: int) -> CompressedKV:
    return CompressedKV(jnp.zeros((batch, entries, dim // 2), jnp.uint8), jnp.zeros((batch, entries, dim // 16), jnp.float8_e4m3fn))


def empty_index_keys(batch: int, entries: int, dim: int) -> IndexKeys:
    return IndexKeys(jnp.zeros((batch, entries, dim // 2), jnp.uint8), jnp.zeros((batch, entries, dim // 32), jnp.uint8))


def row_bytes(container: tuple) -> int:
    """Bytes of one cached row (last axis) of a layout container, from its dtypes and shapes."""
    return sum(int(a.shape[-1]) * jnp.dtype(a.dtype).itemsize for a in container)


# ----------------------------------------------------------------------------- kernel views
#
# What the Pallas kernels (pallas_kernels/) read. Keeping these here means the serving issue's
# packed, paged layout only has to provide the same views (ideally as stored arrays, so the views
# cost nothing).
#
# TPU view ("words"): Mosaic DMAs and vector ops are safest on 32-bit data, so every row is
# regrouped into uint32 words. Element e = 8j + n of a row (n in 0..7) sits in "plane" n, lane j:
#   - window values: `low` word j holds the E4M3 bytes of elements 8j..8j+3 (byte n = element
#     8j+n), `high` word j those of 8j+4..8j+7;
#   - FP4 rows (compressed KV, index keys): word j holds packed bytes 4j..4j+3, so its nibble n
#     (from the least significant end) is element 8j+n;
#   - scale bytes are zero-padded to a multiple of 4 and packed 4 per word, byte t in bits 8t..8t+7.
# Kernels permute queries into the same plane order and the output back.
# On TPU, building these views from the uint8/float8 containers above is a relayout copy of the
# whole cache (8-bit and 32-bit arrays are tiled differently in HBM); a stored word layout avoids it:
# a cache made with `words=True` (`model.cache.init_cache`) holds these views, the kernels read them
# as they are, and new rows are converted on their way in (`like`: only the rows written).
#
# GPU view ("bytes"): the raw bytes as uint8, row-major, which Triton gathers directly.


class LayerRing(NamedTuple):
    """Layer `layer` (a traced index) of window rings held on a leading layer axis (each leaf of
    `rings` [L, B, W, ...]): one layer's ring, read and written where it lies (a scanned run of
    layers carries its rings stacked, `model.cache.RingStack`; the attention kernel reads its layer
    of them in place)."""

    rings: tuple  # a window container (`WindowKV` or `WindowWords`), stacked
    layer: jax.Array


def ring_rows(ring):
    """A window container's rows [B, W, ...]: a `LayerRing`'s layer sliced out (a copy), else itself."""
    if isinstance(ring, LayerRing):
        return type(ring.rings)(*(jax.lax.dynamic_index_in_dim(a, ring.layer, keepdims=False) for a in ring.rings))
    return ring


class WindowWords(NamedTuple):
    """Window rows as uint32: low/high [..., D/8] (elements 8j..8j+3 / 8j+4..8j+7), scales [..., ceil(D/128)]."""

    low: jax.Array
    high: jax.Array
    scales: jax.Array


class Fp4Words(NamedTuple):
    """FP4 rows as uint32: packed [..., D/8] (nibble n of word j = element 8j+n), scales [..., ceil(nscales/4)]."""

    packed: jax.Array
    scales: jax.Array


class CompressedWords(Fp4Words):
    """`Fp4Words` of compressed KV rows (E4M3 scale bytes, one per 16 elements)."""

    __slots__ = ()


class IndexKeyWords(Fp4Words):
    """`Fp4Words` of index keys (E8M0 scale bytes, one per 32 elements)."""

    __slots__ = ()


def _pack_words(b: jax.Array) -> jax.Array:
    """uint8 [..., 4m] -> uint32 [..., m], byte t of each group in bits 8t..8t+7 (explicit, endian-free)."""
    b = b.astype(jnp.uint32).reshape(*b.shape[:-1], b.shape[-1] // 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _pad_to_words(b: jax.Array) -> jax.Array:
    pad = -b.shape[-1] % 4
    if pad:
        b = jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, pad)])
    return _pack_words(b)


def _check_dim(dim: int, what: str) -> None:
    if dim % 32:
        raise ValueError(f"{what}: the kernels need a row width that is a multiple of 32, got {dim}")


def window_words(w) -> WindowWords:
    """Kernel (TPU) view of window rows; see the section comment for the element order."""
    if isinstance(w, WindowWords):
        return w
    dim = int(w.values.shape[-1])
    _check_dim(dim, "window_words")
    values = jax.lax.bitcast_convert_type(w.values, jnp.uint8).reshape(*w.values.shape[:-1], dim // 8, 8)
    low = _pack_words(values[..., :4].reshape(*values.shape[:-2], dim // 2))
    high = _pack_words(values[..., 4:].reshape(*values.shape[:-2], dim // 2))
    return WindowWords(low, high, _pad_to_words(w.scales))


def _fp4_words(kind, packed: jax.Array, scales: jax.Array, what: str) -> Fp4Words:
    _check_dim(2 * int(packed.shape[-1]), what)
    if scales.dtype != jnp.uint8:
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    return kind(_pack_words(packed), _pad_to_words(scales))


def compressed_words(c) -> CompressedWords:
    """Kernel (TPU) view of compressed rows: FP4 words plus E4M3 scale bytes packed in words."""
    if isinstance(c, CompressedWords):
        return c
    return _fp4_words(CompressedWords, c.packed, c.scales, "compressed_words")


def index_key_words(k) -> IndexKeyWords:
    """Kernel (TPU) view of index keys: FP4 words plus E8M0 scale bytes packed in words."""
    if isinstance(k, IndexKeyWords):
        return k
    return _fp4_words(IndexKeyWords, k.packed, k.scales, "index_key_words")


def _unpack_words(w: jax.Array, n: int) -> jax.Array:
    """Inverse of `_pad_to_words`: uint32 [..., m] -> its first n bytes, uint8 [..., n]."""
    b = jnp.stack([(w >> (8 * t)) & 0xFF for t in range(4)], -1).astype(jnp.uint8)
    return b.reshape(*w.shape[:-1], 4 * w.shape[-1])[..., :n]


def bytes_of(c):
    """The byte container of a word view (the inverse of `words_of`, bit for bit); a byte container as is."""
    if isinstance(c, WindowWords):
        lanes = int(c.low.shape[-1])
        low, high = _unpack_words(c.low, 4 * lanes), _unpack_words(c.high, 4 * lanes)
        values = jnp.concatenate([low.reshape(*low.shape[:-1], lanes, 4), high.reshape(*high.shape[:-1], lanes, 4)], -1)
        values = jax.lax.bitcast_convert_type(values.reshape(*low.shape[:-1], 8 * lanes), jnp.float8_e4m3fn)
        return WindowKV(values, _unpack_words(c.scales, 8 * lanes // 32))
    if isinstance(c, CompressedWords):
        lanes = int(c.packed.shape[-1])
        scales = jax.lax.bitcast_convert_type(_unpack_words(c.scales, 8 * lanes // 16), jnp.float8_e4m3fn)
        return CompressedKV(_unpack_words(c.packed, 4 * lanes), scales)
    if isinstance(c, IndexKeyWords):
        lanes = int(c.packed.shape[-1])
        return IndexKeys(_unpack_words(c.packed, 4 * lanes), _unpack_words(c.scales, 8 * lanes // 32))
    if isinstance(c, (WindowKV, CompressedKV, IndexKeys)):
        return c
    raise TypeError(f"bytes_of: not a cache container: {type(c).__name__}")


def words_of(c):
    """The TPU kernels' word view of a container (`WindowWords`, `CompressedWords`, `IndexKeyWords`); a view as is."""
    if isinstance(c, (WindowKV, WindowWords)):
        return window_words(c)
    if isinstance(c, (CompressedKV, CompressedWords)):
        return compressed_words(c)
    if isinstance(c, (IndexKeys, IndexKeyWords)):
        return index_key_words(c)
    raise TypeError(f"words_of: not a cache container: {type(c).__name__}")


def is_words(c) -> bool:
    """Whether a container is a word view (what a `words=True` cache holds)."""
    return isinstance(c, (WindowWords, Fp4Words))


def like(ref, c):
    """Container c in the form of ref (bytes or words): how rows are written into a stored cache."""
    return words_of(c) if is_words(ref) else bytes_of(c)


def dim_of(c) -> int:
    """The row width D (elements) of a container in either form."""
    if isinstance(c, WindowWords):
        return 8 * int(c.low.shape[-1])
    if isinstance(c, WindowKV):
        return int(c.values.shape[-1])
    return (8 if is_words(c) else 2) * int(c.packed.shape[-1])


def window_bytes(w) -> tuple[jax.Array, jax.Array]:
    """Kernel (GPU) view: (E4M3 values as uint8 [..., D], E8M0 scales uint8 [..., D/32])."""
    w = bytes_of(w)
    return jax.lax.bitcast_convert_type(w.values, jnp.uint8), w.scales


def compressed_bytes(c) -> tuple[jax.Array, jax.Array]:
    """Kernel (GPU) view: (packed FP4 uint8 [..., D/2], E4M3 scales as uint8 [..., D/16])."""
    c = bytes_of(c)
    return c.packed, jax.lax.bitcast_convert_type(c.scales, jnp.uint8)


def index_key_bytes(k) -> tuple[jax.Array, jax.Array]:
    """Kernel (GPU) view: (packed FP4 uint8 [..., Di/2], E8M0 scales uint8 [..., Di/32])."""
    k = bytes_of(k)
    return k.packed, k.scales


# ----------------------------------------------------------------------------- container helpers
# Row-level operations on the containers above, used when the model hands caches to the kernels
# (which read quantized rows, never dequantized copies). They act on every array of a container
# alike, so they commute with dequantization: dequantize(op(c)) == op(dequantize(c)).


def concat_rows(a, b):
    """Containers of the same kind joined along the row axis (axis 1): [B, Na + Nb, ...], in a's form."""
    if type(bytes_of(a)) is not type(bytes_of(b)):
        raise TypeError(f"concat_rows: containers differ: {type(a).__name__} vs {type(b).__name__}")
    b = like(a, b)
    return type(a)(*(jnp.concatenate([x, y.astype(x.dtype)], axis=1) for x, y in zip(a, b)))


def resize_rows(c, n: int):
    """The first n rows of a container, zero rows appended when it has fewer (zero bytes decode to 0)."""
    def one(x):
        have = x.shape[1]
        if have >= n:
            return x[:, :n]
        return jnp.pad(x, [(0, 0), (0, n - have)] + [(0, 0)] * (x.ndim - 2))

    return type(c)(*(one(x) for x in c))


def where_batch(pred: jax.Array, a, b):
    """Per batch entry (pred [B] bool): rows of container a where pred, else of b."""
    return type(a)(*(jnp.where(pred.reshape((-1,) + (1,) * (x.ndim - 1)), x, y) for x, y in zip(a, b)))
