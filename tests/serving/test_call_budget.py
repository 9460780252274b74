"""Forced tool calls and their budget: the grammar's string bounds, the fewest tokens a complete
call can take (a lower bound, checked against the shortest tokenizations of calls the grammar
accepts), and a call cut by max_tokens returned as far as it was written."""
import random

import numpy as np
import pytest

from dsv41_jax.serving import call_budget
from dsv41_jax.serving.constraints import Grammars
from dsv41_jax.text import dsml
from dsv41_jax.text.reply import CALLS_OPEN, ReplyParser
from dsv41_jax.text.tokenizer import load_tokenizer
from dsv41_jax.train.data import ByteTokenizer

VOCAB = 264
P_CLOSE = f"</{dsml.PARAMETER_TAG}>"


def call_text(name, params):
    """A DSML calls block as the model writes it: params = [(key, flag, value text)]."""
    body = "\n".join(f'<{dsml.PARAMETER_TAG} name="{k}" string="{f}">{v}{P_CLOSE}' for k, f, v in params)
    return f'\n\n{CALLS_OPEN}\n<{dsml.INVOKE_TAG} name="{name}">\n{body}\n</{dsml.INVOKE_TAG}>\n</{dsml.CALLS_TAG}>'


@pytest.fixture(scope="module")
def byte_grammars(tmp_path_factory):
    tok = load_tokenizer(ByteTokenizer().save_json(tmp_path_factory.mktemp("tok") / "tokenizer.json"))
    return tok, Grammars(tok, VOCAB)


def accepts(grammars, tok, grammar, text) -> bool:
    """Whether the matcher takes every token of `text` and then allows the end of sentence."""
    c = grammars.constraint(grammar)
    row = np.zeros((VOCAB + 31) // 32, np.int32)
    for t in tok.encode(text) + [tok.eos_id]:
        c.fill(row)
        if not (row[t // 32] >> (t % 32)) & 1:
            return False
        c.advance(t)
    return True


GET = {"name": "get", "parameters": {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 4, "minLength": 1},
    "days": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}}}


def test_string_and_array_bounds_hold_in_the_forced_call_grammar(byte_grammars):
    tok, g = byte_grammars
    grammar = g.tool_calls([GET], parallel=False)
    assert accepts(g, tok, grammar, call_text("get", [("city", "true", "Rome")]))
    assert not accepts(g, tok, grammar, call_text("get", [("city", "true", "Paris")]))  # maxLength 4
    assert not accepts(g, tok, grammar, call_text("get", [("city", "true", "")]))  # minLength 1
    assert accepts(g, tok, grammar, call_text("get", [("city", "true", "Oslo"), ("tags", "false", '["a","b"]')]))
    assert not accepts(g, tok, grammar, call_text("get", [("city", "true", "Oslo"), ("tags", "false", '["a","b","c"]')]))


def test_the_fewest_call_tokens_bound_the_shortest_accepted_call_of_a_byte_tokenizer(byte_grammars):
    tok, g = byte_grammars
    grammar = g.tool_calls([GET], parallel=False)
    calls = [call_text("get", [("city", "true", "R")]),
             call_text("get", [("city", "true", "Rome"), ("days", "false", "3")]),
             call_text("get", [("city", "true", "Oslo"), ("tags", "false", "[]")])]
    bound = g.fewest_call_tokens([GET], parallel=False)
    for text in calls:
        assert accepts(g, tok, grammar, text)
        assert bound <= len(tok.encode(text))
    shortest = len(tok.encode(calls[0]))
    assert bound >= shortest - len('true">R\n'), (bound, shortest)  # tight: only the flag and value left out
    # the cheapest function decides; parallel calls need at least one
    empty = {"name": "x", "parameters": {"type": "object", "properties": {}}}
    both = g.fewest_call_tokens([GET, empty], parallel=True)
    assert accepts(g, tok, g.tool_calls([GET, empty], parallel=True), call_text("x", []))
    assert both == g.fewest_call_tokens([empty], parallel=True) <= len(tok.encode(call_text("x", [])))


class _Vocab:
    """A stand-in for llguidance's tokenizer: single bytes plus long tokens that straddle the
    call's fixed texts and values."""

    def __init__(self, extra):
        self.pieces = [bytes([b]) for b in range(256)] + [e.encode() for e in extra]
        self.vocab_size = len(self.pieces)

    def decode_bytes(self, ids):
        return b"".join(self.pieces[i] for i in ids)

    def is_special_token(self, i):
        return False


def shortest_tokenization(data: bytes, tokens) -> int:
    best = [0] + [len(data) + 1] * len(data)
    for j in range(1, len(data) + 1):
        best[j] = min(best[i] + 1 for i in range(j) if data[i:j] in tokens)
    return best[-1]


def test_the_bound_holds_when_tokens_straddle_values_and_tags():
    rng = random.Random(0)
    extra = [f'">R{P_CLOSE}', f"{P_CLOSE}\n", f'<{dsml.PARAMETER_TAG} name="', "city", '" string="true">',
             f"\n</{dsml.INVOKE_TAG}>\n</{dsml.CALLS_TAG}>", "\n\n", "Rome", 'e">Ro', f"{CALLS_OPEN}\n<",
             f'g="true">R{P_CLOSE[:2]}', P_CLOSE[2:], f'<{dsml.INVOKE_TAG} name="get">\n<', f'{dsml.PARAMETER_TAG} name="city" strin']
    table = call_budget.TokenTable(_Vocab(extra), specials=[])
    assert table.longest == max(len(e.encode()) for e in extra)
    bound = call_budget.fewest_call_tokens(table, [GET], parallel=False)
    for n in range(20):  # the first: one token covers the flag, the value and the closing tag's start
        value = "R" if n == 0 else "".join(rng.choice("Rome") for _ in range(rng.randint(1, 4)))
        params = [("city", "true", value)] + ([("days", "false", str(rng.randint(0, 99)))] if rng.random() < 0.5 else [])
        text = call_text("get", params).encode()
        assert bound <= shortest_tokenization(text, table.tokens), (bound, text)


def test_a_call_cut_by_the_budget_comes_back_as_far_as_it_was_written():
    head = f'\n\n{CALLS_OPEN}\n<{dsml.INVOKE_TAG} name="get">\n'
    cases = {
        f'<{dsml.PARAMETER_TAG} name="city" string="true">Par': '{"city": "Par',
        f'<{dsml.PARAMETER_TAG} name="city" string="true">Paris{P_CLOSE[:5]}': '{"city": "Paris',
        f'<{dsml.PARAMETER_TAG} name="city" string="true">Oslo{P_CLOSE}\n<{dsml.PARAMETER_TAG} name="tags" '
        'string="false">["a", "b': '{"city": "Oslo", "tags": ["a", "b',
        f'<{dsml.PARAMETER_TAG} name="city" string="true">Oslo{P_CLOSE}\n': '{"city": "Oslo"',
    }
    for written, arguments in cases.items():
        parser = ReplyParser(thinking=False, tools=True)
        assert not parser.feed(head + written).tool_calls
        cut = parser.finish(cut=True)
        assert [(c.index, c.name, c.arguments) for c in cut.tool_calls] == [(0, "get", arguments)]
        ended = ReplyParser(thinking=False, tools=True)  # an end of sentence inside the block: dropped
        ended.feed(head + written)
        assert not ended.finish().tool_calls
    # a whole invoke before the cut one comes back whole
    parser = ReplyParser(thinking=False, tools=True)
    parser.feed(head + f'<{dsml.PARAMETER_TAG} name="city" string="true">A{P_CLOSE}\n</{dsml.INVOKE_TAG}>\n'
                f'<{dsml.INVOKE_TAG} name="get">\n<{dsml.PARAMETER_TAG} name="city" string="true">B')
    calls = parser.finish(cut=True).tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("get", '{"city": "A"}'), ("get", '{"city": "B')]
