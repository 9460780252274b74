"""schemathesis hooks for the server's OpenAPI run (loaded with SCHEMATHESIS_HOOKS).

The request schemas in /openapi.json state every rule JSON Schema can state (types, ranges, enums,
the model id, the vocabulary, what each chat role needs). A few refusals depend on relations between
values, or on the language inside a string, which no JSON Schema can state; a schema-valid body is
then refused, rightly, with a 400 that names the rule. Only those 400s are dropped from
`positive_data_acceptance`, each matched by its parameter and its message; every other refusal of a
body the schema allows fails the run.
"""
import re

import schemathesis

# (param, message pattern): the refusals a JSON Schema cannot express.
UNSTATABLE = (
    ("tool_choice", r"names the function .*, which is not in tools"),  # a value that must equal another's
    (None, r"one constraint per request"),  # response_format / tool_choice / structured_outputs: at most one
    ("messages", r"'reasoning_content' and 'reasoning' disagree"),  # two fields that must be equal if both given
    ("logit_bias", r"outside the model's vocabulary"),  # a key's number against the vocabulary size
    (None, r"maximum model length"),  # the prompt's token count (after tokenizing), alone or plus max_tokens
    ("prompt", r"prompts x \d+ choices need \d+ batch slots"),  # a product of two fields against the slots
    (r"structured_outputs\.(regex|grammar|json)|response_format.*", r".*"),  # the pattern, grammar or schema language
)


def unstatable(status: int, error: dict) -> bool:
    """A 400 for one of the rules above."""
    if status != 400 or not isinstance(error, dict):
        return False
    param, message = error.get("param") or "", error.get("message") or ""
    return any((p is None or re.fullmatch(p, param)) and re.search(m, message) for p, m in UNSTATABLE)


@schemathesis.hook
def filter_failure(ctx, failure, case, response):
    if type(failure).__name__ != "RejectedPositiveData":
        return True
    try:
        error = response.json().get("error")
    except Exception:
        return True
    return not unstatable(response.status_code, error)
