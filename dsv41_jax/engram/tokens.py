"""The Engram token map: raw tokenizer ids -> compressed ids (docs/REFERENCE.md §3 "Engram").

Tokens whose text normalises alike ("The", " the", "THE") share one compressed id, and the
n-gram hashes are taken over those ids. The compressed vocabulary size also fixes the hash
multipliers, so a map built with a different normalisation rehashes every table row.
Normalisation follows the reference (engram.py: build_compressed_token_map): NFKC, NFD,
strip accents, lowercase, collapse runs of space/tab/CR/LF to one space, strip, except that
a text which is exactly one space after collapsing stays " ". Texts containing U+FFFD
(partial UTF-8 byte tokens) are keyed by their raw token string instead.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

_REPLACEMENT_CHAR = "\ufffd"
# a private-use character standing in for a lone space while Strip runs (reference engram.py)
_LONE_SPACE_SENTINEL = "\ue000"

_normalizer = None


def _get_normalizer():
    """The tokenizers-library pipeline, built once; the Rust normalisers are the reference's."""
    global _normalizer
    if _normalizer is None:
        from tokenizers import Regex, normalizers

        _normalizer = normalizers.Sequence(
            [
                normalizers.NFKC(),
                normalizers.NFD(),
                normalizers.StripAccents(),
                normalizers.Lowercase(),
                normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
                normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
                normalizers.Strip(),
                normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
            ]
        )
    return _normalizer


def normalize_token_text(text: str) -> str:
    """The normalised form of one decoded token text (may be empty)."""
    return _get_normalizer().normalize_str(text)


def token_key(text: str, raw_token: str | None = None) -> str:
    """The string that decides a token's compressed id.

    Partial UTF-8 tokens decode to U+FFFD and would all collide, so they keep their raw
    token string; texts that normalise to nothing keep their decoded text.
    """
    if _REPLACEMENT_CHAR in text:
        return raw_token if raw_token is not None else text
    return normalize_token_text(text) or text


def token_map_from_texts(
    texts: Sequence[str], raw_tokens: Sequence[str | None] | None = None
) -> tuple[np.ndarray, int]:
    """Compressed ids handed out in first-seen order of key over ids 0, 1, 2, ...

    texts[i] is token i decoded on its own (special tokens kept); raw_tokens[i] its
    vocabulary string, needed only for texts containing U+FFFD.
    Returns (int64 map [len(texts)], compressed vocabulary size).
    """
    if raw_tokens is not None and len(raw_tokens) != len(texts):
        raise ValueError(f"raw_tokens has {len(raw_tokens)} entries but texts has {len(texts)}")
    ids_by_key: dict[str, int] = {}
    token_map = np.empty(len(texts), dtype=np.int64)
    for token_id, text in enumerate(texts):
        key = token_key(text, None if raw_tokens is None else raw_tokens[token_id])
        token_map[token_id] = ids_by_key.setdefault(key, len(ids_by_key))
    return token_map, len(ids_by_key)


def _load_backend(tokenizer):
    """Accept a tokenizers.Tokenizer, a HF fast tokenizer, or a path to tokenizer.json."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(os.fspath(tokenizer))
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def build_token_map(tokenizer_or_texts) -> tuple[np.ndarray, int]:
    """(int64 map [vocab], compressed vocab size) from a tokenizer or decoded token texts.

    tokenizer_or_texts: a `tokenizers.Tokenizer`, a HF fast tokenizer, a path to
    tokenizer.json, or a sequence of per-token decoded strings. Decoding uses the raw Rust
    tokenizer with special tokens kept, as the reference does (no clean-up of spaces).
    """
    if isinstance(tokenizer_or_texts, Sequence) and not isinstance(tokenizer_or_texts, str):
        return token_map_from_texts(list(tokenizer_or_texts))
    backend = _load_backend(tokenizer_or_texts)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    raw_tokens = [backend.id_to_token(i) if _REPLACEMENT_CHAR in t else None for i, t in enumerate(texts)]
    missing = [i for i, t in enumerate(texts) if _REPLACEMENT_CHAR in t and raw_tokens[i] is None]
    if missing:
        raise ValueError(f"tokenizer has no token string for ids {missing[:5]} (vocab ids must be contiguous)")
    return token_map_from_texts(texts, raw_tokens)
