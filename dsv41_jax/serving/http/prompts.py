"""A request's prompt as the ids the engine prefills: one function for chat, `/tokenize` and
completions (echo returns the text of what was built). Tokenizing and image decoding run off the
event loop, so a long prompt never stalls the other clients; the vision tower runs on the engine
thread between steps."""
from __future__ import annotations

import asyncio
import dataclasses
from functools import partial

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.checks import check_ids, check_prompt_size, refuse_images
from dsv41_jax.serving.http.state import ServingState
from dsv41_jax.text.chat import encode_chat_ids


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    spans: tuple | None = None  # the image spans the vision tower encoded (chat with images)
    key: list | None = None  # an image prompt's conversation-cache key (`images.pixel_key`)


async def build_prompt(state: ServingState, source, mode: P.ChatMode | None = None, *, add_special: bool = True,
                       split_special: bool = False, run_tower: bool = True) -> Prompt:
    """The prompt of `source`: chat messages rendered in `mode` when a mode is given, else a
    completions prompt (`add_special`, `split_special`: `_completion_ids`). `run_tower` False
    (`/tokenize`) stops an image prompt after its ids: the positions its spans take, no tower."""
    if mode is None:
        return Prompt(await _completion_ids(state, source, add_special, split_special))
    check_prompt_size(state, "messages", source)
    with_images = refuse_images(state, source)
    try:
        if with_images:
            made = await asyncio.to_thread(state.cfg.images.build, state.tokenizer, source, with_spans=run_tower,
                                           encode=_tower(state), thinking=mode.thinking, effort=mode.effort,
                                           tools=mode.tools)
            return Prompt(made.tokens, made.spans, made.key)
        return Prompt(await asyncio.to_thread(encode_chat_ids, state.tokenizer, source, thinking=mode.thinking,
                                              effort=mode.effort, tools=mode.tools))
    except (ValueError, TypeError) as e:
        raise P.APIError(400, f"messages: {e}", param="messages") from None


def _tower(state: ServingState):
    """The vision tower as a call on the engine thread, between steps (`EngineWorker.call`), for the
    image decoding that runs in a worker thread: across processes it is then published in order with
    the steps, and when a process stops answering the request gets the 503 naming it
    (`EngineWorker.fail_open` answers a running or queued call), where a tower stuck in a collective
    on a thread of its own would never return."""
    loop = asyncio.get_running_loop()

    def encode(patches, n_vit_h: int, n_vit_w: int):
        run = state.worker.call(lambda engine: engine.encode_image(patches, n_vit_h, n_vit_w))
        return asyncio.run_coroutine_threadsafe(run, loop).result()

    return encode


def _one_text(prompt):
    """A list of one text is that text (the form OpenAI's clients send a single prompt in)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return prompt


async def _completion_ids(state: ServingState, prompt, add_special: bool, split_special: bool) -> list[int]:
    """A completions prompt as ids: text (BOS first, when `add_special`), a one-text list, or token ids.
    In text, the text of a special token becomes its id (the convention of `tokenizers` and vLLM, so a
    client that writes its own chat template gets its control ids), unless `split_special` keeps it text."""
    prompt = _one_text(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise P.bad("prompt", "is empty")
        check_prompt_size(state, "prompt", prompt)
        tokenizer = state.tokenizer
        ids = await asyncio.to_thread(partial(tokenizer.encode, split_special_tokens=split_special), prompt)
        if add_special and ids[:1] != [tokenizer.bos_id]:
            ids = [tokenizer.bos_id] + ids
        return ids
    if isinstance(prompt, list) and prompt and all(P.is_int(t) for t in prompt):
        return check_ids(state, "prompt", prompt)
    raise P.bad("prompt", f"expected a string or a list of token ids (on /v1/completions also a list of either: "
                          f"several prompts), got {prompt!r:.80}")


def prompt_batch(prompt) -> list:
    """The prompts of a completions `prompt`: a list of texts or of token-id lists is several prompts
    (OpenAI's batch forms, each prompt's choices in turn); any other value is one prompt."""
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) for p in prompt)):
        return list(prompt)
    return [prompt]


def prompt_text(tokenizer, prompt, ids: list[int]) -> str:
    """The prompt as echo returns it: the text as sent, or the decoded ids of a token prompt."""
    prompt = _one_text(prompt)
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)
