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


def render_tool_definitions(functions: Sequence[Mapping], escape: Callable[[str], str]) -> str:
    """The block appended (after a blank line) to the system message when tools are offered.

    `functions` are the OpenAI `function` objects, one JSON line each, in the caller's order.
    """
    schemas = "\n".join(escape(to_json(dict(f))) for f in functions)
    closing = "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls."
    return f"{_tools_preamble()}\n\n{schemas}\n\n{closing}\n"


def _render_parameter(name: str, value, escape: Callable[[str], str]) -> str:
    # Strings go in raw with string="true"; everything else as JSON with string="false".
    is_string = isinstance(value, str)
    text = value if is_string else to_json(value)
    flag = "true" if is_string else "false"
    return f'<{PARAMETER_TAG} name="{escape(name)}" string="{flag}">{escape(text)}</{PARAMETER_TAG}>'


def render_tool_calls(calls: Sequence[tuple[str, Mapping]], escape: Callable[[str], str]) -> str:
    """The `\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls>` tail of an assistant turn.

    `calls` are (function name, decoded argument object) pairs, in call order.
    """
    invokes = []
    for name, arguments in calls:
        params = "\n".join(_render_parameter(k, v, escape) for k, v in arguments.items())
        invokes.append(f'<{INVOKE_TAG} name="{escape(name)}">\n{params}\n</{INVOKE_TAG}>')
    body = "\n".join(invokes)
    return f"\n\n<{CALLS_TAG}>\n{body}\n</{CALLS_TAG}>"
