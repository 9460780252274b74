"""The DeepSeek-V4.1 special-token strings and the ids the rest of the package relies on.

The strings use FULLWIDTH VERTICAL LINE (U+FF5C) and LOWER ONE EIGHTH BLOCK (U+2581), not
ASCII '|' and '_'; a look-alike spelling tokenizes as plain text, so every module takes
them from here. Sources: docs/REFERENCE.md §9 and the DeepSeek-V4.1 reference encoder as vendored by
vLLM (vllm/tokenizers/deepseek_v41_encoding.py) and SGLang
(python/sglang/srt/entrypoints/openai/encoding_dsv41.py).
"""
from __future__ import annotations

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
PAD = "<\uff5c\u2581pad\u2581\uff5c>"
SYSTEM = "<\uff5cSystem\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
THINK_START = "<think>"
THINK_END = "</think>"
IMAGE = "<\uff5cdeepseek_image\uff5c>"
# A reminder message (role "latest_reminder") and the quick-instruction task markers (a message's
# "task"), as the reference encoder writes them (vLLM vllm/tokenizers/deepseek_v41_encoding.py,
# SGLang python/sglang/srt/entrypoints/openai/encoding_dsv41.py: LATEST_REMINDER_SP_TOKEN, DS_TASK_SP_TOKENS).
LATEST_REMINDER = "<\uff5clatest_reminder\uff5c>"
TASKS = {name: f"<\uff5c{name}\uff5c>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
DSML = "\uff5cDSML\uff5c"

# The role and reasoning markers the chat encoder writes; each must be one added token.
STRUCTURAL = (BOS, EOS, SYSTEM, USER, ASSISTANT, THINK_START, THINK_END)
# Tokens the model has to be able to emit, so they must never be masked at sampling.
GENERATED = (EOS, THINK_START, THINK_END)

# docs/REFERENCE.md §9: config.json says BOS 0, EOS 1, pad 2, image_token_id 129264.
DEFAULT_BOS_ID = 0
DEFAULT_EOS_ID = 1
DEFAULT_PAD_ID = 2
IMAGE_TOKEN_ID = 129264

# docs/REFERENCE.md §9 "Safety": input-only ids, as public engines list them. Inclusive range plus extras.
SENTINEL_FIRST_ID = 128847
SENTINEL_LAST_ID = 129270
SENTINEL_EXTRA_IDS = (129279,)


def spec_sentinel_ids() -> tuple[int, ...]:
    """The input-only ids of docs/REFERENCE.md §9 "Safety", before any check against a tokenizer file."""
    return tuple(range(SENTINEL_FIRST_ID, SENTINEL_LAST_ID + 1)) + SENTINEL_EXTRA_IDS
