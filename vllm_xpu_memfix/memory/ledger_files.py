"""The ledger's JSON-lines files (``VLLM_XPU_MEMFIX_LEDGER_DIR``) as one reader gives them
to the OOM-kill line, the at-ready line and ``report``: other processes' files, so read
through ``core.files`` (regular files only, bounded, never blocking on a FIFO), every
object row kept in file order and everything else counted, never raised."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import files

PATTERN = "ledger-*.jsonl"
CAP = 16 * 2**20  # bytes read of one file at most


@dataclass
class LedgerFiles:
    rows: list[dict[str, Any]] = field(default_factory=list)  # each a JSON object
    junk_lines: int = 0  # non-empty lines that are not
    unreadable: list[str] = field(default_factory=list)  # "name: why", one per file


def read(directory: Path, cap: int = CAP) -> LedgerFiles:
    """Every ledger file of ``directory``, in name order."""
    found = LedgerFiles()
    try:
        paths = sorted(directory.glob(PATTERN))
    except OSError as exc:
        found.unreadable.append(f"{directory}: {exc.strerror or exc}")
        return found
    for path in paths:
        try:
            text = files.read_text(path, cap)
        except OSError as exc:
            found.unreadable.append(f"{path.name}: {exc.strerror or exc}")
            continue
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                found.rows.append(row)
            elif line.strip():
                found.junk_lines += 1
    return found
