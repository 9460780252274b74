"""DSML: how DeepSeek-V4.1 writes tool definitions and tool calls into a prompt.

V4.1 renamed the V4 tags: blocks are `<｜DSML｜ calls>`, `<｜DSML｜ invoke name=..>` and
`<｜DSML｜ parameter name=.. string="true|false">`, each with a leading space in the tag
name (V4 used `tool_calls`, `invoke`, `parameter` without the space). Byte layout checked
against the reference-encoder fixtures vendored by vLLM
(tests/tokenizers_/fixtures/deepseek_v41/test_output_1.txt) and SGLang
(test/registered/unit/entrypoints/openai/test_encoding_dsv41.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from dsv41_jax.text import pieces as P
from dsv41_jax.text import special_tokens as st

CALLS_TAG = st.DSML + " calls"
INVOKE_TAG = st.DSML + " invoke"
PARAMETER_TAG = st.DSML + " parameter"


def to_json(value) -> str:
    """JSON as the reference writes it: default separators, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False)


def _tools_preamble() -> str:
    """The fixed instructions placed before the tool schemas (reference TOOLS_TEMPLATE)."""
    example = "\n".join(
        [
            f"<{CALLS_TAG}>",
            f'<{INVOKE_TAG} name="$TOOL_NAME">',
            f'<{PARAMETER_TAG} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{PARAMETER_TAG}>',
            "...",
            f"</{INVOKE_TAG}>",
            f'<{INVOKE_TAG} name="$TOOL_NAME2">',
            "...",
            f"</{INVOKE_TAG}>",
            f"</{CALLS_TAG}>",
        ]
    )
    paragraphs = [
        "## Tools",
        "You have access to a set of tools to help answer the user's question. You can invoke "
        f'tools by writing a "<{CALLS_TAG}>" block like the following:',
        example,
        'String parameters should be specified as is and set `string="true"`. For all other '
        "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
        '`string="false"`.',
        f"If thinking_mode is enabled (triggered by {st.THINK_START}), you MUST output your "
        f"complete reasoning inside {st.THINK_START}...{st.THINK_END} BEFORE any tool calls or "
        "final response.",
        f"Otherwise, output directly after {st.THINK_END} with tool calls or final response.",
        "### Available Tool Schemas",
    ]
    return "\n\n".join(paragraphs)


def render_tool_definitions(functions: Sequence[Mapping], escape: Callable[[str], str]) -> list[P.Piece]:
    """The block appended (after a blank line) to the system message when tools are offered.

    `functions` are the OpenAI `function` objects, one JSON line each, in the caller's order;
    the schemas are caller text (dsv41_jax.text.pieces), the instructions around them the encoder's.
    """
    out = [P.encoder(f"{_tools_preamble()}\n\n")]
    for i, function in enumerate(functions):
        out += [P.encoder("\n")] if i else []
        out.append(P.caller(escape(to_json(dict(function)))))
    closing = "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls."
    return out + [P.encoder(f"\n\n{closing}\n")]


def _render_parameter(name: str, value, escape: Callable[[str], str]) -> list[P.Piece]:
    # Strings go in raw with string="true"; everything else as JSON with string="false".
    is_string = isinstance(value, str)
    text = value if is_string else to_json(value)
    flag = "true" if is_string else "false"
    return [P.encoder(f'<{PARAMETER_TAG} name="'), P.caller(escape(name)), P.encoder(f'" string="{flag}">'),
            P.caller(escape(text)), P.encoder(f"</{PARAMETER_TAG}>")]


def render_tool_calls(calls: Sequence[tuple[str, Mapping]], escape: Callable[[str], str]) -> list[P.Piece]:
    """The `\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls>` tail of an assistant turn.

    `calls` are (function name, decoded argument object) pairs, in call order; names and
    arguments are caller text.
    """
    out = [P.encoder(f"\n\n<{CALLS_TAG}>\n")]
    for i, (name, arguments) in enumerate(calls):
        out += [P.encoder("\n")] if i else []
        out += [P.encoder(f'<{INVOKE_TAG} name="'), P.caller(escape(name)), P.encoder('">\n')]
        for j, (key, value) in enumerate(arguments.items()):
            out += [P.encoder("\n")] if j else []
            out += _render_parameter(key, value, escape)
        out.append(P.encoder(f"\n</{INVOKE_TAG}>"))
    return out + [P.encoder(f"\n</{CALLS_TAG}>")]
