"""Constrained decoding with llguidance: grammars from JSON schemas, regexes, Lark text and the
DSML tool-call format, and the per-request host state that fills each step's token mask.

llguidance (PyPI `llguidance`, Microsoft's guidance-ai project) reads the checkpoint's
`tokenizer.json` itself (`LLTokenizer`, with `n_vocab` = the model's vocabulary, which may be
larger than the file's) and computes, per step, a packed int32 mask of ceil(V / 32) words: bit j
of word w allows token 32w + j. The engine passes the words into its jitted sampling step, which
unpacks them (`sampling.unpack_mask`); an unconstrained slot's row is all ones.

A grammar's end allows only the end-of-sentence token, so a finished constrained reply stops
with finish_reason "stop"; max_tokens can still cut it ("length", the partial text as is). In
thinking mode the constraint starts after the model writes `</think>`: the reasoning is free.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from dsv41_jax.serving import call_budget
from dsv41_jax.text import dsml

# llguidance JSON options: no free whitespace between JSON tokens (the separators are fixed)
COMPACT = {"whitespace_flexible": False}


class ConstraintError(ValueError):
    """A grammar, schema or regex that cannot be used; `param` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What builds a `Constraint` (`Grammars.constraint`): across processes each process builds its
    own matcher from it and advances it by the same tokens, so every process computes the same masks
    (llguidance is deterministic) and the sampling step gets the same operands everywhere."""

    grammar: str
    start_after: int | None = None


class Constraint:
    """One request's matcher. `fill(row)` writes the allowed tokens into a packed int32 row
    (left all ones while the constraint has not started); `advance(token)` consumes a kept token.
    `start_after`: a token id (`</think>`) before which nothing is constrained. `spec`: what built
    it (None when built from a bare matcher)."""

    def __init__(self, matcher, start_after: int | None = None, spec: GrammarSpec | None = None):
        self.matcher, self.waiting, self.spec = matcher, start_after, spec

    def fill(self, row) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        if self.waiting is not None:
            return
        if self.matcher.is_error():  # a token outside the grammar was forced: nothing can follow
            row[:] = 0
            return
        fill_next_token_bitmask(self.matcher, row[None], 0)

    def advance(self, token: int) -> None:
        if self.waiting is not None:
            if token == self.waiting:
                self.waiting = None
            return
        self.matcher.consume_token(int(token))


def _lark_string(text: str) -> str:
    """A Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


_LENGTHS = ("minLength", "maxLength")


def _is_plain_string(schema) -> bool:
    """A property the DSML call writes raw (string="true"): type string and nothing else to check
    but an enum or its length bounds. Any other string schema (a pattern, a format) goes as JSON
    (string="false"), which the reply parser decodes to the same string, so it is still enforced."""
    if not isinstance(schema, Mapping) or schema.get("type") != "string":
        return False
    checks = set(schema) - {"type", "description", "title", "enum", "examples", "default", *_LENGTHS}
    return not checks and all(type(schema.get(k, 0)) is int and schema.get(k, 0) >= 0 for k in _LENGTHS)


def _raw_value_regex(schema: Mapping) -> str:
    """The raw value's characters (JSON Schema counts characters, as the regex's `.` does): any
    text, or as many characters as `minLength`/`maxLength` allow."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not low and high is None:
        return "/(?s:.*)/"
    return f"/(?s:.{{{low},{'' if high is None else high}}})/"


class Grammars:
    """Grammars for one tokenizer and model vocabulary. `tokenizer`: a `dsv41_jax.text.tokenizer.Tokenizer`
    (its `path` is the tokenizer.json llguidance reads)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self.llg = llguidance
        self.lltok = llguidance.LLTokenizer(str(tokenizer.path), n_vocab=vocab_size, eos_token=tokenizer.eos_id)
        specials = tokenizer.backend_tokenizer.get_added_tokens_decoder()
        # special tokens are not bytes to llguidance: a literal containing one must name its id
        self.specials = sorted(((t.content, i) for i, t in specials.items() if t.special),
                               key=lambda ci: -len(ci[0]))
        self._token_table = None  # built on the first forced call's budget check

    # ------------------------------------------------------------------ grammar text
    def _literal(self, text: str) -> str:
        """Lark items matching `text` exactly, special tokens by id (`<[id]>`)."""
        items, rest = [], text
        while rest:
            hits = [(rest.find(c), c, i) for c, i in self.specials if c in rest]
            if not hits:
                items.append(_lark_string(rest))
                break
            at, content, tid = min(hits, key=lambda h: (h[0], -len(h[1])))
            if at:
                items.append(_lark_string(rest[:at]))
            items.append(f"<[{tid}]>")
            rest = rest[at + len(content):]
        return " ".join(items) or '""'

    def json_schema(self, schema, param: str) -> str:
        if not isinstance(schema, Mapping):
            raise ConstraintError(param, f"a JSON schema must be an object, got {type(schema).__name__} {schema!r:.80}")
        try:
            # compact JSON: with llguidance's default flexible whitespace a weak model can spend the
            # whole reply on spaces between tokens (the 40-step demo model wrote '{' and 159 spaces)
            return self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
        except ValueError as e:
            raise ConstraintError(param, f"not a usable JSON schema: {e}") from None

    def regex(self, pattern: str) -> str:
        return self.llg.LLMatcher.grammar_from_regex(pattern)

    def lark(self, text: str) -> str:
        return self.llg.LLMatcher.grammar_from_lark(text)

    def tool_calls(self, functions: Sequence[Mapping], *, parallel: bool, param: str = "tools") -> str:
        """A Lark grammar for a reply that is only a DSML calls block (the bytes
        `dsml.render_tool_calls` writes): one call (`parallel` False) or more, each to one of
        `functions` with its parameters in the schema's property order, required ones present,
        each value valid against its property schema.

        llguidance's lexer is greedy: a literal that is a prefix of another one that may come
        next (a lone "\n" before "\n</...>") would never end. So each separator is part of the
        literal it precedes, and rules that can follow a separator come in two forms
        (`f`: first, no separator; `r`: rest, led by "\n")."""
        lines = []
        p_open, p_close = f"<{dsml.PARAMETER_TAG} name=", f"</{dsml.PARAMETER_TAG}>"
        for ti, fn in enumerate(functions):
            schema = fn.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(schema, Mapping) or schema.get("type", "object") != "object":
                raise ConstraintError(param, f"function {fn.get('name')!r}: parameters must be an object schema, "
                                             f"got {schema!r:.80}")
            props = schema.get("properties") or {}
            required = set(schema.get("required") or ())
            missing = sorted(required - set(props))
            if missing:
                raise ConstraintError(param, f"function {fn.get('name')!r}: required parameters {missing} are not "
                                             "in its properties")
            names = list(props)
            for pi, key in enumerate(names):
                sub = props[key]
                raw = _is_plain_string(sub)
                if raw and "enum" not in sub:  # raw text up to the first closing tag (the tag ends the value)
                    lines.append(f"v{ti}_{pi}[suffix={_lark_string(p_close)}]: {_raw_value_regex(sub)}")
                    value = f"v{ti}_{pi}"
                elif raw:
                    value = "(" + " | ".join(self._literal(str(v)) for v in sub["enum"]) + f") {self._literal(p_close)}"
                else:
                    compact = {**sub, "x-guidance": {**sub.get("x-guidance", {}), **COMPACT}}
                    value = f"%json {json.dumps(compact, ensure_ascii=False)} {self._literal(p_close)}"
                flag = "true" if raw else "false"
                for form, sep in (("f", ""), ("r", "\n")):
                    head = self._literal(sep + p_open + f'"{key}" string="{flag}">')
                    lines.append(f"{form}p{ti}_{pi}: {head} {value}")
            # parameters in property order, optional ones may be left out; after the last one written
            # comes the invoke's closing tag (with its "\n")
            n = len(names)
            optional = [k not in required for k in names]
            close = self._literal(f"\n</{dsml.INVOKE_TAG}>")
            for start in range(n + 1):
                for form in ("f", "r"):
                    alts = []
                    for j in range(start, n):
                        alts.append(f"{form}p{ti}_{j} r{ti}_{j + 1}")
                        if not optional[j]:
                            break
                    if all(optional[start:]):
                        alts.append(close)
                    lines.append(f"{form}{ti}_{start}: " + " | ".join(alts))
            name = fn.get("name")
            for form, sep in (("f", ""), ("r", "\n")):
                head = self._literal(sep + f'<{dsml.INVOKE_TAG} name="{name}">' + "\n")
                lines.append(f"{form}i{ti}: {head} f{ti}_0")
        first = " | ".join(f"fi{ti}" for ti in range(len(functions)))
        rest = " | ".join(f"ri{ti}" for ti in range(len(functions)))
        calls = f"({first})" + (f" ({rest})*" if parallel else "")
        head = self._literal(f"\n\n<{dsml.CALLS_TAG}>\n")
        tail = self._literal(f"\n</{dsml.CALLS_TAG}>")
        return self.lark("\n".join([f"start: {head} {calls} {tail}"] + lines) + "\n")

    def fewest_call_tokens(self, functions: Sequence[Mapping], *, parallel: bool) -> int:
        """A lower bound on the tokens of any reply `tool_calls(functions, ...)` accepts: a forced
        call under a smaller `max_tokens` can only be cut (dsv41_jax.serving.call_budget)."""
        if self._token_table is None:
            self._token_table = call_budget.TokenTable(self.lltok, self.specials)
        return call_budget.fewest_call_tokens(self._token_table, functions, parallel=parallel)

    # ------------------------------------------------------------------ checks and matchers
    def check(self, grammar: str, param: str) -> None:
        """Refuse a grammar llguidance cannot use, naming the field and llguidance's reason."""
        try:
            error = self.llg.LLMatcher.validate_grammar(grammar, self.lltok)
        except Exception as e:  # noqa: BLE001 - whatever llguidance raises about a grammar is the caller's 400
            error = f"{type(e).__name__}: {e}"
        if error:
            raise ConstraintError(param, f"cannot be used as a constraint: {error.strip()[:400]}")

    def constraint(self, grammar: str, *, start_after: int | None = None) -> Constraint:
        matcher = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError("grammar", matcher.get_error())
        return Constraint(matcher, start_after, GrammarSpec(grammar, start_after))
