"""Response shaping: one choice of a chat or a completions reply (its streamed chunk entries and
its whole body), tool calls, logprobs entries and usage in OpenAI's shapes."""
from __future__ import annotations

import uuid

import numpy as np

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.token_text import TokenText
from dsv41_jax.text.reply import ReplyParser


def logprob_entry(token_text: TokenText, tok: int, lp, top: int) -> dict:
    """A chat logprobs entry of token `tok` from its log-probabilities `lp` [V], with `top` alternatives;
    a token that is part of a multi-byte character shows as `bytes:\\x..` (`token_text.TokenText`)."""
    def item(i):
        return {"token": token_text.shown(i), "logprob": float(lp[i]), "bytes": list(token_text.raw(i))}

    entry = item(tok)
    if top:
        best = np.argsort(-lp, kind="stable")[:top]
        entry["top_logprobs"] = [item(int(i)) for i in best]
    else:
        entry["top_logprobs"] = []
    return entry


def usage(runs: list, n: int) -> dict:
    """Each prompt counts once however many choices (`n`, each prompt's in turn) were drawn from it (as
    OpenAI counts it)."""
    firsts = runs[::n]
    prompt, generated = sum(r.prompt_len for r in firsts), sum(len(r.tokens) for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached for r in firsts)}}


def tool_call(c) -> dict:
    return {"index": c.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}


class ChatChoice:
    """One chat choice: reasoning / content / tool calls split by its own ReplyParser."""

    def __init__(self, index: int, run, mode: P.ChatMode, sp: P.Sampling, one_call: bool = False):
        self.index, self.run, self.mode, self.sp = index, run, mode, sp
        self.parser = ReplyParser(thinking=mode.reply_thinking, tools=mode.parse_tools, max_calls=1 if one_call else None)
        self.calls, self.sent_lp = [], 0

    @staticmethod
    def _delta(d) -> dict:
        out = {}
        if d.reasoning:
            out["reasoning_content"] = out["reasoning"] = d.reasoning
        if d.content:
            out["content"] = d.content
        if d.tool_calls:
            out["tool_calls"] = [tool_call(c) for c in d.tool_calls]
        return out

    def _finish_reason(self) -> str:
        if self.parser.cut_calls:  # the budget ended the reply inside a call: OpenAI says "length"
            return "length"
        return "tool_calls" if self.calls else ("length" if self.run.finish == "length" else "stop")

    def _finish(self):
        """The parser's flush: a calls block still open when the budget ran out comes back as the
        calls written so far (the last one cut), as OpenAI's API returns them."""
        return self.parser.finish(cut=self.run.finish == "length")

    def _lp(self):
        lp = {"content": self.run.logprobs[self.sent_lp:]} if self.sp.logprobs else None
        self.sent_lp = len(self.run.logprobs)
        return lp

    def opening(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def piece(self, text: str) -> dict | None:
        d = self.parser.feed(text)
        self.calls += d.tool_calls
        if not d:
            return None
        return {"index": self.index, "delta": self._delta(d), "logprobs": self._lp(), "finish_reason": None}

    def closing(self) -> dict:
        d = self._finish()
        self.calls += d.tool_calls
        return {"index": self.index, "delta": self._delta(d), "logprobs": self._lp(),
                "finish_reason": self._finish_reason()}

    def whole(self, texts: list[str]) -> dict:
        pieces = [self.parser.feed(t) for t in texts] + [self._finish()]
        self.calls = [c for d in pieces for c in d.tool_calls]
        message = {"role": "assistant",
                   "content": "".join(d.content for d in pieces) or (None if self.calls else "")}
        if self.mode.reply_thinking:
            message["reasoning_content"] = message["reasoning"] = "".join(d.reasoning for d in pieces)
        if self.calls:
            message["tool_calls"] = [tool_call(c) for c in self.calls]
        return {"index": self.index, "message": message, "finish_reason": self._finish_reason(),
                "logprobs": {"content": self.run.logprobs} if self.sp.logprobs else None}


class TextChoice:
    """One completions choice: the text as it comes, with logprobs in the legacy block shape
    (`text_offset`: where each token starts in the choice's text, echoed prompt included)."""

    def __init__(self, index: int, run, sp: P.Sampling, echo: tuple[str, dict | None] | None = None):
        self.index, self.run, self.sp, self.sent = index, run, sp, 0
        # echo: the prompt's text and logprobs block, sent once, before the first piece
        self.echo_text, self.echo_lp = echo if echo is not None else (None, None)
        self.base = len(self.echo_text) if self.echo_text is not None else 0  # where the generated text starts

    def _lp(self):
        if not self.sp.logprobs:
            return None
        start, self.sent = self.sent, len(self.run.logprobs)
        entries = self.run.logprobs[start:self.sent]
        block = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                 "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                 "text_offset": [self.base + o for o in self.run.offsets[start:self.sent]]}
        if self.echo_lp is not None:  # the prompt's entries first
            block, self.echo_lp = {k: self.echo_lp[k] + block[k] for k in block}, None
        return block

    def _text(self, text: str) -> str:
        if self.echo_text is not None:
            text, self.echo_text = self.echo_text + text, None
        return text

    def opening(self):
        return None

    def piece(self, text: str) -> dict:
        lp = self._lp()
        return {"index": self.index, "text": self._text(text), "logprobs": lp, "finish_reason": None}

    def closing(self) -> dict:
        lp = self._lp()
        return {"index": self.index, "text": self._text(""), "finish_reason": self.run.finish, "logprobs": lp}

    def whole(self, texts: list[str]) -> dict:
        lp = self._lp()
        return {"index": self.index, "text": self._text("".join(texts)), "finish_reason": self.run.finish,
                "logprobs": lp}
