"""Values parsed from text this process did not write (ledger rows, config.json, host
files), within limits, so that no file can exhaust the reader's stack, memory or time.

Python's own parsers recurse once per nesting level (a line of ``[`` raises
``RecursionError``), build every value before a caller sees one (a line of ``[],`` is
millions of lists), and turn digits into integers of any size (``float()`` of one raises
``OverflowError``). Here a JSON document is first measured on its structure alone, its
strings blanked by one regular expression: the values it holds, all levels together, and
its depth. Only a document within :class:`Limits` is parsed, with integers, numbers and
strings checked as they are built. Anything out of bounds is one :class:`OutOfBounds`
(a ``ValueError``) whose ``reason`` names the limit, for a caller to count or refuse.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

# A JSON string, escapes included, in the unrolled form (no backtracking per character).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPENS = re.compile(r"[\[{]|[\]}]")


@dataclass(frozen=True)
class Limits:
    """The most a document may hold: nesting levels, decimal digits of one integer
    (2**64 has 20), characters of one string, and values of all levels together."""

    depth: int = 32
    digits: int = 20
    string: int = 2**20
    values: int = 1_000_000


class OutOfBounds(ValueError):
    """A document beyond :class:`Limits`; ``reason`` names the limit, without the value."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _measure(text: str, limits: Limits) -> None:
    bare = _STRING.sub('""', text)
    values = bare.count(",") + bare.count(":") + bare.count("[") + bare.count("{") + 1
    if values > limits.values:
        raise OutOfBounds(f"more than {limits.values:,} values")
    depth = 0
    for mark in _OPENS.finditer(bare):  # at most `values` marks
        depth += 1 if mark.group() in "[{" else -1
        if depth > limits.depth:
            raise OutOfBounds(f"nested deeper than {limits.depth}")


def check(value: Any, limits: Limits) -> None:
    """Raise :class:`OutOfBounds` where a parsed value (JSON's or TOML's) is beyond
    ``limits``; walks without recursion and stops at the first value too many. A float is
    the reader's to judge (TOML spells ``inf``; :func:`json_value` refuses it)."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    seen = 0
    while pending:
        item, depth = pending.pop()
        seen += 1
        if seen > limits.values:
            raise OutOfBounds(f"more than {limits.values:,} values")
        if depth > limits.depth:
            raise OutOfBounds(f"nested deeper than {limits.depth}")
        if isinstance(item, str) and len(item) > limits.string:
            raise OutOfBounds(f"a string longer than {limits.string:,} characters")
        if type(item) is int and len(str(abs(item))) > limits.digits:
            raise OutOfBounds(f"an integer of more than {limits.digits} digits")
        if isinstance(item, dict):
            pending.extend((key, depth + 1) for key in item)
            pending.extend((entry, depth + 1) for entry in item.values())
        elif isinstance(item, list):
            pending.extend((entry, depth + 1) for entry in item)


def _integer(limits: Limits) -> Any:
    def parse(digits: str) -> int:
        if len(digits.lstrip("-")) > limits.digits:
            raise OutOfBounds(f"an integer of more than {limits.digits} digits")
        return int(digits)

    return parse


def _number(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise OutOfBounds("a number beyond a float")
    return number


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_value(text: str, limits: Limits = Limits()) -> Any:
    """The JSON value ``text`` spells. :class:`OutOfBounds` beyond ``limits``;
    ``ValueError`` for text that is not JSON (NaN and Infinity included)."""
    _measure(text, limits)
    value = json.loads(
        text, parse_int=_integer(limits), parse_float=_number, parse_constant=_constant
    )
    check(value, limits)
    return value
