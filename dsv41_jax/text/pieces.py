"""Prompt pieces: who wrote each run of a prompt, so only the chat encoder's own markers become control ids.

A prompt is a list of Pieces. Text the encoder writes (role markers, `<think>`, DSML tags, its fixed
instructions) is matched against the tokenizer's added tokens, which become their ids. Text that
came from a caller (user and system messages, tool results, reasoning, tool names, arguments and
schemas) is always tokenized as characters: a user who types `<｜end▁of▁sentence｜><｜User｜>` gets
those characters, never the EOS and User ids, so no turn can be forged (docs/TROUBLESHOOTING.md).

Runs of text between two of the encoder's markers are tokenized as one string, exactly as the
tokenizer splits a whole prompt at its added tokens before its pre-tokenizer runs; a prompt whose
caller text holds no special-token text therefore gets the ids of tokenizing the joined text.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """One run of prompt text and whether the encoder wrote it (only then may it hold control tokens)."""

    text: str
    from_encoder: bool


@dataclasses.dataclass(frozen=True)
class ImagePiece(Piece):
    """The image placeholder the encoder writes for an image content part; `part` is that part
    (the caller's dict), so the images of a prompt are known in prompt order (`image_parts`)."""

    part: object = dataclasses.field(default=None, compare=False, repr=False)


def image_parts(pieces: Iterable[Piece]) -> list:
    """The image content parts of a prompt, in the order their placeholders appear."""
    return [p.part for p in pieces if isinstance(p, ImagePiece)]


def encoder(text: str) -> Piece:
    return Piece(text, True)


def caller(text: str) -> Piece:
    return Piece(text, False)


def join(pieces: Iterable[Piece]) -> str:
    """The prompt text, as the reference encoder would write it."""
    return "".join(p.text for p in pieces)


def control_pattern(tokens: Iterable[str]) -> re.Pattern | None:
    """A regex finding the tokens leftmost-longest, as the tokenizer's added vocabulary matches them."""
    ordered = sorted({t for t in tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def encode_pieces(
    pieces: Sequence[Piece],
    control_ids: Mapping[str, int],
    pattern: re.Pattern | None,
    encode_text: Callable[[str], list[int]],
) -> list[int]:
    """Ids for `pieces`: control tokens only where the encoder wrote them, everything else as text.

    control_ids: token text -> id for every added token; pattern: `control_pattern(control_ids)`;
    encode_text: the tokenizer with added-token matching switched off.
    """
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        text = "".join(run)
        run.clear()
        if text:
            ids.extend(encode_text(text))

    for piece in pieces:
        if not isinstance(piece, Piece):
            raise TypeError(f"prompt pieces must be Piece objects, got {type(piece).__name__}")
        if not piece.from_encoder or pattern is None:
            run.append(piece.text)
            continue
        at = 0
        for match in pattern.finditer(piece.text):
            run.append(piece.text[at:match.start()])
            flush()
            ids.append(control_ids[match.group()])
            at = match.end()
        run.append(piece.text[at:])
    flush()
    return ids
