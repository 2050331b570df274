"""After a start-up the kernel's OOM killer cut short: which process it most likely took,
from the ledger's rows (``VLLM_XPU_MEMFIX_LEDGER_DIR``). The files are another process's
output, read as hostile: through ``core.files`` (bounded, regular files only, never
blocking on a FIFO), a row that is not one skipped and counted, a live process never
named, every string from a row escaped before it reaches a log line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core.numbers import printable
from vllm_xpu_memfix.core.process import start_identity
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.memory import ledger_files


@dataclass(frozen=True)
class LedgerRows:
    """This start's last row of each process but this one, and the rows skipped."""

    last: list[dict[str, Any]]
    skipped: int


def _of_this_start(row: dict[str, Any], since: float) -> bool:
    """A row of this start: an int pid and a number ts from ``since`` (less a second) on."""
    ts = row.get("ts")
    return (
        type(row.get("pid")) is int
        and isinstance(ts, (int, float))
        and not isinstance(ts, bool)
        and ts >= since - 1
    )


def ledger_rows(directory: Path | None, since: float) -> LedgerRows:
    """The ledger files as ``ledger_files`` reads them, the rows of this start-up only
    (``core.process.start_identity``: a server sharing the directory, or an earlier start,
    has its own); a line of it that is not a row is skipped and counted, and a file that
    cannot be read counts as one skipped row."""
    if directory is None or not directory.is_dir():
        return LedgerRows([], 0)
    found = ledger_files.read(directory)
    skipped = len(found.unreadable) + found.junk_lines
    by_pid: dict[int, dict[str, Any]] = {}
    start = start_identity()
    for row in found.rows:
        if row.get("start") != start:
            continue
        if not _of_this_start(row, since):
            skipped += 1
        elif row["pid"] != os.getpid():
            by_pid[row["pid"]] = row  # rows are appended: the last one read is the latest
    return LedgerRows(list(by_pid.values()), skipped)


def _number(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _gone(pid: int) -> bool:
    """No longer running: absent, or a zombie not yet reaped (its memory is released)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return not psutil.pid_exists(pid)


def likely_victim(rows: LedgerRows, error: BaseException) -> dict[str, Any] | None:
    """The process the OOM killer most likely took: of those no longer running, EngineCore
    where vLLM names its exit code -9, else a worker (EngineCore then exits with 1); the
    largest by its last RssAnon, as the killer ranks them. A live process is never named."""
    dead = [r for r in rows.last if _gone(r["pid"])]
    role = "engine" if ": -9" in str(error) else "worker"
    of_role = [r for r in dead if str(r.get("role", "")).startswith(role)]
    return max(of_role or dead, key=lambda r: _number(r, "rss_anon"), default=None)


def victim_words(victim: dict[str, Any] | None, ledger_set: bool) -> str:
    """``worker-0 pid=7 after phase 'weights loaded'; host then MemAvailable ...``."""
    if victim is None:
        unrecorded = "" if ledger_set else ": VLLM_XPU_MEMFIX_LEDGER_DIR=off records none"
        return f"a vLLM process (phase unknown{unrecorded})"
    role, phase = printable(str(victim.get("role")), 40), printable(str(victim.get("phase")), 60)
    words = f"{role} pid={victim['pid']} after phase '{phase}'"
    available, total = _number(victim, "mem_available"), _number(victim, "mem_total")
    if available and total:
        words += f"; host then MemAvailable {available / GiB:,.1f} of {total / GiB:,.1f} GiB"
    return words
