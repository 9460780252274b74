"""argparse types shared by the subcommands, so a bad number names its flag before any work starts.

argparse prefixes the message with the flag (`argument --seed: must be >= 0, got -1`) and exits
with code 2.
"""
from __future__ import annotations

import argparse
import math


def _number(text: str, kind, least, strict: bool):
    try:
        value = kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun} {'>' if strict else '>='} {least}, got {text!r}") from None
    if not math.isfinite(value) or value < least or (strict and value == least):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, strict=False)


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, strict=True)


def non_negative_float(text: str) -> float:
    return _number(text, float, 0.0, strict=False)


def effort_table(text: str):
    """--effort-table: a name in chat.EFFORT_TABLES or name=N pairs (chat.parse_effort_table)."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.text.chat import parse_effort_table

    try:
        return parse_effort_table(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
