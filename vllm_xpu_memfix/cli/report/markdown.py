"""The report's Markdown, safe by construction: every piece of text is added through
:class:`Block`, which passes it through the one redactor (``core.redact``) and then escapes
it for where it goes, so that no field (a variable's value, a ledger row, a file name) can
leak, end a table row, close a code block or open an HTML tag."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable

from vllm_xpu_memfix.core.redact import Redactor

WIDTH = 100  # a terminal's columns
_BLOCK_START = re.compile(r"^(  \d*)([#>*+=\-.)])")
_BREAKS = re.compile(r"\r\n|[\r\n\u2028\u2029\x0b\x0c\x85]")


def one_line(text: str) -> str:
    return _BREAKS.sub(" ", text)


def cell(text: str) -> str:
    """Text for a table cell: one line, and a pipe, a backtick or a ``<`` shown as itself."""
    text = one_line(text).replace("\\", "\\\\")
    return re.sub(r"([|`<])", r"\\\1", text)


def span(text: str) -> str:
    """Text for an inline code span (``\\`...\\```): one line, no backtick to end it early."""
    return one_line(text).replace("`", "'")


def fence(lines: list[str]) -> str:
    """A fence longer than any run of backticks in ``lines``: nothing inside closes it."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    return "`" * max(3, longest + 1)


class Block:
    """The report's lines. ``table``, ``line`` and ``code`` take raw text: each value is
    redacted, then escaped for its place; only the report's own words are not redacted."""

    def __init__(self, redactor: Redactor) -> None:
        self.redact = redactor
        self.lines: list[str] = []

    def heading(self, text: str) -> None:
        self.lines += [f"#### {cell(self.redact(text))}", ""]

    def table(self, header: Iterable[str], rows: Iterable[Iterable[str]]) -> None:
        """A table; a two-column one without a heading whose rows would pass :data:`WIDTH`
        columns is a list of ``**name**: value`` items instead, each wrapped at it, so that
        it reads in a terminal as it does rendered."""
        head = [cell(self.redact(h)) for h in header]
        body = [[cell(self.redact(c)) for c in row] for row in rows]
        lines = ["| " + " | ".join(row) + " |" for row in body]
        if len(head) == 2 and not any(head) and any(len(line) > WIDTH for line in lines):
            for name, value in body:
                item = f"- **{name}**: {value}"
                wrapped = textwrap.wrap(
                    item, WIDTH, subsequent_indent="  ", break_long_words=False,
                    break_on_hyphens=False,
                )  # fmt: skip
                # A wrapped line opens no block of its own (a heading, a list, a quote).
                self.lines += [wrapped[0], *(_BLOCK_START.sub(r"\1\\\2", w) for w in wrapped[1:])]
        else:
            self.lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines]
        self.lines.append("")

    def line(self, words: str, *code: str) -> None:
        """``words`` (the report's own, escaped) and ``code``, each as an inline code span."""
        spans = " ".join(f"`{span(self.redact(c))}`" for c in code)
        self.lines.append(cell(self.redact(words)) + (f" {spans}" if spans else ""))

    def bullet(self, words: str, *code: str) -> None:
        self.line(words, *code)
        self.lines[-1] = "- " + self.lines[-1]

    def code(self, lines: Iterable[str]) -> None:
        body = [one_line(self.redact(line)) for line in lines] or ["(none)"]
        marker = fence(body)
        self.lines += [marker, *body, marker, ""]

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"
