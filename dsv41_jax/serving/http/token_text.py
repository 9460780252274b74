"""How logprobs show a token: its text, or, when its bytes are not whole UTF-8 characters (a piece
of a multi-byte character, as byte-level BPE splits CJK text and emoji), OpenAI's form
`"bytes:\\xe4\\xb8"` with the bytes themselves in `bytes`; and the character offsets of tokens in
the text they make (`text_offset` of completions)."""
from __future__ import annotations

import functools

import tokenizers

from dsv41_jax.text.tokenizer import byte_alphabet


class TokenText:
    """A tokenizer's tokens as logprobs show them; one per server (the lookups are cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = tokenizer.backend_tokenizer
        self.byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
        self.alphabet = {ch: b for b, ch in byte_alphabet().items()}
        self.added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    @functools.lru_cache(maxsize=1 << 16)
    def raw(self, token: int) -> bytes:
        """The bytes `token` stands for (an added token's text; a byte-level entry's bytes)."""
        if token in self.added:
            return self.added[token].encode("utf-8")
        piece = self.tokenizer.id_to_token(token)
        if self.byte_level and piece is not None and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        return self.tokenizer.decode([token]).encode("utf-8")

    def shown(self, token: int) -> str:
        """The token's text, or `bytes:\\x..` when its bytes are not whole characters (OpenAI's form;
        the decoded text would be U+FFFD replacement characters)."""
        raw = self.raw(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Offsets:
    """Character offsets of consecutive tokens in the text their bytes decode to: a token starts at the
    character its first byte belongs to (a token that starts inside a character, at that character).
    Linear in the bytes; `take(b"")` is a token that adds nothing to the text (a dropped control token)."""

    def __init__(self, start: int = 0):
        self.start, self.begun = start, start  # characters begun so far

    def take(self, raw: bytes) -> int:
        at = self.begun - (1 if raw and raw[0] & 0xC0 == 0x80 else 0)
        self.begun += sum(1 for b in raw if b & 0xC0 != 0x80)
        return max(at, self.start)
