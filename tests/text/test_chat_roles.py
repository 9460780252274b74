"""Chat-encoder inputs: the `developer` role (rendered `<｜User｜>text`, as the reference does), tool-call
ids under `function.id`, and `arguments` given as an object, its JSON text, that text JSON-encoded
again, or anything else (passed through as one `arguments` parameter, as the reference does)."""
import json

import pytest

from dsv41_jax.text import special_tokens as st
from dsv41_jax.text.chat import encode_chat

USER = [{"role": "user", "content": "hi"}]


def test_developer_renders_as_user():
    dev = encode_chat([{"role": "developer", "content": "hi"}], thinking=False)
    assert dev == encode_chat(USER, thinking=False) and st.USER + "hi" + st.ASSISTANT in dev


@pytest.mark.parametrize("arguments", [{"city": "Paris"}, json.dumps({"city": "Paris"}),
                                       json.dumps(json.dumps({"city": "Paris"}))])
def test_tool_call_argument_forms(arguments):
    def conv(args, key="id"):
        call = {"type": "function", "function": {"name": "w", "arguments": args}}
        if key == "id":
            call["id"] = "c1"
        else:
            call["function"]["id"] = "c1"
        return USER + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    want = encode_chat(conv({"city": "Paris"}), thinking=False)
    assert encode_chat(conv(arguments), thinking=False) == want
    assert encode_chat(conv(arguments, key="function"), thinking=False) == want
    # anything that is not a JSON object passes through as one parameter (the reference encoder's rule)
    assert encode_chat(conv(""), thinking=False) == encode_chat(conv({"arguments": ""}), thinking=False)
    assert encode_chat(conv("city=Paris"), thinking=False) == encode_chat(conv({"arguments": "city=Paris"}), thinking=False)
