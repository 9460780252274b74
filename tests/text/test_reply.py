"""The reply parser: model output text -> reasoning, content, tool calls, whole and streamed.

Expected values come from the chat encoder's own rendering (dsv41_jax.text.dsml), so parsing is
checked as the inverse of encoding; streaming is checked at every split point of the text."""
import json

import pytest

from dsv41_jax.text import dsml
from dsv41_jax.text import pieces
from dsv41_jax.text import special_tokens as st
from dsv41_jax.text.reply import ReplyParser, parse_reply

def calls_text(calls, escape):
    """The DSML calls block the encoder writes, as text."""
    return pieces.join(dsml.render_tool_calls(calls, escape))


CALLS = [("get_weather", {"city": "Paris", "days": 3, "units": ["c"]}), ("noop", {})]
TEXT = "Let me look.</think>Checking now." + calls_text(CALLS, lambda s: s)


def stream(text: str, cuts, **kw):
    p = ReplyParser(**kw)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [c for d in deltas for c in d.tool_calls])


def test_whole_reply_inverts_the_encoder():
    reasoning, content, calls = parse_reply(TEXT, thinking=True, tools=True)
    assert reasoning == "Let me look." and content == "Checking now."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert [c.index for c in calls] == [0, 1]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_at_every_split_equals_whole(step):
    whole = parse_reply(TEXT, thinking=True, tools=True)
    for first in range(len(TEXT)):
        cuts = sorted(set([first] + list(range(first, len(TEXT), step)))) if first else list(range(step, len(TEXT), step))
        assert stream(TEXT, cuts, thinking=True, tools=True) == whole


def test_no_dsml_leaks_when_cut_inside_a_block():
    for cut in range(TEXT.index(st.THINK_END), len(TEXT)):
        reasoning, content, calls = stream(TEXT[:cut], list(range(1, cut)), thinking=True, tools=True)
        assert "<\uff5c" not in content and st.THINK_END not in content and st.THINK_END not in reasoning
        assert content == "Checking now."[:max(0, cut - TEXT.index("Checking"))].rstrip()
        assert calls == [] or cut == len(TEXT)


def test_chat_mode_and_no_tools():
    r, c, calls = parse_reply("plain </think> text", thinking=False, tools=False)
    assert (r, c, calls) == ("", "plain </think> text", [])
    r, c, calls = parse_reply("a <｜DS", thinking=False, tools=True)
    assert c == "a" and not calls  # a cut-off DSML tag is dropped
    assert parse_reply("a <b", thinking=False, tools=True)[1] == "a <b"  # a held '<' that is no tag is text


def test_string_and_json_parameters():
    body = calls_text([("f", {"s": "not json {", "n": 1.5, "o": {"k": [1, None]}})], lambda s: s)
    _, _, calls = parse_reply(body, thinking=False, tools=True)
    assert json.loads(calls[0].arguments) == {"s": "not json {", "n": 1.5, "o": {"k": [1, None]}}
    bad = body.replace("1.5", "1.5.2")  # invalid JSON in a string="false" value stays text
    assert json.loads(parse_reply(bad, thinking=False, tools=True)[2][0].arguments)["n"] == "1.5.2"
