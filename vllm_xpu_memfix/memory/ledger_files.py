"""The ledger's JSON-lines files (``VLLM_XPU_MEMFIX_LEDGER_DIR``) as one reader gives them
to the OOM-kill line, the at-ready line, ``report`` and ``plot``: other processes' files,
so opened through ``core.files`` (regular files only, never blocking on a FIFO), read a
line at a time up to a cap, and each line parsed within ``core.bounded``'s limits. Every
object row is kept in file order; every other line is one skip counted under its reason,
never raised."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import bounded, files

PATTERN = "ledger-*.jsonl"
CAP = 16 * 2**20  # bytes read of one file at most
LINE_CAP = 2**20  # one row: a phase's figures and a few names
ROW_LIMITS = bounded.Limits(depth=16, digits=20, string=64 * 1024, values=10_000)


@dataclass
class LedgerFiles:
    rows: list[dict[str, Any]] = field(default_factory=list)  # each a JSON object
    skips: Counter[str] = field(default_factory=Counter)  # lines not kept, by reason
    unreadable: list[str] = field(default_factory=list)  # "name: why", one per file
    first_skip: tuple[str, int] | None = None  # (file name, line number)

    @property
    def junk_lines(self) -> int:
        """Non-empty lines that are no row."""
        return sum(self.skips.values())


def _lines(fd: int, cap: int) -> Iterator[bytes | None]:
    """The lines of an open file up to ``cap`` bytes; None for a line longer than
    ``LINE_CAP``, whose bytes are passed over, never held."""
    with os.fdopen(fd, "rb", closefd=False) as stream:
        read = 0
        while read < cap:
            line = stream.readline(min(LINE_CAP + 1, cap - read))
            if not line:
                return
            read += len(line)
            if len(line) <= LINE_CAP or line.endswith(b"\n"):
                yield line
                continue
            while line and not line.endswith(b"\n") and read < cap:
                line = stream.readline(min(LINE_CAP, cap - read))
                read += len(line)
            yield None


def each(
    directory: Path, found: LedgerFiles, cap: int = CAP
) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(file name, line number, row) of every ledger file of ``directory``, in name then line order;
    skips and unreadable files are counted in ``found``. A file larger than ``cap`` is
    unreadable; one that grows past it while read is read up to it."""
    try:
        paths = sorted(directory.glob(PATTERN))
    except OSError as exc:
        found.unreadable.append(f"{directory}: {exc.strerror or exc}")
        return
    for path in paths:
        try:
            fd = files.open_regular(path)
        except OSError as exc:
            found.unreadable.append(f"{path.name}: {exc.strerror or exc}")
            continue
        try:
            if os.fstat(fd).st_size > cap:
                found.unreadable.append(f"{path.name}: more than {cap / 2**20:,.0f} MiB")
                continue
            for number, line in enumerate(_lines(fd, cap), start=1):
                row = _row(line, found.skips)
                if row is not None:
                    yield path.name, number, row
                elif found.first_skip is None:
                    found.first_skip = (path.name, number)
        except OSError as exc:
            found.unreadable.append(f"{path.name}: {exc.strerror or exc}")
        finally:
            os.close(fd)


def _row(line: bytes | None, skips: Counter[str]) -> dict[str, Any] | None:
    """The row a line holds; else None, the line counted in ``skips`` under its reason
    (the ledger writes no empty line either)."""
    if line is None:
        reason = f"a line longer than {LINE_CAP // 2**20} MiB"
    elif not line.strip():
        reason = "an empty line"
    else:
        try:
            row = bounded.json_value(line.decode("utf-8", errors="replace"), ROW_LIMITS)
            reason = "" if isinstance(row, dict) else "not a JSON object"
        except bounded.OutOfBounds as exc:
            reason = exc.reason
        except ValueError:
            reason = "not JSON"
        if not reason:
            return row
    skips[reason] += 1
    return None


def read(directory: Path, cap: int = CAP) -> LedgerFiles:
    """Every row of every ledger file of ``directory``, in name order."""
    found = LedgerFiles()
    found.rows.extend(row for _name, _number, row in each(directory, found, cap))
    return found
