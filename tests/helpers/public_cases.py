"""The public record's cases of public start-ups with a host file and a pasted serve line,
for the tests that read the corpus beside ``test_public_record`` (which runs every kind:
first tries, bad host files, this machine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

CORPUS = Path(__file__).parent.parent / "data" / "public_record"


def serve_line_cases() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each public case's directory and its case.toml, where it has a serve line."""
    for case in sorted(CORPUS.glob("*/case.toml")):
        data = tomllib.loads(case.read_text())
        if data["thread"].get("kind", "public") == "public" and "line" in data.get("serve", {}):
            yield case.parent, data
