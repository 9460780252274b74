"""Model output -> an OpenAI assistant message: reasoning, content and DSML tool calls.

The inverse of the chat encoder's assistant rendering (dsv41_jax.text.chat, dsv41_jax.text.dsml):
`reasoning</think>content\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls><｜end▁of▁sentence｜>`.
`ReplyParser` works on streamed text: `feed(delta)` returns only what is certain, holding back
any tail that could still become `</think>` or a DSML tag, so a tag split across deltas is never
shown as text. Tool calls are emitted when their `</｜DSML｜ calls>` block closes. An unterminated
block is never shown as content: a reply cut by max_tokens (`finish(cut=True)`) returns its calls
as far as they were written, the last one's `arguments` a prefix of its JSON object, as OpenAI's
API returns a call cut by the budget (finish_reason "length"); a block left open by an end of
sentence is dropped.
"""
from __future__ import annotations

import dataclasses
import json
import re

from dsv41_jax.text import dsml
from dsv41_jax.text import special_tokens as st

CALLS_OPEN = f"<{dsml.CALLS_TAG}>"
CALLS_CLOSE = f"</{dsml.CALLS_TAG}>"
INVOKE_CLOSE = f"</{dsml.INVOKE_TAG}>"
_INVOKE = re.compile(rf'<{re.escape(dsml.INVOKE_TAG)} name="(?P<name>[^"]*)">(?P<body>.*?){re.escape(INVOKE_CLOSE)}',
                     re.S)
_PARAM = re.compile(rf'<{re.escape(dsml.PARAMETER_TAG)} name="(?P<name>[^"]*)" string="(?P<flag>true|false)">'
                    rf'(?P<value>.*?)</{re.escape(dsml.PARAMETER_TAG)}>', re.S)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is the JSON object text OpenAI clients expect."""

    index: int
    name: str
    arguments: str


@dataclasses.dataclass
class Delta:
    """What one `feed` made certain."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def parse_invoke(name: str, body: str) -> dict:
    """The argument object of one invoke body: string="true" values verbatim, others JSON (a value
    that is not valid JSON is kept as its text rather than failing the whole reply)."""
    args = {}
    for m in _PARAM.finditer(body):
        value = m["value"]
        if m["flag"] == "false":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        args[m["name"]] = value
    return args


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ReplyParser:
    """Streaming parser for one reply. `thinking`: the prompt ended with `<think>`, so the reply
    starts in reasoning; `tools`: DSML calls are parsed (otherwise all text is content); `max_calls`: calls
    beyond this many are dropped (parallel_tool_calls=false)."""

    def __init__(self, *, thinking: bool, tools: bool, max_calls: int | None = None):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.max_calls = max_calls  # parallel_tool_calls=false: calls after the first are dropped
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.pending_ws = ""  # whitespace before a possible calls block, shown once it is not one
        self.cut_calls = False  # finish(cut=True) returned calls from an unterminated block

    def _tags(self) -> tuple[str, ...]:
        if self.state == "reasoning":
            return (st.THINK_END,)
        if self.state == "content":
            return (CALLS_OPEN,) if self.tools else ()
        return ()

    def feed(self, text: str) -> Delta:
        out = Delta()
        self.buf += text
        while True:
            if self.state == "reasoning":
                at = self.buf.find(st.THINK_END)
                if at < 0:
                    keep = _held(self.buf, self._tags())
                    out.reasoning += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.reasoning += self.buf[:at]
                self.buf = self.buf[at + len(st.THINK_END):]
                self.state = "content"
            elif self.state == "content":
                at = self.buf.find(CALLS_OPEN) if self.tools else -1
                if at < 0:
                    keep = _held(self.buf, self._tags())
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._content(out, self.buf[:at])
                self.pending_ws = ""  # whitespace before the calls block is layout, not content
                self.buf = self.buf[at + len(CALLS_OPEN):]
                self.state = "calls"
            elif self.state == "calls":  # calls are released when the block closes
                end = self.buf.find(CALLS_CLOSE)
                if end < 0:
                    return out
                for m in _INVOKE.finditer(self.buf[:end]):
                    if self.max_calls is not None and len(self.calls) >= self.max_calls:
                        break
                    call = ToolCall(len(self.calls), m["name"],
                                    json.dumps(parse_invoke(m["name"], m["body"]), ensure_ascii=False))
                    self.calls.append(call)
                    out.tool_calls.append(call)
                self.buf = self.buf[end + len(CALLS_CLOSE):]
                self.state = "after"
            else:  # text after the calls block: the model should stop here; it is not content
                self.buf = ""
                return out

    def _content(self, out: Delta, text: str):
        """Content, with trailing whitespace held until more text shows it is not layout before a
        calls block."""
        if not text:
            return
        text = self.pending_ws + text
        stripped = text.rstrip() if self.tools else text
        self.pending_ws = text[len(stripped):]
        out.content += stripped

    def finish(self, *, cut: bool = False) -> Delta:
        """Flush at the end of the reply. A held tail that never became `</think>` is text; with
        tools, a held tail that could start the calls tag (even a lone `<`, since the next token
        may have been the cut one) is dropped, never shown as content. An open calls block is
        returned as cut calls when `cut` (the budget ended the reply), else dropped."""
        out = Delta()
        if self.state == "calls" and cut:
            self.cut_calls = True
            for name, args in _cut_invokes(self.buf):
                if self.max_calls is not None and len(self.calls) >= self.max_calls:
                    break
                call = ToolCall(len(self.calls), name, args)
                self.calls.append(call)
                out.tool_calls.append(call)
        if self.state == "reasoning":
            out.reasoning += self.buf
        elif self.state == "content" and not self.tools:
            out.content += self.buf
        elif self.state == "content":
            tail = "" if CALLS_OPEN.startswith(self.buf) else self.buf  # held only while it is a prefix
            out.content += (self.pending_ws + tail).rstrip() if tail else ""
        self.buf, self.pending_ws = "", ""
        return out


def _cut_invokes(block: str) -> list[tuple[str, str]]:
    """(name, arguments) of every invoke begun in an unterminated calls block: whole invokes as
    `parse_invoke` reads them, the last one's arguments as the prefix of its JSON object that the
    written parameters give (a parameter cut inside its value contributes the part written: a
    string="true" value as an unterminated JSON string, another as its text so far)."""
    out, at = [], 0
    for m in _INVOKE.finditer(block):
        out.append((m["name"], json.dumps(parse_invoke(m["name"], m["body"]), ensure_ascii=False)))
        at = m.end()
    head = re.compile(rf'<{re.escape(dsml.INVOKE_TAG)} name="(?P<name>[^"]*)">').search(block, at)
    if head is None:
        return out
    body = block[head.end():]
    done = list(_PARAM.finditer(body))
    args = json.dumps(parse_invoke(head["name"], body), ensure_ascii=False)
    prefix = args[:-1]  # the object so far, left open
    rest = body[done[-1].end():] if done else body
    open_param = re.search(rf'<{re.escape(dsml.PARAMETER_TAG)} name="(?P<name>[^"]*)" string="(?P<flag>true|false)">'
                           r'(?P<value>.*)$', rest, re.S)
    if open_param is not None:
        value = open_param["value"]
        value = value[:len(value) - _held(value, (f"</{dsml.PARAMETER_TAG}>",))]  # a closing tag begun
        value = json.dumps(value, ensure_ascii=False)[:-1] if open_param["flag"] == "true" else value
        prefix += (", " if done else "") + json.dumps(open_param["name"], ensure_ascii=False) + ": " + value
    out.append((head["name"], prefix))
    return out


def parse_reply(text: str, *, thinking: bool, tools: bool) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) of a whole reply (EOS already removed)."""
    parser = ReplyParser(thinking=thinking, tools=tools)
    a, b = parser.feed(text), parser.finish()
    return a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls
