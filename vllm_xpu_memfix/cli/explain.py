"""``vllm-xpu-memfix explain [CODE]``: the troubleshooting guide's entry for a cause or remedy
code, read from the installed package, so a log record's pointer works where only the wheel is.

The guide ships as package data (``docs/troubleshooting.md``, the repository's own file). A
cause's entry is the part of the guide under its ``<a id="CODE">`` anchor, up to the next
anchor or heading; a remedy's entry is its meaning (``startup/codes.py``) and every passage of
the guide that names it, with the cause it is listed under. Needs neither vLLM nor a GPU.
The guide's pointers to the repository's other pages, which the wheel lacks, are left out:
each sits in parentheses after a sentence that stands without it.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from importlib import resources
from textwrap import shorten

from vllm_xpu_memfix.core.lines import wrap
from vllm_xpu_memfix.startup import codes

GUIDE = "docs/troubleshooting.md"
_ANCHOR = re.compile(r'<a id="([a-z0-9_]+)"></a>\n')
_HEADING = re.compile(r"^#+ ", re.M)
# " ([text](page.md#anchor))": a pointer to a page of the repository, not of the wheel
_LOCAL_POINTER = re.compile(r"\s*\(\[[^\]]*\]\((?![a-z]+://)[^)]*\)\)", re.S)


def self_contained(entry_text: str) -> str:
    """``entry_text`` without the guide's pointers to pages the wheel does not ship."""
    return _LOCAL_POINTER.sub("", entry_text)


def guide_text() -> str:
    return resources.files("vllm_xpu_memfix").joinpath(GUIDE).read_text(encoding="utf-8")


def sections(text: str) -> dict[str, str]:
    """Each anchored entry of the guide by its code: from the anchor to the next anchor, or to
    the next heading after the entry's own first line."""
    found = list(_ANCHOR.finditer(text))
    entries = {}
    for index, match in enumerate(found):
        end = found[index + 1].start() if index + 1 < len(found) else len(text)
        body = text[match.end() : end]
        heading = _HEADING.search(body, 1)
        entries[match.group(1)] = body[: heading.start() if heading else None].strip()
    return entries


def _passages(text: str) -> list[tuple[str, str]]:
    """The guide's paragraphs, each bullet of a list apart, with the heading they fall under."""
    passages, heading = [], ""
    for paragraph in re.split(r"\n\s*\n", _ANCHOR.sub("", text)):
        if _HEADING.match(paragraph):
            heading = paragraph.lstrip("# ").strip()
            continue
        passages += [(heading, p.strip()) for p in re.split(r"\n(?=- )", paragraph) if p.strip()]
    return passages


def remedy_entry(code: str, text: str) -> str:
    lines = [f"{code} (remedy): {codes.REMEDIES[code]}"]
    for heading, passage in _passages(text):
        if f"`{code}`" in passage:
            lines += ["", f"## {heading}", passage]
    return "\n".join(lines)


def cause_entry(code: str, entries: dict[str, str]) -> str:
    return f"{code} (cause)\n\n{entries.get(code) or codes.CAUSES[code]}"


def entry(code: str, text: str | None = None) -> str | None:
    """The entry for ``code`` (any case: a code is read as logs and users write it), or
    ``None`` where it is no cause or remedy code."""
    text = self_contained(guide_text() if text is None else text)
    code = code.strip().lower()
    if code in codes.CAUSES:
        return cause_entry(code, sections(text))
    if code in codes.REMEDIES:
        return remedy_entry(code, text)
    return None


def fitted(text: str) -> str:
    """``text`` within the width of ``core.lines``: prose wrapped (a bullet's continuation
    under its text), tables and fenced blocks as they are."""
    lines, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if fenced or line.startswith(("|", "```")):
            lines.append(line)
            continue
        indent = len(line) - len(line.lstrip())
        lines += wrap(line, hang=indent + (2 if line.lstrip().startswith("- ") else 0))
    return "\n".join(lines)


def listing() -> str:
    def rows(meanings: dict[str, str]) -> list[str]:
        width = max(map(len, meanings))
        return [f"  {code:<{width}}  {shorten(text, 72)}" for code, text in meanings.items()]

    return "\n".join(
        [
            "Cause codes:",
            *rows(codes.CAUSES),
            "Remedy codes:",
            *rows(codes.REMEDIES),
            "vllm-xpu-memfix explain CODE prints one.",
        ]
    )


def main(args: argparse.Namespace) -> int:
    if args.code is None:
        print(listing())
        return 0
    text = entry(args.code)
    if text is None:
        known = [*codes.CAUSES, *codes.REMEDIES]
        nearest = difflib.get_close_matches(args.code, known, n=3, cutoff=0) or known[:3]
        print(
            f"vllm-xpu-memfix explain: {args.code[:80]!r} is no cause or remedy code; nearest: "
            f"{', '.join(nearest)} (explain alone lists them all)",
            file=sys.stderr,
        )
        return 2
    print(fitted(text))
    return 0
