"""The width of the text a command prints for a person, and the one way prose is
wrapped to it: at spaces, each continuation indented (by default four spaces more than
the line it continues). Tables are laid out by their commands and are not wrapped; a
single word longer than the width (a path) is kept whole."""

from __future__ import annotations

import textwrap

WIDTH = 100


def wrap(line: str, hang: int | None = None, width: int = WIDTH) -> list[str]:
    """``line`` as lines of at most ``width`` characters, broken at spaces. Its own
    indent is kept; a continuation is indented ``hang`` spaces (default: 4 more)."""
    if len(line) <= width:
        return [line]
    indent = len(line) - len(line.lstrip(" "))
    hang = indent + 4 if hang is None else hang
    return textwrap.wrap(
        line[indent:],
        width=width,
        initial_indent=" " * indent,
        subsequent_indent=" " * hang,
        break_long_words=False,
        break_on_hyphens=False,
    )


def wrapped(lines: list[str], hang: int | None = None, width: int = WIDTH) -> list[str]:
    """Every line of ``lines`` through :func:`wrap`."""
    return [part for line in lines for part in wrap(line, hang, width)]
