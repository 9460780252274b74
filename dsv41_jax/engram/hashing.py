"""Engram n-gram hashing on the host, exact in int64 (docs/REFERENCE.md §3 "Engram").

The hash ids depend only on token ids, so they are computed here with numpy before the
device step and passed in as int64 indices into the Engram tables. Products of compressed
ids and multipliers reach ~2^62 by design, so every array here is int64; an int32 (or a
JAX computation without x64) would silently wrap and fetch the wrong rows.

Layout of the result of `hash_ids`: `[B, T, n_layers, (max_ngram_size - 1) * n_heads]`,
columns **order-major**: column `(n - 2) * n_heads + h` is head h of the n-gram ending at
the position (n = 2 .. max_ngram_size), already offset into that layer's table. This is the
layout of the reference's `hash_ids[..., layer, :]` that feeds the table lookup
(reference engram.py: NgramHashState.forward concatenates orders, each over heads).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# A raw id in `history` meaning "no token here": before the sequence start, or a dead
# (image-span) token. Either one stops the look-back, so both hash as the compressed pad.
NO_TOKEN = -1

_INT64_MAX = np.iinfo(np.int64).max
# reference engram.py: compute_hash_multipliers seeds numpy's default_rng with 10007 * layer id
_RNG_SEED_PER_LAYER = 10007


def _primes_up_to(limit: int) -> np.ndarray:
    """Plain sieve; only used for the small base primes of the windowed sieve."""
    if limit < 2:
        return np.zeros(0, dtype=np.int64)
    is_prime = np.ones(limit + 1, dtype=bool)
    is_prime[:2] = False
    for p in range(2, math.isqrt(limit) + 1):
        if is_prime[p]:
            is_prime[p * p :: p] = False
    return np.flatnonzero(is_prime).astype(np.int64)


def consecutive_primes(start: int, count: int) -> np.ndarray:
    """The `count` smallest primes >= `start`, ascending (int64).

    Why a windowed sieve: the release searches from 16,000,000, and the layout needs 48
    consecutive primes there; sieving a window of a few thousand numbers is instant,
    whereas testing candidates one by one in Python is slow.
    """
    if count < 0:
        raise ValueError(f"consecutive_primes: count must be >= 0, got {count}")
    found: list[np.ndarray] = []
    n_found = 0
    low = max(int(start), 2)
    # the prime gap near x averages ln x, so this window usually suffices in one pass
    width = max(256, int(2 * count * (math.log(low) + 1)))
    while n_found < count:
        high = low + width  # window [low, high)
        candidate = np.ones(width, dtype=bool)
        for p in _primes_up_to(math.isqrt(high - 1)).tolist():
            first = max(p * p, -(-low // p) * p)
            candidate[first - low :: p] = False
        primes = low + np.flatnonzero(candidate).astype(np.int64)
        found.append(primes)
        n_found += primes.size
        low = high
    return np.concatenate(found)[:count] if found else np.zeros(0, dtype=np.int64)


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd per-(layer, look-back) multipliers, int64 [n_layers, max_ngram_size].

    Bounded by int64_max // compressed_vocab_size so that compressed_id * multiplier
    cannot overflow int64 (reference engram.py: compute_hash_multipliers).
    """
    if compressed_vocab_size < 1:
        raise ValueError(f"compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
    bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(_RNG_SEED_PER_LAYER * int(layer_id))
        draws = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(draws * 2 + 1)
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, max_ngram_size), np.int64)


def _frozen_int64(values, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """An int64 copy that cannot be mutated, so a layout stays what it was built as."""
    array = np.array(values, dtype=np.int64)
    if array.shape != shape:
        raise ValueError(f"EngramLayout.{name}: expected shape {shape}, got {array.shape}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class EngramLayout:
    """Where every (layer, n-gram order, head) hash lands in the Engram tables.

    Each (order, head) pair of a layer owns a prime-sized bucket range; the ranges are laid
    end to end (order-major), so a layer's table has sum(primes of that layer) rows.
    eq=False because numpy fields make dataclass equality ambiguous; compare fields instead.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    pad_id: int  # raw tokenizer id; its compressed id fills look-back slots with no token
    compressed_vocab_size: int
    primes: np.ndarray  # int64 [n_layers, max_ngram_size - 1, n_heads]
    offsets: np.ndarray  # int64 [n_layers, (max_ngram_size - 1) * n_heads], order-major
    multipliers: np.ndarray  # int64 [n_layers, max_ngram_size]; column s multiplies tok_{t-s}

    def __post_init__(self):
        n_layers, n_orders = len(self.layer_ids), self.max_ngram_size - 1
        if self.max_ngram_size < 2:
            raise ValueError(f"EngramLayout: max_ngram_size must be >= 2 (2-grams upward), got {self.max_ngram_size}")
        if self.n_heads < 1:
            raise ValueError(f"EngramLayout: n_heads must be >= 1, got {self.n_heads}")
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        object.__setattr__(self, "primes", _frozen_int64(self.primes, "primes", (n_layers, n_orders, self.n_heads)))
        object.__setattr__(self, "offsets", _frozen_int64(self.offsets, "offsets", (n_layers, n_orders * self.n_heads)))
        object.__setattr__(
            self, "multipliers", _frozen_int64(self.multipliers, "multipliers", (n_layers, self.max_ngram_size))
        )
        expected_offsets = _exclusive_cumsum(self.primes)
        if not np.array_equal(self.offsets, expected_offsets):
            raise ValueError(
                "EngramLayout: offsets must be the running sum of each layer's primes in order-major order; "
                f"got {self.offsets.tolist()}, expected {expected_offsets.tolist()}"
            )
        if np.any(self.multipliers <= 0) or np.any(self.multipliers % 2 == 0):
            raise ValueError(f"EngramLayout: multipliers must be positive and odd, got {self.multipliers.tolist()}")
        largest_safe = _INT64_MAX // max(1, self.compressed_vocab_size)
        if np.any(self.multipliers > largest_safe):
            raise ValueError(
                f"EngramLayout: a multiplier exceeds int64_max // compressed_vocab_size = {largest_safe}, "
                "so compressed_id * multiplier could overflow int64"
            )

    @property
    def n_hash_cols(self) -> int:
        """Table rows fetched per position and layer: one per (order, head)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Rows of each layer's table: the sum of that layer's primes."""
        return tuple(int(s) for s in self.primes.reshape(len(self.layer_ids), -1).sum(axis=1))

    @classmethod
    def build(
        cls,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        head_dim: int,
        engram_vocab_size: int,
        compressed_vocab_size: int,
        pad_id: int,
    ) -> "EngramLayout":
        """Derive primes, offsets and multipliers the way the reference does.

        The reference restarts the search at engram_vocab_size for every (layer, order) but
        never hands out a prime twice, walking (layer, order, head) in that order. That
        always yields the next unused prime, so the flat list is simply the consecutive
        primes >= engram_vocab_size (reference engram.py: EngramLayout.from_args).
        """
        if max_ngram_size < 2 or n_heads < 1:
            raise ValueError(
                f"EngramLayout.build: need max_ngram_size >= 2 and n_heads >= 1, got {max_ngram_size}, {n_heads}"
            )
        n_layers, n_orders = len(layer_ids), max_ngram_size - 1
        flat = consecutive_primes(engram_vocab_size, n_layers * n_orders * n_heads)
        primes = flat.reshape(n_layers, n_orders, n_heads)
        return cls(
            layer_ids=tuple(layer_ids),
            max_ngram_size=max_ngram_size,
            n_heads=n_heads,
            head_dim=head_dim,
            pad_id=pad_id,
            compressed_vocab_size=compressed_vocab_size,
            primes=primes,
            offsets=_exclusive_cumsum(primes),
            multipliers=hash_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
        )

    @classmethod
    def from_model_args(cls, args: Mapping) -> "EngramLayout | None":
        """Build from a config dict with the reference `ModelArgs` field names; None without Engram."""
        if not args.get("engram_layer_ids"):
            return None
        return cls.build(
            layer_ids=args["engram_layer_ids"],
            max_ngram_size=args["engram_max_ngram_size"],
            n_heads=args["engram_n_heads"],
            head_dim=args["engram_head_dim"],
            engram_vocab_size=args["engram_vocab_size"],
            compressed_vocab_size=args["engram_compressed_vocab_size"],
            pad_id=args.get("engram_pad_id", 2),
        )

    @classmethod
    def from_golden_json(cls, engram: Mapping, model_args: Mapping) -> "EngramLayout":
        """Take primes, offsets and multipliers as stored in a golden `config.json: engram`.

        The sizes (layer ids, orders, heads, pad) come from the same file's `model_args`.
        """
        missing = [k for k in ("primes", "offsets", "multipliers", "compressed_vocab_size") if k not in engram]
        if missing:
            raise KeyError(f"golden engram entry lacks {missing}; it has {sorted(engram)}")
        return cls(
            layer_ids=tuple(model_args["engram_layer_ids"]),
            max_ngram_size=model_args["engram_max_ngram_size"],
            n_heads=model_args["engram_n_heads"],
            head_dim=model_args["engram_head_dim"],
            pad_id=model_args.get("engram_pad_id", 2),
            compressed_vocab_size=int(engram["compressed_vocab_size"]),
            primes=engram["primes"],
            offsets=engram["offsets"],
            multipliers=engram["multipliers"],
        )

    def check_num_embeddings(self, engram_num_embeddings: Sequence[int]) -> None:
        """Raise if the configured table sizes disagree with this layout.

        A mismatch means the hash ids would index a table of another shape: the checkpoint,
        the config and the prime search disagree, and every lookup would be wrong.
        """
        configured = tuple(int(n) for n in engram_num_embeddings)
        if len(configured) != len(self.layer_ids):
            raise ValueError(
                f"engram_num_embeddings gives {len(configured)} table sizes for "
                f"{len(self.layer_ids)} Engram layers {self.layer_ids}; give one per layer"
            )
        for layer_id, derived, wanted in zip(self.layer_ids, self.num_embeddings, configured):
            if derived != wanted:
                raise ValueError(
                    f"Engram layer {layer_id}: the layout's primes sum to {derived} rows but "
                    f"engram_num_embeddings says {wanted}; check engram_vocab_size, engram_n_heads "
                    "and engram_max_ngram_size against the checkpoint"
                )


def _exclusive_cumsum(primes: np.ndarray) -> np.ndarray:
    """Start row of each (order, head) bucket range within its layer, order-major."""
    flat = np.asarray(primes, dtype=np.int64).reshape(primes.shape[0], -1)
    return np.cumsum(flat, axis=1, dtype=np.int64) - flat


def _as_int64_2d(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"{name} must be [batch, length], got shape {array.shape}")
    return array.astype(np.int64, copy=False)


def _history_columns(history, batch: int, depth: int) -> np.ndarray:
    """The last `depth` raw ids before the chunk, left-filled with NO_TOKEN where absent."""
    out = np.full((batch, depth), NO_TOKEN, dtype=np.int64)
    if history is None:
        return out
    history = _as_int64_2d(history, "history")
    if history.shape[0] != batch:
        raise ValueError(f"history has batch {history.shape[0]} but tokens have batch {batch}")
    keep = min(depth, history.shape[1])
    if keep:
        out[:, depth - keep :] = history[:, history.shape[1] - keep :]
    return np.where(out < 0, NO_TOKEN, out)


def _compress(raw: np.ndarray, token_map: np.ndarray, compressed_vocab_size: int) -> np.ndarray:
    """Raw ids -> compressed ids, keeping NO_TOKEN; rejects ids the map cannot take."""
    present = raw != NO_TOKEN  # callers have turned every other negative id into NO_TOKEN
    too_large = present & (raw >= token_map.shape[0])
    if np.any(too_large):
        raise ValueError(f"token id {int(raw[too_large][0])} is outside the token map (size {token_map.shape[0]})")
    compressed = np.where(present, token_map[np.where(present, raw, 0)], NO_TOKEN)
    out_of_range = present & ((compressed < 0) | (compressed >= compressed_vocab_size))
    if np.any(out_of_range):
        raise ValueError(
            f"token map yields compressed id {int(compressed[out_of_range][0])} outside "
            f"[0, {compressed_vocab_size}); products with the multipliers could overflow int64"
        )
    return compressed


def hash_ids(
    layout: EngramLayout,
    token_map,
    tokens,
    history=None,
    token_mask=None,
) -> np.ndarray:
    """Table row ids for every position, layer and (order, head): int64 [B, T, n_layers, n_hash_cols].

    tokens: raw ids [B, T]. history: raw ids of the positions just before `tokens`
    ([B, k], any k; the last max_ngram_size - 1 are used; NO_TOKEN or missing columns mean
    "before the sequence start"), so hashing a prompt in chunks equals hashing it whole.
    token_mask: optional bool [B, T], False for dead (image-span) tokens; look-back stops at
    them and at the sequence start, and the stopped slots hold the compressed pad
    (reference engram.py: NgramHashState.forward). Columns are order-major (module doc).
    """
    tokens = _as_int64_2d(tokens, "tokens")
    token_map = np.asarray(token_map)
    if token_map.ndim != 1 or not np.issubdtype(token_map.dtype, np.integer):
        raise ValueError(f"token_map must be a 1-D integer array, got shape {token_map.shape} dtype {token_map.dtype}")
    token_map = token_map.astype(np.int64, copy=False)
    if np.any(tokens < 0):
        raise ValueError(
            f"tokens must be non-negative raw ids, got {int(tokens.min())}; mark dead tokens with token_mask"
        )
    batch, length = tokens.shape
    depth = layout.max_ngram_size - 1
    if not 0 <= layout.pad_id < token_map.shape[0]:
        raise ValueError(f"pad id {layout.pad_id} is outside the token map (size {token_map.shape[0]})")
    pad = token_map[layout.pad_id]

    raw = tokens
    if token_mask is not None:
        token_mask = np.asarray(token_mask, dtype=bool)
        if token_mask.shape != tokens.shape:
            raise ValueError(f"token_mask shape {token_mask.shape} must equal tokens shape {tokens.shape}")
        raw = np.where(token_mask, tokens, NO_TOKEN)
    extended = np.concatenate([_history_columns(history, batch, depth), raw], axis=1)
    compressed = _compress(extended, token_map, layout.compressed_vocab_size)  # [B, depth + T]

    # looked_back[..., s] = compressed id at t - s, or pad once the look-back has hit a gap
    looked_back = np.empty((batch, length, layout.max_ngram_size), dtype=np.int64)
    stopped = np.zeros((batch, length), dtype=bool)
    for shift in range(layout.max_ngram_size):
        source = compressed[:, depth - shift : depth - shift + length]
        stopped |= source == NO_TOKEN
        looked_back[..., shift] = np.where(stopped, pad, source)

    # [B, T, n_layers, max_ngram_size]; below int64_max by the multiplier bound
    products = looked_back[:, :, None, :] * layout.multipliers[None, None, :, :]
    rolling = np.bitwise_xor.accumulate(products, axis=-1)[..., 1:]  # XOR of shifts 0..n-1 = n-gram hash
    buckets = rolling[..., :, None] % layout.primes[None, None, :, :, :]  # [B, T, L, orders, heads]
    return buckets.reshape(batch, length, len(layout.layer_ids), layout.n_hash_cols) + layout.offsets[None, None]


def next_history(layout: EngramLayout, tokens, history=None, token_mask=None) -> np.ndarray:
    """The `history` to pass with the chunk that follows `tokens`: int64 [B, max_ngram_size - 1].

    Dead tokens become NO_TOKEN, so an n-gram never reaches across them into the next chunk.
    """
    tokens = _as_int64_2d(tokens, "tokens")
    depth = layout.max_ngram_size - 1
    raw = tokens if token_mask is None else np.where(np.asarray(token_mask, dtype=bool), tokens, NO_TOKEN)
    extended = np.concatenate([_history_columns(history, tokens.shape[0], depth), raw], axis=1)
    return np.ascontiguousarray(extended[:, extended.shape[1] - depth :])
