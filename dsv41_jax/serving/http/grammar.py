"""A request's constraint (`protocol.ConstraintSpec`) as llguidance matchers, one per choice."""
from __future__ import annotations

from dsv41_jax.serving.constraints import ConstraintError
from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.state import ServingState
from dsv41_jax.text import special_tokens as st


def build_constraints(state: ServingState, spec: P.ConstraintSpec, mode: P.ChatMode | None, n: int) -> list:
    """One matcher per choice for the request's constraint (run in a worker thread: a large schema
    takes a while to compile); a grammar that cannot be used is a 400 naming the field."""
    g = state.grammars()
    try:
        if spec.kind == "json":
            grammar = g.json_schema(spec.value, spec.param)
        elif spec.kind == "regex":
            grammar = g.regex(spec.value)
        elif spec.kind == "grammar":
            grammar = g.lark(spec.value)
        else:
            functions = [t["function"] for t in mode.tools]
            grammar = g.tool_calls(functions, parallel=spec.parallel, param="tools")
        g.check(grammar, spec.param)
        thinks = mode is not None and mode.reply_thinking
        after = state.tokenizer.token_to_id(st.THINK_END) if thinks else None
        return [g.constraint(grammar, start_after=after) for _ in range(n)]
    except ConstraintError as e:
        raise P.bad(e.param, str(e).split(": ", 1)[1]) from None


def check_call_budget(state: ServingState, spec: P.ConstraintSpec, mode: P.ChatMode, max_tokens: int | None) -> None:
    """Under a forced tool call (`tool_choice` "required" or a named function), a `max_tokens` below
    the fewest tokens any complete call can take could only return a cut call: a 400 before any
    compute, naming the bound. (A budget above it may still cut a long call; that comes back as the
    cut call with finish_reason "length".)"""
    if spec.kind != "tools" or max_tokens is None:
        return
    functions = [t["function"] for t in mode.tools]
    fewest = state.grammars().fewest_call_tokens(functions, parallel=spec.parallel)
    if max_tokens < fewest:
        raise P.bad("max_tokens", f"{max_tokens} is too small for a complete tool call: the forced call to "
                                  f"{', '.join(repr(f.get('name')) for f in functions)} takes at least {fewest} "
                                  f"tokens; raise max_tokens to {fewest} or more")
