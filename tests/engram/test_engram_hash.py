"""Engram hashing: layout derivation, golden hash ids bit for bit, chunking, int64 safety, token map."""
import json
import math
import pathlib
import re
import unicodedata

import numpy as np
import pytest

from dsv41_jax.engram.hashing import (
    NO_TOKEN,
    EngramLayout,
    consecutive_primes,
    hash_ids,
    next_history,
)
from dsv41_jax.engram.tokens import build_token_map, normalize_token_text, token_map_from_texts

REFERENCE_CONFIG = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "reference" / "inference_config.json"


@pytest.fixture(scope="module")
def engram_golden(golden_root):
    folder = golden_root / "engram_fp8"
    if not folder.is_dir():
        pytest.skip(f"{folder} not found")
    config = json.loads((folder / "config.json").read_text())
    return folder, config["model_args"], config["engram"]


@pytest.fixture(scope="module")
def traced_case(engram_golden):
    """tokens and stored hash ids of the case that carries intermediates."""
    from safetensors import safe_open

    folder = engram_golden[0]
    cases = json.loads((folder / "cases.json").read_text())["cases"]
    case = next(c for c in cases if c["has_intermediates"])
    name = "trace.engram_hash_ids"
    assert name in case["tensors"], sorted(case["tensors"])
    assert case["tensors"][name]["dtype"] == "I64"
    with safe_open(str(folder / case["file"]), "numpy") as f:
        tokens, ids = f.get_tensor("tokens"), f.get_tensor(name)
    assert tokens.tolist() == case["tokens"]
    return tokens.astype(np.int64), ids


@pytest.fixture(scope="module")
def release_args():
    if not REFERENCE_CONFIG.is_file():
        pytest.skip(f"{REFERENCE_CONFIG} not found")
    return json.loads(REFERENCE_CONFIG.read_text())


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _scalar_hash_ids(layout, token_map, tokens, mask=None):
    """Oracle straight from docs/REFERENCE.md §3 with Python ints (no overflow possible), one position at a time."""
    n_layers, n_max = len(layout.layer_ids), layout.max_ngram_size
    pad = int(token_map[layout.pad_id])
    out = np.zeros((len(tokens), n_layers, layout.n_hash_cols), dtype=object)
    for t in range(len(tokens)):
        window, stopped = [], False
        for k in range(n_max):
            dead = t - k < 0 or (mask is not None and not mask[t - k])
            stopped = stopped or dead
            window.append(pad if stopped else int(token_map[tokens[t - k]]))
        for li in range(n_layers):
            mult = [int(m) for m in layout.multipliers[li]]
            value = 0
            for n in range(2, n_max + 1):
                value = 0
                for k in range(n):
                    value ^= window[k] * mult[k]
                for h in range(layout.n_heads):
                    col = (n - 2) * layout.n_heads + h
                    out[t, li, col] = value % int(layout.primes[li, n - 2, h]) + int(layout.offsets[li, col])
    assert all(int(v) < 2**63 for v in out.ravel())
    return out.astype(np.int64)


# --- layout ------------------------------------------------------------------------------


def test_build_reproduces_golden_layout(engram_golden):
    _, args, engram = engram_golden
    layout = EngramLayout.build(
        layer_ids=args["engram_layer_ids"],
        max_ngram_size=args["engram_max_ngram_size"],
        n_heads=args["engram_n_heads"],
        head_dim=args["engram_head_dim"],
        engram_vocab_size=args["engram_vocab_size"],
        compressed_vocab_size=args["engram_compressed_vocab_size"],
        pad_id=args["engram_pad_id"],
    )
    assert layout.primes.dtype == np.int64 and layout.multipliers.dtype == np.int64
    assert layout.primes.tolist() == engram["primes"]
    assert layout.offsets.tolist() == engram["offsets"]
    assert layout.multipliers.tolist() == engram["multipliers"]
    assert layout.num_embeddings == (3688, 3904) == tuple(args["engram_num_embeddings"])
    layout.check_num_embeddings(args["engram_num_embeddings"])
    stored = EngramLayout.from_golden_json(engram, args)
    for field in ("primes", "offsets", "multipliers"):
        assert np.array_equal(getattr(stored, field), getattr(layout, field))
    assert stored.compressed_vocab_size == engram["compressed_vocab_size"]


def test_num_embeddings_mismatch_names_the_layer(engram_golden):
    _, args, _ = engram_golden
    layout = EngramLayout.from_model_args(args)
    with pytest.raises(ValueError, match=r"Engram layer 3: .*3904.*3905"):
        layout.check_num_embeddings([3688, 3905])
    with pytest.raises(ValueError, match="1 table sizes for 2 Engram layers"):
        layout.check_num_embeddings([3688])


def test_bad_golden_offsets_are_rejected(engram_golden):
    _, args, engram = engram_golden
    broken = dict(engram, offsets=[[0] * 6, [0] * 6])
    with pytest.raises(ValueError, match="running sum"):
        EngramLayout.from_golden_json(broken, args)


def test_prime_order_matches_a_literal_search():
    """The reference restarts the search per (layer, order) and skips used primes; build() claims
    that equals consecutive primes. Check against that search done literally with trial division."""
    layer_ids, max_ngram, heads, start = (2, 5, 7), 4, 3, 50
    seen, expected = set(), []
    for _ in layer_ids:
        for _ in range(max_ngram - 1):
            current = start - 1
            for _ in range(heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                expected.append(current)
    layout = EngramLayout.build(layer_ids, max_ngram, heads, 8, start, 97, 2)
    assert layout.primes.ravel().tolist() == expected


def test_consecutive_primes_against_trial_division():
    for start, count in ((0, 30), (2, 5), (600, 12), (7919, 40), (10**9, 6)):
        primes = consecutive_primes(start, count).tolist()
        assert len(primes) == count and primes == sorted(set(primes))
        assert all(_is_prime(p) for p in primes)
        gaps = [n for n in range(max(start, 0), primes[-1]) if n not in primes]
        assert not any(_is_prime(n) for n in gaps)


def test_release_layout_matches_configured_table_sizes(release_args):
    layout = EngramLayout.from_model_args(release_args)
    assert layout.num_embeddings == (384006168, 384016682) == tuple(release_args["engram_num_embeddings"])
    layout.check_num_embeddings(release_args["engram_num_embeddings"])
    flat = layout.primes.ravel().tolist()
    assert len(flat) == 2 * 3 * 8 and flat[0] >= 16_000_000 and all(_is_prime(p) for p in flat)
    assert not any(_is_prime(n) for n in range(16_000_000, flat[-1]) if n not in flat)


def test_multipliers_need_int64(engram_golden, release_args):
    """A dtype regression to int32 cannot pass: the multipliers alone exceed 2^31."""
    for layout in (EngramLayout.from_model_args(engram_golden[1]), EngramLayout.from_model_args(release_args)):
        assert layout.multipliers.dtype == np.int64
        assert int(layout.multipliers.min()) > 2**31
        largest_product = int(layout.multipliers.max()) * (layout.compressed_vocab_size - 1)
        assert 2**62 <= largest_product < 2**63


# --- hashing -----------------------------------------------------------------------------


def test_hash_ids_match_golden_trace(engram_golden, traced_case):
    _, args, engram = engram_golden
    tokens, expected = traced_case
    token_map = np.asarray(engram["token_map"])
    assert token_map[args["engram_pad_id"]] == engram["pad_compressed_id"]
    for layout in (EngramLayout.from_golden_json(engram, args), EngramLayout.from_model_args(args)):
        got = hash_ids(layout, token_map, tokens[None].astype(np.int32))
        assert got.dtype == np.int64
        assert got.shape == (1,) + expected.shape
        np.testing.assert_array_equal(got[0], expected)


def test_hash_ids_match_scalar_oracle_with_dead_tokens(engram_golden):
    _, args, engram = engram_golden
    layout = EngramLayout.from_model_args(args)
    token_map = np.asarray(engram["token_map"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, len(token_map), size=(2, 23))
    mask = np.ones_like(tokens, dtype=bool)
    mask[0, [0, 5, 6, 15]] = False
    mask[1, 22] = False
    got = hash_ids(layout, token_map, tokens, token_mask=mask)
    for b in range(2):
        np.testing.assert_array_equal(got[b], _scalar_hash_ids(layout, token_map, tokens[b], mask[b]))
    unmasked = hash_ids(layout, token_map, tokens[1:])[0]
    np.testing.assert_array_equal(unmasked, _scalar_hash_ids(layout, token_map, tokens[1]))


@pytest.mark.parametrize("splits", [(1,), (3,), (1, 2, 3), (7, 8, 20, 39), tuple(range(1, 40))])
def test_chunked_equals_whole(engram_golden, traced_case, splits):
    _, args, engram = engram_golden
    layout = EngramLayout.from_golden_json(engram, args)
    token_map = np.asarray(engram["token_map"])
    tokens = traced_case[0][None]
    mask = np.ones_like(tokens, dtype=bool)
    mask[0, [4, 17, 18]] = False
    for token_mask in (None, mask):
        whole = hash_ids(layout, token_map, tokens, token_mask=token_mask)
        pieces, history = [], None
        for lo, hi in zip((0,) + splits, splits + (tokens.shape[1],)):
            chunk_mask = None if token_mask is None else token_mask[:, lo:hi]
            pieces.append(hash_ids(layout, token_map, tokens[:, lo:hi], history, chunk_mask))
            history = next_history(layout, tokens[:, lo:hi], history, chunk_mask)
        np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)
        if token_mask is None:  # the whole raw prefix is an equally valid history
            cut = splits[-1]
            np.testing.assert_array_equal(hash_ids(layout, token_map, tokens[:, cut:], tokens[:, :cut]), whole[:, cut:])


def test_short_history_means_sequence_start(engram_golden, traced_case):
    _, args, engram = engram_golden
    layout = EngramLayout.from_golden_json(engram, args)
    token_map, tokens = np.asarray(engram["token_map"]), traced_case[0][None]
    whole = hash_ids(layout, token_map, tokens)
    np.testing.assert_array_equal(hash_ids(layout, token_map, tokens[:, 1:], tokens[:, :1]), whole[:, 1:])
    padded = np.array([[NO_TOKEN, NO_TOKEN, tokens[0, 0]]])
    np.testing.assert_array_equal(hash_ids(layout, token_map, tokens[:, 1:], padded), whole[:, 1:])
    assert next_history(layout, tokens[:, :1]).tolist() == [[NO_TOKEN, NO_TOKEN, tokens[0, 0]]]


def test_long_prompt_chunks_with_release_layout(release_args):
    layout = EngramLayout.from_model_args(release_args)
    rng = np.random.default_rng(1)
    token_map = rng.integers(0, layout.compressed_vocab_size, size=release_args["vocab_size"])
    tokens = rng.integers(0, release_args["vocab_size"], size=(2, 20_000))
    whole = hash_ids(layout, token_map, tokens)
    assert whole.shape == (2, 20_000, 2, 24) and whole.dtype == np.int64
    upper = np.asarray(layout.offsets) + layout.primes.reshape(2, -1)
    assert np.all(whole >= layout.offsets) and np.all(whole < upper)
    first = hash_ids(layout, token_map, tokens[:, :12_345])
    rest = hash_ids(layout, token_map, tokens[:, 12_345:], next_history(layout, tokens[:, :12_345]))
    np.testing.assert_array_equal(np.concatenate([first, rest], axis=1), whole)
    np.testing.assert_array_equal(whole[1, :50], _scalar_hash_ids(layout, token_map, tokens[1, :50]))


def test_bad_inputs_raise(engram_golden):
    _, args, engram = engram_golden
    layout = EngramLayout.from_golden_json(engram, args)
    token_map = np.asarray(engram["token_map"])
    with pytest.raises(ValueError, match="outside the token map"):
        hash_ids(layout, token_map, [[1, 512]])
    with pytest.raises(ValueError, match="non-negative"):
        hash_ids(layout, token_map, [[1, -1]])
    with pytest.raises(ValueError, match="outside \\[0, 389\\)"):
        hash_ids(layout, np.full(512, 389), [[1, 2]])
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        hash_ids(layout, token_map, [1, 2])


# --- token map ---------------------------------------------------------------------------


def _normalize_oracle(text: str) -> str:
    """docs/REFERENCE.md §3 normalisation with the standard library."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn").lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    return text if text == " " else text.strip(" ")


NORMALISATION_CASES = [" The", "THE", "Café", "ｆｕｌｌ", "a \t\n b", " ", "\n\n", "  x  ", "ﬁ", "Ñandú", "Ⅻ", "x\r\ny"]


@pytest.mark.parametrize("text", NORMALISATION_CASES)
def test_normalisation_matches_stdlib_oracle(text):
    assert normalize_token_text(text) == _normalize_oracle(text)


def test_token_map_from_byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"Ã": 0, "©": 1, "ĠThe": 2, "the": 3, "Ġ": 4, "ĉ": 5, "THE": 6, "cafÃ©": 7, "cafe": 8}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    token_map, size = build_token_map(tokenizer)
    # partial UTF-8 bytes keep their raw strings (distinct); " The"/"the"/"THE" and "café"/"cafe" merge;
    # a lone space and a lone tab both normalise to " "
    assert token_map.dtype == np.int64
    assert token_map.tolist() == [0, 1, 2, 2, 3, 3, 2, 4, 4] and size == 5
    texts = [tokenizer.decode([i]) for i in range(len(vocab))]
    assert token_map_from_texts(texts)[1] == 4  # without raw strings the two U+FFFD tokens collide
