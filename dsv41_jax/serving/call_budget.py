"""The fewest tokens a forced tool call can take, so a budget that cannot hold one is refused
before any compute.

Under `tool_choice` "required" or a named function the reply is only a DSML calls block
(`constraints.Grammars.tool_calls`). Every such block contains, in order, fixed texts: the block's
opening and the invoke's header, each required parameter's opening tag and closing tag, the
invoke's and the block's closings. Between them lie values and optional parameters of any length.
A tokenization of the whole reply needs at least as many tokens as it takes to cover each fixed
text, less one per gap (a single token may cover the end of one fixed text, the gap and the start
of the next), so

    fewest tokens >= sum over fixed texts of cover(text) - (number of gaps),

where cover(text) is the fewest tokens whose concatenation covers `text` when the first may start
before it and the last may end after it (a token that does so is counted whole). Inside a fixed
text the tokens must match exactly, and a special token (`<[id]>` in the grammar) is one token
that nothing merges with. The bound is sound for any tokenizer; it is tight for byte-level ones
and looser where long tokens can straddle a gap.
"""
from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping, Sequence

from dsv41_jax.text import dsml


class TokenTable:
    """The byte strings of a vocabulary's ordinary tokens and their longest length."""

    def __init__(self, lltok, specials: Sequence[tuple[str, int]]):
        special_ids = {i for _, i in specials}
        pieces = (lltok.decode_bytes([i]) for i in range(lltok.vocab_size)
                  if i not in special_ids and not lltok.is_special_token(i))
        self.tokens = frozenset(p for p in pieces if p)
        self.longest = max((len(t) for t in self.tokens), default=1)
        self.specials = sorted(specials, key=lambda ci: -len(ci[0]))
        self._sorted = sorted(self.tokens)  # prefix queries by bisection
        self._reversed = sorted(t[::-1] for t in self.tokens)  # suffix queries

    @staticmethod
    def _starts_one(table: list[bytes], head: bytes) -> bool:
        at = bisect.bisect_left(table, head)
        return at < len(table) and table[at].startswith(head)

    def _ends_a_token(self, head: bytes) -> bool:
        """`head` is how some token ends (a first token that starts before the text)."""
        return self._starts_one(self._reversed, head[::-1])

    def _starts_a_token(self, tail: bytes) -> bool:
        """`tail` is how some token starts (a last token that ends after the text)."""
        return self._starts_one(self._sorted, tail)

    @functools.lru_cache(maxsize=4096)
    def cover(self, text: str) -> int:
        """Fewest tokens covering `text`, open at both ends (see the module's docstring)."""
        parts = _split_specials(text, [c for c, _ in self.specials])
        count = 0
        for k, part in enumerate(parts):
            if part is None:  # a special token: one token, and a closed boundary on each side
                count += 1
                continue
            count += self._cover_bytes(part.encode("utf-8"), open_start=k == 0, open_end=k == len(parts) - 1)
        return count

    def _cover_bytes(self, data: bytes, *, open_start: bool, open_end: bool) -> int:
        n, m = len(data), self.longest
        if not n:
            return 0
        if open_start and open_end and n <= m and any(data in t for t in self._sorted):
            return 1  # one token holds the whole text
        inf = n + 1
        best = [0] + [inf] * n
        for j in range(1, n + 1):
            for i in range(max(0, j - m), j):
                if best[i] >= inf:
                    continue
                piece = data[i:j]
                fits = ((i == 0 and open_start and self._ends_a_token(piece))
                        or (j == n and open_end and self._starts_a_token(piece)) or piece in self.tokens)
                if fits:
                    best[j] = min(best[j], best[i] + 1)
        return best[n] if best[n] < inf else -(-n // m)  # no exact tiling: the length bound


def _split_specials(text: str, specials: Sequence[str]) -> list[str | None]:
    """`text` as ordinary parts and special tokens (None), in order; longest special first."""
    out, rest = [], text
    while rest:
        hits = [(rest.find(c), -len(c), c) for c in specials if c and c in rest]
        if not hits:
            out.append(rest)
            break
        at, _, content = min(hits)
        if at:
            out.append(rest[:at])
        out.append(None)
        rest = rest[at + len(content):]
    return out


def _fixed_texts(fn: Mapping, parallel: bool) -> list[str]:
    """The texts every complete call of `fn` contains, in order, each separated by a gap (with
    `parallel`, more invokes may come between the invoke's closing and the block's)."""
    schema = fn.get("parameters") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    p_close = f"</{dsml.PARAMETER_TAG}>"
    texts = [f"\n\n<{dsml.CALLS_TAG}>\n<{dsml.INVOKE_TAG} name=\"{fn.get('name')}\">\n"]
    for key in props:
        if key in required:  # its separator is left out: it is absent when optional ones are skipped
            texts += [f'<{dsml.PARAMETER_TAG} name="{key}" string="', p_close]
    ends = [f"\n</{dsml.INVOKE_TAG}>", f"\n</{dsml.CALLS_TAG}>"]
    return texts + (ends if parallel else ["".join(ends)])


def fewest_call_tokens(table: TokenTable, functions: Sequence[Mapping], *, parallel: bool) -> int:
    """A lower bound on the tokens of any reply the forced-call grammar for `functions` accepts
    (one call at least, to any of them). Only a token of two bytes or more can straddle a gap."""
    bounds = []
    for fn in functions:
        texts = _fixed_texts(fn, parallel)
        straddling = len(texts) - 1 if table.longest > 1 else 0
        bounds.append(sum(table.cover(t) for t in texts) - straddling)
    return max(1, min(bounds, default=1))
