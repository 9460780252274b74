"""Load the checkpoint's tokenizer.json and name the ids that sampling and prompting need.

docs/REFERENCE.md §9: users supply `tokenizer.json` with the weights; it is read with the `tokenizers`
library, never through transformers. The wrapper is deliberately thin: the chat encoder
builds prompt *text* (dsv41_jax.text.chat), and this module only turns text into ids and back.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import tokenizers

from dsv41_jax.text import pieces as P
from dsv41_jax.text import special_tokens as st

TOKENIZER_FILENAME = "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer plus the special ids resolved from its own file.

    `backend_tokenizer` carries the same name as in HF fast tokenizers so code that accepts
    either (e.g. dsv41_jax.engram.tokens) can reach the Rust tokenizer uniformly.
    `text_backend` is the same file with added-token matching off: text is only ever characters.
    """

    backend_tokenizer: tokenizers.Tokenizer
    path: Path
    bos_id: int
    eos_id: int
    pad_id: int
    text_backend: tokenizers.Tokenizer = dataclasses.field(repr=False)
    control_ids: dict[str, int] = dataclasses.field(repr=False)
    control_pattern: re.Pattern | None = dataclasses.field(repr=False)

    def encode(self, text: str, add_special: bool = False, *, split_special_tokens: bool = False) -> list[int]:
        """Ids for `text`, with the convention of `tokenizers` and vLLM: the text of a special
        token (e.g. `<｜User｜>`) becomes its id, so a client that writes its own template gets
        the control ids it wrote.

        `split_special_tokens=True` (Hugging Face's name for the switch) keeps special-token text
        as characters instead: chat message content and training documents are encoded that way
        (through `encode_pieces` and dsv41_jax.train.data), so nothing a user types or a document
        contains can forge a turn. `add_special` only controls the file's post-processor (e.g. an
        automatic BOS), which chat prompts must not use because the encoder writes BOS itself."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        check_encodable(text)
        backend = self.text_backend if split_special_tokens else self.backend_tokenizer
        return backend.encode(text, add_special_tokens=add_special).ids

    def encode_pieces(self, pieces) -> list[int]:
        """Ids for a prompt built by the chat encoder (dsv41_jax.text.pieces): added tokens are
        matched only in the encoder's own pieces."""
        return P.encode_pieces(pieces, self.control_ids, self.control_pattern,
                               lambda text: self.encode(text, split_special_tokens=True))

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text for `ids`; special tokens are kept by default so prompts round-trip."""
        return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(int(token_id))

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (may be below max id + 1 for sparse vocabs)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def added_tokens(self) -> dict[int, str]:
        """id -> content for every token declared in the file's `added_tokens`."""
        return {i: t.content for i, t in self.backend_tokenizer.get_added_tokens_decoder().items()}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the `tokenizers` ByteLevel steps use: a byte-level
    vocabulary entry is the bytes it stands for, each written as one of these characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_encodable(text: str) -> None:
    """Refuse text that has no UTF-8 form: a lone UTF-16 surrogate (JSON's "\\ud800" escape without its
    pair) cannot be tokenized, and the `tokenizers` library would only say "TextInputSequence must be
    str". The message names the code point and its position."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ValueError(f"text contains a lone UTF-16 surrogate U+{ord(bad.group()):04X} at character {bad.start()}; "
                         "it has no UTF-8 form: send the character's surrogate pair or the character itself")


def _resolve_file(path_or_dir) -> Path:
    path = Path(os.fspath(path_or_dir))
    if path.is_dir():
        path = path / TOKENIZER_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file not found: {path}. Pass the checkpoint folder that holds "
            f"{TOKENIZER_FILENAME} (it ships with the weights) or the file itself."
        )
    return path


def _read_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "the file may be truncated or a Git LFS pointer - download it again"
        ) from err
    return text


def _special_id(backend: tokenizers.Tokenizer, token: str, role: str, path: Path) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(
            f"{path} has no {role} token {token!r}; this does not look like the DeepSeek-V4.1 "
            f"tokenizer. Pass {role}_token=... to load_tokenizer if your file names it differently."
        )
    return token_id


def load_tokenizer(
    path_or_dir,
    *,
    bos_token: str = st.BOS,
    eos_token: str = st.EOS,
    pad_token: str = st.PAD,
) -> Tokenizer:
    """Read tokenizer.json (a folder or the file) and resolve BOS/EOS/pad ids from it.

    The ids come from the file, not from constants: in the released tokenizer they are
    0, 1 and 2 (docs/REFERENCE.md §9), and a file that disagrees is reported by `bos_id` etc. as-is.
    """
    path = _resolve_file(path_or_dir)
    text = _read_text(path)
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # the Rust side raises a bare Exception
        raise ValueError(f"{path} is JSON but not a tokenizers file: {err}") from err
    control_ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    return Tokenizer(
        backend_tokenizer=backend,
        path=path,
        bos_id=_special_id(backend, bos_token, "bos", path),
        eos_id=_special_id(backend, eos_token, "eos", path),
        pad_id=_special_id(backend, pad_token, "pad", path),
        text_backend=_text_only(text),
        control_ids=control_ids,
        control_pattern=P.control_pattern(control_ids),
    )


def _text_only(text: str) -> tokenizers.Tokenizer:
    """The same tokenizer with no added token ever matched in input text.

    `encode_special_tokens` makes the Rust side tokenize *special* added tokens as ordinary
    text but still matches the non-special ones (e.g. `<think>` in some files), so every added
    token is marked special first. Vocabulary, normalizer and pre-tokenizer are untouched.
    """
    data = json.loads(text)
    for token in data.get("added_tokens") or ():
        token["special"] = True
    backend = tokenizers.Tokenizer.from_str(json.dumps(data))
    backend.encode_special_tokens = True
    return backend


def sentinel_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Input-only ids to mask at sampling: the list in docs/REFERENCE.md §9, confirmed against the file.

    How that list (128847-129270 and 129279) is confirmed:
    - an id the tokenizer does not have at all is dropped: its vocabulary is smaller (a test
      tokenizer), so that id names no token of this tokenizer;
    - an id that is an added token is kept: the released file declares every sentinel
      (image placeholder, reserved place-holders) in `added_tokens`;
    - an id that is an ordinary vocabulary entry raises: masking it would forbid real text,
      so the file and docs/REFERENCE.md §9 disagree and a human has to look;
    - if a token the model must emit (EOS, <think>, </think>) lands in the set, raise too.
    """
    added = tokenizer.added_tokens()
    kept = []
    for token_id in st.spec_sentinel_ids():
        token = tokenizer.id_to_token(token_id)
        if token is None:
            continue
        if token_id not in added:
            raise ValueError(
                f"sentinel id {token_id} is the ordinary vocabulary token {token!r} in "
                f"{tokenizer.path}, not an added token; docs/REFERENCE.md §9's sentinel list does not "
                "match this tokenizer, so masking it would forbid real text"
            )
        kept.append(token_id)
    kept_set = set(kept)
    for token in set(st.GENERATED) | {tokenizer.id_to_token(tokenizer.eos_id)}:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id in kept_set:
            raise ValueError(
                f"{token!r} (id {token_id}) must be generatable but falls in the sentinel "
                f"set of {tokenizer.path}; this tokenizer's ids do not match docs/REFERENCE.md §9"
            )
    return tuple(kept)
