"""The ledger's start-ups as ``report`` shows them. Every row carries the start-up it belongs
to (``start``: the identity the API server, or an ``LLM(...)`` program, gave it and its
engine and workers inherited, ``core.process.start_identity``), so two servers sharing a
directory are two start-ups, never one table. The rows are read through
``memory.ledger_files``; rows without an identity (written before rows carried one) are
counted and named as start-ups recorded before 0.1.0, not shown."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.cli.report.markdown import Block
from vllm_xpu_memfix.core.process import started_pid
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.memory import ledger_files
from vllm_xpu_memfix.startup import prediction_check

LEDGER_FILE_CAP = ledger_files.CAP
OOM_KILLED = "killed by the OOM killer"  # fixes.preflight's row after an OOM kill
# The start-up model's phases and the ledger phase each is measured at.
MEASURED_AT = {
    "load": "weights processed",
    "kv_cache": "KV cache allocated",
    "warmup": "warm-up done",
}
LISTED = 10  # other start-ups listed at most
HOST_KEYS = ("host", "hostname", "node")  # row fields that would name a machine


@dataclass
class Start:
    identity: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def began(self) -> float:
        return min(r["ts"] for r in self.rows)

    def first(self, phase: str, key: str | None = None) -> dict[str, Any]:
        return next(
            (r for r in self.rows if r.get("phase") == phase and (key is None or key in r)), {}
        )

    def summary(self) -> str:
        processes = len({r.get("pid") for r in self.rows})
        verdict = self.first(prediction_check.PREDICTED).get("verdict")
        words = f"{when(self.began)}, started by pid {started_pid(self.identity)}, "
        words += f"{processes} process(es)"
        words += f", preflight {verdict}" if verdict else ", no preflight row"
        return words + (", OOM kill recorded" if self.first(OOM_KILLED) else "")


@dataclass
class LedgerRead:
    starts: list[Start]  # oldest first
    skipped_files: list[str]
    junk_lines: int
    unnamed_rows: int  # rows with no start-up identity
    hosts: set[str]  # host names in file names and rows: the redactor masks them


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def read(directory: Path) -> LedgerRead:
    """The ledger's rows with a number ``ts``, by start-up; any other line is junk."""
    found = ledger_files.read(directory, LEDGER_FILE_CAP)
    rows = [
        r
        for r in found.rows
        if isinstance(r.get("ts"), (int, float)) and not isinstance(r.get("ts"), bool)
    ]
    by_start: dict[str, Start] = {}
    unnamed = 0
    for row in rows:
        identity = row.get("start")
        if isinstance(identity, str) and identity:
            by_start.setdefault(identity, Start(identity)).rows.append(row)
        else:
            unnamed += 1
    for start in by_start.values():
        start.rows.sort(key=lambda r: r["ts"])
    hosts = {str(r[k]) for r in found.rows for k in HOST_KEYS if isinstance(r.get(k), str)}
    return LedgerRead(
        sorted(by_start.values(), key=lambda s: s.began),
        found.unreadable,
        found.junk_lines + len(found.rows) - len(rows),
        unnamed,
        hosts | file_hosts(directory),
    )


def file_hosts(directory: Path) -> set[str]:
    """The host names in the ledger's file names (``ledger-<host>-<pid>.jsonl``)."""
    try:
        names = [p.name for p in directory.glob(ledger_files.PATTERN)]
    except OSError:
        return set()
    return {n.removeprefix("ledger-").rsplit("-", 1)[0] for n in names if n.count("-") >= 2}


def _process(row: dict[str, Any]) -> str:
    rank = row.get("rank")
    return f"{row.get('role')}{'' if rank is None else f' rank {rank}'} pid {row.get('pid')}"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:,.2f}"


def show(block: Block, read: LedgerRead, number: int | None, where: str) -> None:
    """Start-up ``number`` (1 = oldest; default the last) of the ledger, and the others
    listed briefly."""
    count = len(read.starts)
    if not count:
        block.bullet(f"no start-up in the ledger ({where})")
    elif number is not None and not 1 <= number <= count:
        block.bullet(f"no start-up {number}: the ledger ({where}) holds 1 to {count}")
    else:
        chosen = count if number is None else number
        block.heading(f"Start-up {chosen} of {count} (ledger {where})")
        start_lines(block, read.starts[chosen - 1])
        others = [(i, s) for i, s in enumerate(read.starts, 1) if i != chosen][-LISTED:]
        if others:
            block.line("Other start-ups in this ledger (report --start N shows one):")
            for i, other in others:
                block.bullet(f"{i}: {other.summary()}")
    if read.skipped_files or read.junk_lines:
        skipped = "; ".join(read.skipped_files[:5]) or "none"
        block.bullet(
            f"not read: {len(read.skipped_files)} file(s) ({skipped}), {read.junk_lines} "
            "line(s) that are no ledger row"
        )
    if read.unnamed_rows:
        block.bullet(
            f"start-ups recorded before 0.1.0: {read.unnamed_rows} row(s) without a start-up "
            "identity, not shown (a start-up's rows cannot be told from another's)"
        )


def start_lines(block: Block, start: Start) -> None:
    serve = start.first("process start", "argv")
    block.bullet(f"{start.summary()}; command:", str(serve.get("argv", "not recorded")))
    prediction = start.first(prediction_check.PREDICTED)
    if prediction:
        block.bullet("preflight:", str(prediction.get("line", prediction.get("verdict"))))
    else:
        block.bullet("preflight: no row (the preflight was off, or logged no verdict)")
    ready = start.first(prediction_check.READY, "predicted_host")
    if ready:
        block.bullet("at ready:", str(ready.get("line")))
    killed = start.first(OOM_KILLED)
    if killed:
        block.bullet(
            f"killed by the OOM killer (oom_kill {killed.get('oom_kill_before')} -> "
            f"{killed.get('oom_kill_after')}): likely {killed.get('victim_role')} pid "
            f"{killed.get('victim_pid')} after phase {killed.get('victim_phase')!r}; "
            f"likely cause {killed.get('likely_cause')}"
        )
    block.lines.append("")
    phase_table(block, start.rows, prediction)


def phase_table(block: Block, rows: list[dict[str, Any]], prediction: dict[str, Any]) -> None:
    """Each modelled phase: the prediction beside each process's measured figures."""
    by_process: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row.get("phase") != prediction_check.PREDICTED:
            by_process.setdefault(_process(row), {})[str(row.get("phase"))] = row
    workers = {
        p: phases
        for p, phases in by_process.items()
        if "process start" in phases and set(MEASURED_AT.values()) & set(phases)
    }
    predicted = prediction.get("predicted_phases") or {}
    if not workers and not predicted:
        return
    header = ["phase", "predicted host GiB (all ranks)", "predicted device GiB (a rank)"]
    header += [f"{p}: RssAnon / VRAM GiB" for p in workers]
    header.append("MemAvailable drop GiB (largest)")
    table = []
    for model_phase, ledger_phase in MEASURED_AT.items():
        guess = predicted.get(model_phase) if isinstance(predicted, dict) else None
        guess = guess if isinstance(guess, dict) else {}
        cells = [f"{model_phase} ({ledger_phase})", _gib(_num(guess.get("host")))]
        cells.append(_gib(_num(guess.get("device"))))
        drops = []
        for phases in workers.values():
            row = phases.get(ledger_phase, {})
            cells.append(
                f"{_gib(_num(row.get('rss_anon')))} / {_gib(_num(row.get('drm_total_vram')))}"
            )
            first = _num(phases["process start"].get("mem_available"))
            now = _num(row.get("mem_available"))
            if first is not None and now is not None:
                drops.append(first - now)
        cells.append(_gib(max(drops)) if drops else "-")
        table.append(cells)
    block.table(header, table)
