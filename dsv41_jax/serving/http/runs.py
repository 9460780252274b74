"""A request's choices on the engine: each choice is one engine request (a `Run`), submitted
together, whose events become text pieces with stop strings applied. A run whose reader stops
early (the client went away, a stop string, an error) is cancelled, so its slot is freed."""
from __future__ import annotations

import asyncio
import dataclasses
import uuid

from fastapi import Request as HTTPRequest

from dsv41_jax.serving.request import Request
from dsv41_jax.serving.generate import TextStream
from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.checks import token_budget
from dsv41_jax.serving.http.choices import logprob_entry
from dsv41_jax.serving.http.prompts import Prompt
from dsv41_jax.serving.http.state import ServingState
from dsv41_jax.serving.http.token_text import Offsets
from dsv41_jax.serving.http.worker import Job, QueueFull
from dsv41_jax.serving.sampling import SamplingParams

RETRY_AFTER_S = 1


class Stops:
    """Finds stop strings in streamed text, holding back what could be the start of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.hold = stops, max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is certain, whether a stop string was hit)."""
        self.buf += text
        hits = [self.buf.find(s) for s in self.stops if s in self.buf]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclasses.dataclass
class Run:
    """One request's prompt and the state gathered while it runs."""

    prompt_len: int
    job: Job
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    offsets: list = dataclasses.field(default_factory=list)  # each logprobs entry's character offset in the text
    chars: Offsets = dataclasses.field(default_factory=Offsets)
    cached: int = 0
    finish: str | None = None
    first: tuple | None = None  # the first event, read before a stream's 200 is sent

    @property
    def request_id(self) -> str:
        return self.job.request.request_id


def _test_hooks(state: ServingState, body: dict) -> tuple[tuple[int, ...], int]:
    """(forced tokens, fail at token k or 0) of the tests' `dsv41_test` field; `"fail": true` means
    the first token."""
    extra = body.get("dsv41_test")
    if extra is None or not state.cfg.test_hooks:
        return (), 0
    forced = tuple(extra.get("forced_tokens") or state.tokenizer.encode(extra.get("forced_text", "")))
    return forced, int(extra.get("fail") or 0)


def _check_capacity(state: ServingState, sp: P.Sampling) -> None:
    slots = state.worker.engine.slots
    if len(sp.seeds) > slots:
        raise P.bad("n", f"{len(sp.seeds)} choices need {len(sp.seeds)} batch slots at once; this server has "
                         f"{slots} (dsv41 serve --max-batch)")


def start_runs(state: ServingState, body: dict, prompt: Prompt, sp: P.Sampling, mode: P.ChatMode | None,
               constraints: list | None = None) -> list[Run]:
    """Submit one engine request per choice (`n`); each holds a slot, so n is at most the batch."""
    return submit_runs(state, make_runs(state, body, prompt, sp, mode, constraints))


def make_runs(state: ServingState, body: dict, prompt: Prompt, sp: P.Sampling, mode: P.ChatMode | None,
              constraints: list | None = None) -> list[Run]:
    """One engine request per choice (`n`), checked, not yet submitted (`submit_runs`)."""
    ids = prompt.ids
    max_tokens = token_budget(state.cfg, ids, sp, "messages" if mode is not None else "prompt")
    _check_capacity(state, sp)
    forced, fail = _test_hooks(state, body)
    vocab = state.vocab_size
    wrong = next((t for t, _ in sp.logit_bias if t >= vocab), None)
    if wrong is not None:
        raise P.bad("logit_bias", f"token id {wrong} is outside the model's vocabulary [0, {vocab})")
    loop, conversations = asyncio.get_running_loop(), state.cfg.conversations
    runs = []
    for i, seed in enumerate(sp.seeds):
        params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=seed,
                                max_tokens=max_tokens, stop_tokens=state.end_ids, presence_penalty=sp.presence_penalty,
                                frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
                                logit_bias=sp.logit_bias)
        req = Request(list(ids), params, request_id=f"cmpl-{uuid.uuid4().hex[:24]}",
                      want_logprobs=sp.logprobs, forced_tokens=forced,
                      constraint=constraints[i] if constraints else None, spans=prompt.spans)
        job = Job(req, loop, asyncio.Queue(), fail_in_engine=fail)
        # an image prompt matches the conversation caches on its pixel key (every image position has one id)
        if conversations is not None:
            conversations.attach(job, thinking=bool(mode and mode.reply_thinking), chat=mode is not None,
                                 key=prompt.key)
        runs.append(Run(len(ids), job))
    return runs


def submit_runs(state: ServingState, runs: list[Run]) -> list[Run]:
    """Submit the runs of one request together: the queue admits or refuses them as one (429)."""
    try:
        state.worker.submit_all([run.job for run in runs])
    except QueueFull as e:
        raise P.APIError(429, f"the server is at capacity: {e}; retry after {RETRY_AFTER_S} s",
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return runs


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone: after the body is read, the server's next ASGI message for
    this request is `http.disconnect` (sent at once when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def while_connected(state: ServingState, request: HTTPRequest, runs: list[Run], work):
    """The result of the coroutine `work`, unless the client disconnects first: then every run is
    cancelled at once (its slot is free at the engine's next step, counted as client_disconnected)
    and `ClientGone` is raised. Waiting on the disconnect, rather than polling between events, is
    what notices it while tokens are flowing."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        cancel_runs(state, runs, "client_disconnected")
        task.cancel()
        raise ClientGone()
    return task.result()


def cancel_runs(state: ServingState, runs: list[Run], reason: str) -> None:
    """Drop the runs the engine still holds (a run already finished is not counted again)."""
    for run in runs:
        if run.finish is None:
            state.worker.cancel(run.request_id, reason)


def _on_token(state: ServingState, run: Run, sp: P.Sampling, tok: int, lp) -> None:
    run.tokens.append(tok)
    if sp.logprobs and lp is not None and tok not in state.end_ids:
        run.logprobs.append(logprob_entry(state.token_text, tok, lp, sp.top_logprobs))
        run.offsets.append(run.chars.take(b"" if tok in state.skip_ids else state.token_text.raw(tok)))


async def text_pieces(state: ServingState, run: Run, sp: P.Sampling):
    """Text pieces of the reply as they become certain, then sets run.finish. Closed early (the
    stream's client went away: starlette cancels the response) or failed, it cancels the run."""
    stream = TextStream(state.tokenizer, skip_ids=state.skip_ids)
    stops = Stops(sp.stop)
    try:
        while True:
            ev, run.first = run.first, None
            if ev is None:
                ev = await run.job.events.get()
            if ev[0] == "token":
                _, tok, lp = ev
                _on_token(state, run, sp, tok, lp)
                text, hit = stops.push(stream.push(tok))
                if text:
                    yield text
                if hit:
                    state.worker.cancel(run.request_id, "stop_string")
                    run.finish = "stop"
                    return
            elif ev[0] == "done":
                result = ev[1]
                run.cached = result.cached_tokens
                tail = stops.flush()
                if tail:
                    yield tail
                run.finish = result.finish_reason
                return
            else:
                raise P.APIError(ev[1], ev[2])
    except (asyncio.CancelledError, GeneratorExit):
        cancel_runs(state, [run], "client_disconnected")
        raise
    except BaseException:
        cancel_runs(state, [run], "error")
        raise


async def first_events(state: ServingState, runs: list[Run]) -> None:
    """Wait for every run's first event so a request refused by the engine gets its status code
    rather than a 200 stream that carries an error; a refused choice refuses the request."""
    for run in runs:
        run.first = await run.job.events.get()
        if run.first[0] == "error":
            run.finish = "error"  # the engine holds it no more
            cancel_runs(state, runs, "error")  # free the other choices' slots
            raise P.APIError(run.first[1], run.first[2])
