"""DeepSeek-V4.1 chat encoding: OpenAI-style messages -> prompt text (and ids).

DeepSeek ships no Jinja template; the rules below follow its reference encoder
(`encoding/encoding.py` of the checkpoint) as vendored, with fixtures, by vLLM
(vllm/tokenizers/deepseek_v41_encoding.py, tests/tokenizers_/test_deepseek_v41.py) and SGLang
(python/sglang/srt/entrypoints/openai/encoding_dsv41.py, test_encoding_dsv41.py):

- BOS once, at the start of a context (`add_bos=False` to continue one).
- The first turn is hosted by `<｜System｜>` when it is a system message or in thinking mode,
  where it starts with `Reasoning Effort: N (range 1-100, ...)` and a blank line. A later
  system message gets its own `<｜System｜>` and behaves like a user turn.
- Users: `<｜User｜>text`. Tool results merge into the user turn as
  `<tool_result>...</tool_result>` blocks, sorted by call order, joined by a blank line.
- After the last user-like turn before an assistant (or at the end) comes `<｜Assistant｜>`
  then `<think>` (thinking) or `</think>` (chat). Assistant turns are
  `reasoning</think>content[DSML calls]<｜end▁of▁sentence｜>`.
- In thinking mode reasoning before the last user turn is dropped (and that turn's header
  is `</think>`) unless tools are offered, since tool loops need the earlier reasoning.
- A `developer` message is a user turn of its own (`<｜User｜>text`, never merged with a
  neighbour); in thinking mode with reasoning dropped, developer messages before the last
  user-like turn are dropped too.
- `latest_reminder` messages are `<｜latest_reminder｜>text`; a user-like turn followed by one
  still gets the assistant header.
- A message's `task` (action, query, authority, domain, title, read_url) replaces the header
  after it: `<｜query｜>` etc. directly, or for `action` `<｜Assistant｜>`, `</think>` (chat) or
  `<think>` (thinking), `<｜action｜>`; the assistant turn that answers a task has no reasoning
  part. A user message does not merge into a user turn that carries a task.
- Tool-call arguments: a JSON object, its JSON text (encoded once or twice); any other value
  (text that is not JSON, the empty string, JSON that is not an object) is passed through as a
  single parameter named `arguments`, as the reference encoder does.
- A literal `<｜deepseek_image｜>` in caller text is rewritten to `<|deepseek_image|>` (ASCII
  pipes, the spelling SGLang PR #40758 uses) so it can never become the image id.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import types
from collections.abc import Mapping, Sequence

from dsv41_jax.text import dsml as chat_dsml
from dsv41_jax.text import pieces as P
from dsv41_jax.text import special_tokens as st

# Two named-effort tables circulate (the project's design notes, SPEC.md "Reasoning effort"):
# the DeepSeek API's low/high/max = 50/75/100 (our default), and the one vLLM and SGLang ship in
# their V4.1 encoders (vLLM vllm/tokenizers/deepseek_v41_encoding.py REASONING_EFFORT_MAPPINGS:
# low/high/xhigh/max = 25/50/75/100, default "high" = 50). Integers 1-100 mean the same in both.
# `effort_table` / `dsv41 serve --effort-table` choose; which one the checkpoint's encoder at
# dba1be0 has cannot be read here.
DEFAULT_EFFORT_TABLE: Mapping[str, int] = types.MappingProxyType({"low": 50, "high": 75, "max": 100})
EFFORT_TABLES: Mapping[str, Mapping[str, int]] = types.MappingProxyType({
    "deepseek-api": DEFAULT_EFFORT_TABLE,
    "v41-encoder": types.MappingProxyType({"low": 25, "high": 50, "xhigh": 75, "max": 100}),
})
DEFAULT_EFFORT_NAME = "high"  # reference DEFAULT_REASONING_EFFORT, used when effort is None
EFFORT_MIN, EFFORT_MAX = 1, 100
IMAGE_ESCAPED = "<|deepseek_image|>"
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
USER_LIKE = ("user", "developer")  # roles whose turn asks for a reply (a system turn after the first does too)


def escape_image_placeholder(text: str) -> str:
    """Replace the image special token by its ASCII-pipe spelling, which is plain text."""
    return text.replace(st.IMAGE, IMAGE_ESCAPED)


def effort_line(budget: int) -> str:
    """The thinking-mode line the model was trained to read its reasoning budget from."""
    return f"Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def _is_int(value) -> bool:
    """3, or a JSON client's 3.0 (JSON has one number type), never true or 3.5."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())


def _checked_table(effort_table) -> Mapping[str, int]:
    table = DEFAULT_EFFORT_TABLE if effort_table is None else effort_table
    if not isinstance(table, Mapping):
        raise ValueError(f"effort_table must map names to ints, got {type(table).__name__}")
    for name, budget in table.items():
        if not isinstance(name, str) or not _is_int(budget) or not EFFORT_MIN <= budget <= EFFORT_MAX:
            raise ValueError(f"effort_table entry {name!r}: {budget!r} must map a str to an int in 1-100")
    return table


def parse_effort_table(text: str) -> Mapping[str, int]:
    """A table from its name in EFFORT_TABLES or from `name=N,name=N,...` (N in 1-100; it must
    name "high", the budget used when a thinking request gives no effort)."""
    text = text.strip()
    if text in EFFORT_TABLES:
        return EFFORT_TABLES[text]
    table = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value.lstrip("+").isdigit():
            raise ValueError(f"effort table {text!r}: {item!r} is not name=N; give one of "
                             f"{sorted(EFFORT_TABLES)} or name=N pairs like low=25,high=50,max=100")
        table[name] = int(value)
    table = dict(_checked_table(table))
    if DEFAULT_EFFORT_NAME not in table:
        raise ValueError(f"effort table {text!r} has no {DEFAULT_EFFORT_NAME!r}: it is the budget of a thinking "
                         "request without an effort; add it")
    return types.MappingProxyType(table)


def resolve_effort(effort, effort_table=None) -> int:
    """The numeric budget for `effort`: an int in 1-100 or a name from the table."""
    table = _checked_table(effort_table)
    accepted = f"an int in {EFFORT_MIN}-{EFFORT_MAX} or one of {dict(table)}"
    if effort is None:
        if DEFAULT_EFFORT_NAME not in table:
            raise ValueError(f"effort=None means {DEFAULT_EFFORT_NAME!r}, which effort_table lacks; pass {accepted}")
        effort = DEFAULT_EFFORT_NAME
    if _is_int(effort) and EFFORT_MIN <= effort <= EFFORT_MAX:
        return int(effort)
    if isinstance(effort, str) and effort in table:
        return int(table[effort])
    raise ValueError(f"effort {effort!r} is not accepted; use {accepted}")


IMAGE_PART_TYPES = ("image_url", "image", "input_image")


@dataclasses.dataclass(frozen=True)
class _Block:
    """One piece of a user turn: plain text or one tool result. With images, `parts` holds its
    content parts in order (text, or an image part that renders as the image placeholder)."""

    text: str
    tool_call_id: str | None = None  # set only for tool results
    parts: tuple = ()  # ("text", str) / ("image", part) items, only when the content has images

    def render(self) -> list[P.Piece]:
        body = [P.caller(self.text)]
        if self.parts:  # the reference joins parts with a blank line, an image as its placeholder text
            body = []
            for j, (kind, value) in enumerate(self.parts):
                body += [P.encoder("\n\n")] if j else []
                body.append(P.ImagePiece(st.IMAGE, True, part=value) if kind == "image" else P.caller(value))
        if self.tool_call_id is None:
            return body
        return [P.encoder("<tool_result>"), *body, P.encoder("</tool_result>")]


@dataclasses.dataclass(frozen=True)
class _Turn:
    """A validated message after tool results are merged into user turns."""

    role: str
    content: str = ""
    blocks: tuple[_Block, ...] = ()
    reasoning: str = ""
    calls: tuple[tuple[str | None, str, dict], ...] = ()  # (id, name, arguments)
    functions: tuple[Mapping, ...] = ()  # tool definitions hosted by this system (or developer) turn
    response_format: object = None  # a system/developer message's own `response_format`, rendered after its tools
    task: str | None = None  # a quick-instruction task marker after this turn (st.TASKS)
    wo_eos: bool = False  # an assistant turn left open: no EOS after it (the reply continues)


def _text_of(value, where: str) -> str:
    """Message text from a str or a list of {"type": "text"} parts (joined by a blank line)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        parts = []
        for part in value:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: only text parts are supported by the chat encoder, got {kind!r}")
            parts.append(part["text"])
        return "\n\n".join(parts)
    raise ValueError(f"{where}: content must be a str or a list of text parts, got {type(value).__name__}")


def _required_text(msg: Mapping, where: str) -> str:
    if msg.get("content") is None:
        raise ValueError(f"{where}: missing 'content' (use an empty string for an empty message)")
    return escape_image_placeholder(_text_of(msg["content"], where))


def _block(msg: Mapping, where: str, images: bool, tool_call_id: str | None = None) -> _Block:
    """A user or tool message's block; with `images`, image content parts become placeholders."""
    content = msg.get("content")
    if not (images and isinstance(content, Sequence) and not isinstance(content, str)
            and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES for p in content)):
        return _Block(_required_text(msg, where), tool_call_id)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind in IMAGE_PART_TYPES:
            parts.append(("image", part))
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", escape_image_placeholder(part["text"])))
        else:
            raise ValueError(f"{where}: only text and image parts are supported by the chat encoder, got {kind!r}")
    return _Block("\n\n".join(v for k, v in parts if k == "text"), tool_call_id, tuple(parts))


def _tool_call(call, where: str) -> tuple[str | None, str, dict]:
    if isinstance(call, Mapping) and call.get("type") not in (None, "function"):
        raise ValueError(f"{where}: a tool call's type is 'function' (or left out), got {call['type']!r:.80}")
    if isinstance(call, Mapping) and call.get("id") is not None and not isinstance(call["id"], str):
        raise ValueError(f"{where}: a tool call's id is a string, got {call['id']!r:.80}")
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: each tool call needs {{'function': {{'name': str, 'arguments': ...}}}}, got {call!r}")
    raw = function.get("arguments", {})
    arguments = raw
    for _ in range(2):  # a JSON object, its JSON text, or that text encoded once more (clients do send it)
        if not isinstance(arguments, str):
            break
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            break
    if not isinstance(arguments, Mapping):  # reference: anything else is passed through as one parameter
        arguments = {"arguments": raw}
    return call.get("id", function.get("id")), function["name"], dict(arguments)


def _assistant(msg: Mapping, where: str) -> _Turn:
    calls = tuple(_tool_call(c, where) for c in (msg.get("tool_calls") or ()))
    if "content" not in msg and not calls:
        raise ValueError(f"{where}: assistant message has neither 'content' nor 'tool_calls'")
    content = "" if msg.get("content") is None else escape_image_placeholder(_text_of(msg["content"], where))
    reasoning, alias = msg.get("reasoning_content"), msg.get("reasoning")  # vLLM accepts both names
    if reasoning is not None and alias is not None and reasoning != alias:
        raise ValueError(f"{where}: 'reasoning_content' and 'reasoning' disagree; pass one of them")
    reasoning = reasoning if reasoning is not None else alias
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}: reasoning must be a str, got {type(reasoning).__name__}")
    return _Turn("assistant", content=content, reasoning=escape_image_placeholder(reasoning or ""), calls=calls)


def _task(msg: Mapping, where: str) -> str | None:
    task = msg.get("task")
    if task is not None and task not in st.TASKS:
        raise ValueError(f"{where}: task {task!r} is not one of {sorted(st.TASKS)}")
    return task


def _wo_eos(msg: Mapping, where: str) -> bool:
    """An assistant message's `wo_eos` ("without EOS"): DeepSeek's official V4 encoder
    (`encoding/encoding_dsv4.py`, render_message's assistant branch) writes the reply without its
    closing EOS when it is set, so a conversation ending in such a message asks the model to
    continue that reply (vLLM's `continue_final_message`). Only assistant messages render it; the
    reference tests truthiness, we ask for a bool (a string "false" would silently count as set).
    On other roles it is carried and never rendered (as in the reference): accepted, no effect."""
    value = msg.get("wo_eos", False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: wo_eos must be true or false, got {value!r}")
    return value


def _hosted(msg: Mapping, where: str) -> dict:
    """A system or developer message's own `tools` and `response_format`: DeepSeek's encoder renders
    them after that message's text (render_message: "\n\n" + the tools block, then "\n\n## Response
    Format:..." with the value as JSON), and any message's tools keep earlier reasoning (as request
    tools do). Other roles carry neither (the reference ignores them there)."""
    try:
        functions = tool_functions(msg.get("tools") or None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    rf = msg.get("response_format")
    if rf and not isinstance(rf, (Mapping, list, str)):
        raise ValueError(f"{where}: response_format must be a JSON object, got {type(rf).__name__}")
    return {"functions": functions, "response_format": rf or None}


def _mask(msg: Mapping, where: str) -> None:
    """A message's `mask`: DeepSeek's official encoder keeps it on every message (its
    merge_tool_messages carries "task", "wo_eos" and "mask" over to merged user turns) and no
    renderer reads it, so it never changes the prompt. It is a training field: see
    `train.data.chat_document`. Only its value is checked here: true/false, or 1/0 as DeepSeek's own
    encoder fixtures write it (an assistant turn with `"mask": 1`)."""
    value = msg.get("mask", False)
    if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
        raise ValueError(f"{where}: mask must be true or false (or 1 or 0), got {value!r}")


def _validated(messages, images: bool = False) -> list[_Turn]:
    """Check every message and convert it; tool messages become one-block user turns."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    turns = []
    for index, msg in enumerate(messages):
        where = f"messages[{index}]"
        role = msg.get("role") if isinstance(msg, Mapping) else None
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; accepted roles are {ROLES}")
        task, wo_eos = _task(msg, where), _wo_eos(msg, where)
        _mask(msg, where)
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):  # text where the role reads it
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise ValueError(f"{where}: {key} must be a string, got {type(msg[key]).__name__}")
        if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
            raise ValueError(f"{where}: tool_calls must be a list, got {type(msg['tool_calls']).__name__}")
        if role != "assistant":  # carried and never rendered, as in the reference; still a well-formed list
            for call in msg.get("tool_calls") or ():
                _tool_call(call, where)
        if role == "latest_reminder":
            turns.append(_Turn(role, content=_required_text(msg, where), task=task))
        elif role == "system":
            turns.append(_Turn(role, content=_required_text(msg, where), task=task, **_hosted(msg, where)))
        elif role == "developer":  # rendered `<｜User｜>text` but its own turn (reference: content required)
            text = _required_text(msg, where)
            if not text:
                raise ValueError(f"{where}: a developer message needs non-empty content")
            turns.append(_Turn("developer", blocks=(_Block(text),), task=task, **_hosted(msg, where)))
        elif role == "user":
            turns.append(_Turn("user", blocks=(_block(msg, where, images),), task=task))
        elif role == "tool":
            call_id = msg.get("tool_call_id") or ""
            turns.append(_Turn("user", blocks=(_block(msg, where, images, str(call_id)),)))
        else:
            turns.append(dataclasses.replace(_assistant(msg, where), task=task, wo_eos=wo_eos))
    return turns


def _merge_user_turns(turns: list[_Turn]) -> list[_Turn]:
    """Consecutive user and tool messages form one user turn (V4.1 has no tool role).

    As in the reference: a tool result always joins the user turn before it; a user message
    joins it only if that turn carries no task, and the joined turn keeps the first one's task."""
    merged: list[_Turn] = []
    for turn in turns:
        from_tool = bool(turn.blocks) and turn.blocks[0].tool_call_id is not None
        if (turn.role == "user" and merged and merged[-1].role == "user"
                and (from_tool or merged[-1].task is None)):
            merged[-1] = dataclasses.replace(merged[-1], blocks=merged[-1].blocks + turn.blocks)
        else:
            merged.append(turn)
    return merged


def _sort_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Order a turn's tool results like the calls of the latest assistant that made calls."""
    order: dict[str, int] = {}
    out = []
    for turn in turns:
        if turn.role == "assistant" and turn.calls:
            order = {call_id: i for i, (call_id, _, _) in enumerate(turn.calls) if call_id}
        results = [b for b in turn.blocks if b.tool_call_id is not None]
        if turn.role == "user" and len(results) > 1 and order:
            queue = iter(sorted(results, key=lambda b: order.get(b.tool_call_id, 0)))
            blocks = tuple(next(queue) if b.tool_call_id is not None else b for b in turn.blocks)
            turn = dataclasses.replace(turn, blocks=blocks)
        out.append(turn)
    return out


def tool_functions(tools) -> tuple[Mapping, ...]:
    """The `function` objects of an OpenAI tools list, each checked for its shape (ValueError names the entry)."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of OpenAI tool dicts, got {type(tools).__name__}")
    functions = []
    for i, tool in enumerate(tools):
        ok = isinstance(tool, Mapping) and tool.get("type", "function") == "function"
        function = tool.get("function") if ok else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}, got {tool!r}")
        for key, kind, what in (("description", str, "a string"), ("parameters", Mapping, "a JSON schema object"),
                                ("strict", bool, "true or false")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise ValueError(f"tools[{i}].function.{key} must be {what}, got {function[key]!r:.80}")
        functions.append(function)
    return tuple(functions)


def _attach_tools(turns: list[_Turn], functions: tuple[Mapping, ...]) -> list[_Turn]:
    """Tool definitions live in the first system turn; an empty one is added if needed (as vLLM does)."""
    if not functions:
        return turns
    if turns[0].role == "system":  # after the message's own tools, if it has some
        return [dataclasses.replace(turns[0], functions=turns[0].functions + functions)] + turns[1:]
    return [_Turn("system", functions=functions)] + turns


def _last_user(turns: list[_Turn]) -> int:
    user_like = [i for i, t in enumerate(turns) if t.role in USER_LIKE or (t.role == "system" and i > 0)]
    return user_like[-1] if user_like else -1


def _drop_before_last_user(turns: list[_Turn]) -> list[_Turn]:
    """Thinking mode with reasoning dropped: turns before the last user-like one other than user,
    system, reminder and assistant turns (that is, developer turns) are dropped (reference)."""
    last_user = _last_user(turns)
    return [t for i, t in enumerate(turns) if i >= last_user or t.role != "developer"]


RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def _hosted_pieces(turn: _Turn) -> list[P.Piece]:
    """The tools block and the response-format block a system or developer turn hosts (reference
    render_message: each after a blank line, tools first; the schemas are the caller's text)."""
    out = []
    if turn.functions:
        out.append(P.encoder("\n\n"))
        out += chat_dsml.render_tool_definitions(turn.functions, escape_image_placeholder)
    if turn.response_format:
        out += [P.encoder("\n\n" + RESPONSE_FORMAT_HEAD),
                P.caller(escape_image_placeholder(chat_dsml.to_json(turn.response_format)))]
    return out


def _render(turns: list[_Turn], *, thinking: bool, budget: int, keep_reasoning: bool, add_bos: bool) -> list[P.Piece]:
    """The prompt as pieces: the encoder's markers and instructions, and the callers' text."""
    drop = thinking and not keep_reasoning
    if drop:
        turns = _drop_before_last_user(turns)
    last_user = _last_user(turns)
    out = [P.encoder(st.BOS)] if add_bos else []
    for i, turn in enumerate(turns):
        if i == 0 and (thinking or turn.role == "system"):
            out.append(P.encoder(st.SYSTEM))
        if i == 0 and thinking:
            out.append(P.encoder(effort_line(budget)))
        if turn.role == "system":
            out += [P.encoder(st.SYSTEM if i > 0 else ""), P.caller(turn.content)] + _hosted_pieces(turn)
        elif turn.role in USER_LIKE:
            out.append(P.encoder(st.USER))
            for j, block in enumerate(turn.blocks):
                out += ([P.encoder("\n\n")] if j else []) + block.render()
            out += _hosted_pieces(turn)
        elif turn.role == "latest_reminder":
            out += [P.encoder(st.LATEST_REMINDER), P.caller(turn.content)]
        else:
            answers_task = i > 0 and turns[i - 1].task is not None
            if thinking and not answers_task and (not drop or i > last_user):
                out += [P.caller(turn.reasoning), P.encoder(st.THINK_END)]
            out.append(P.caller(turn.content))
            if turn.calls:
                calls = [(name, args) for _, name, args in turn.calls]
                out += chat_dsml.render_tool_calls(calls, escape_image_placeholder)
            if not turn.wo_eos:
                out.append(P.encoder(st.EOS))
        if i + 1 < len(turns) and turns[i + 1].role not in ("assistant", "latest_reminder"):
            continue
        if turn.task == "action":
            out.append(P.encoder(st.ASSISTANT + (st.THINK_START if thinking else st.THINK_END) + st.TASKS["action"]))
        elif turn.task is not None:
            out.append(P.encoder(st.TASKS[turn.task]))
        elif turn.role in USER_LIKE or (turn.role == "system" and i > 0):
            opens_thinking = thinking and (not drop or i >= last_user)
            out.append(P.encoder(st.ASSISTANT + (st.THINK_START if opens_thinking else st.THINK_END)))
    return out


def encode_chat_pieces(
    messages,
    *,
    thinking: bool,
    effort=None,
    tools=None,
    effort_table=None,
    add_bos: bool = True,
    drop_thinking: bool = True,
    images: bool = False,
) -> list[P.Piece]:
    """The DeepSeek-V4.1 prompt for `messages` (OpenAI chat format), as pieces that say which
    text the encoder wrote (dsv41_jax.text.pieces); `encode_chat` joins them.

    thinking: thinking mode (`<think>` after the final `<｜Assistant｜>`) or chat (`</think>`).
    effort: int 1-100 or a name from `effort_table` (default {"low": 50, "high": 75, "max": 100});
      None means "high". Validated in both modes, written only in thinking mode.
    tools: OpenAI tool list; rendered after the first system message and keeps earlier reasoning.
    drop_thinking: False keeps earlier turns' reasoning even without tools (reference option).
    images: image content parts of user and tool messages become the image placeholder (an
      `ImagePiece` carrying the part, `pieces.image_parts` lists them in prompt order), joined with
      the text parts by a blank line as the reference does; without it they are refused.
    A conversation that ends with an assistant turn gets no new `<｜Assistant｜>` header; with
    `"wo_eos": true` on that turn its EOS is left off too, so the model continues the reply.
    """
    if not isinstance(thinking, bool):
        raise ValueError(f"thinking must be True or False, got {thinking!r}")
    budget = resolve_effort(effort, effort_table)
    functions = tool_functions(tools)
    turns = _sort_tool_results(_merge_user_turns(_validated(messages, images)))
    turns = _attach_tools(turns, functions)
    keep = any(t.functions for t in turns) or not drop_thinking  # reference: any message's tools
    return _render(turns, thinking=thinking, budget=budget, keep_reasoning=keep, add_bos=add_bos)


def encode_chat(messages, **kwargs) -> str:
    """The DeepSeek-V4.1 prompt text for `messages`; arguments as for `encode_chat_pieces`.

    The text is the reference encoder's string. Tokenize prompts with `encode_chat_ids`, never
    by encoding this text: only there does special-token text from callers stay plain text.
    """
    return P.join(encode_chat_pieces(messages, **kwargs))


def encode_chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    """Token ids of the prompt for `messages` with a dsv41_jax.text.tokenizer.Tokenizer (or the
    training byte tokenizer): control ids only for the encoder's own markers, callers' text as text.

    Fails if the tokenizer lacks a role/reasoning marker as an added token (the prompt would
    silently become plain text), and if the image id shows up (escaping must prevent that).
    """
    return pieces_to_ids(tokenizer, encode_chat_pieces(messages, **kwargs))


def pieces_to_ids(tokenizer, pieces) -> list[int]:
    """`encode_chat_ids` for pieces already rendered (the server keeps them to find the image parts)."""
    added = set(tokenizer.added_tokens().values())
    written = "".join(p.text for p in pieces if p.from_encoder)
    used = [m for m in (st.LATEST_REMINDER, *st.TASKS.values()) if m in written]
    missing = [m for m in (*st.STRUCTURAL, *used) if m not in added]
    if missing:
        raise ValueError(
            f"{tokenizer.path} lacks the special tokens {missing} as added tokens; "
            "the prompt would be tokenized as plain text. Is this the DeepSeek-V4.1 tokenizer.json?"
        )
    ids = tokenizer.encode_pieces(pieces)
    image_id = tokenizer.token_to_id(st.IMAGE)
    n_images = len(P.image_parts(pieces))
    if n_images and image_id is None:
        raise ValueError(f"{tokenizer.path} has no image token {st.IMAGE!r}; it cannot encode a prompt with images")
    if image_id is not None and ids.count(image_id) != n_images:
        raise RuntimeError(f"image id {image_id} appears {ids.count(image_id)} times for {n_images} images; "
                           "placeholder escaping failed")
    return ids
