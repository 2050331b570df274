"""``vllm-xpu-memfix plot``: a picture of a ``monitor`` CSV, with ledger phases marked."""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import files
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.memory import ledger_files

WIDTH_IN, HEIGHT_IN, DPI = 12, 6.5, 100
# A ledger file plot streams at most: a start-up's rows are a few KiB a process.
LEDGER_CAP = 64 * 2**20


# The formats plot writes, by the output's extension.
FORMATS = (".png", ".svg", ".pdf")
DEFAULT_NAME = "host-memory.png"
# The columns plot reads from a monitor CSV.
NEEDED = ("ts", "t", "pid", "label", "rss", "pss", "mem_available", "outside_processes")
_SYSTEM_NUMBERS = ("ts", "t", "mem_available", "outside_processes")
# System figures of newer monitor CSVs, drawn where the CSV has them.
_LATER_SYSTEM_NUMBERS = ("other_processes", "driver_host_copy", "peer_imports")
OTHER_PROCESSES = "other processes' growth since start"
NOT_IN_ANY = "not in any process"
DRIVER_HOST_COPY = "driver host copy (committed)"
PEER_IMPORTS = "peer imports (drm-total-gtt): not host memory by itself"


class PlotError(RuntimeError):
    pass


@dataclass
class Skipped:
    """Rows and ledger lines that could not be read: how many, and where the first was.

    A monitor or vLLM killed mid-write leaves a torn last line; the rest is still worth
    a picture, so such rows are counted and left out instead of refusing the file.
    """

    count: int = 0
    first: str = ""

    def add(self, where: str, count: int = 1) -> None:
        self.count += count
        self.first = self.first or where


def _number(value: str | None) -> float | None:
    """A finite number, None for an empty cell; ValueError for anything else."""
    if value is None:
        raise ValueError("a short row")
    if value in ("", "None"):
        return None
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value}")
    return number


def _read_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV with plot's columns; PlotError for a file that is not one."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in NEEDED if c not in (reader.fieldnames or ())]
            if missing:
                raise PlotError(
                    f"{path} is not a vllm-xpu-memfix monitor CSV: no column {', '.join(missing)}"
                )
            for row in reader:
                yield reader.line_num, row
    except UnicodeDecodeError:
        raise PlotError(f"{path} is not a text CSV (not UTF-8); is it a monitor CSV?") from None
    except csv.Error as exc:
        raise PlotError(f"{path} is not a readable CSV: {exc}") from None


def read_monitor_csv(
    path: Path, skipped: Skipped | None = None
) -> tuple[dict[str, list[tuple[float, float]]], list[dict[str, Any]]]:
    """Per-process (t, bytes) series, PSS where known else RSS; and the system rows.

    Rows with a missing or non-numeric figure are counted in ``skipped`` and left out.
    """
    skipped = skipped if skipped is not None else Skipped()
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    labels: dict[str, str] = {}
    system: list[dict[str, Any]] = []
    for line, row in _read_rows(path):
        try:
            if row["pid"] == "system":
                sample: dict[str, Any] = {k: _number(row[k]) for k in _SYSTEM_NUMBERS}
                sample.update({k: _number(row[k]) for k in _LATER_SYSTEM_NUMBERS if k in row})
                sample["others_unseen"] = row.get("others_unseen") or ""
                if sample["t"] is None or sample["ts"] is None:
                    raise ValueError("no time")
                system.append(sample)
                continue
            t = _number(row["t"])
            if t is None or row["label"] is None:
                raise ValueError("no time")
            value = _number(row["pss"]) or _number(row["rss"]) or 0.0
        except ValueError:
            skipped.add(f"{path.name} line {line}")
            continue
        series[row["pid"]].append((t, value))
        labels[row["pid"]] = row["label"]  # the last label is the most telling
    if not system:
        raise PlotError(f"{path} holds no samples; is it a vllm-xpu-memfix monitor CSV?")
    return {labels[pid]: points for pid, points in series.items()}, system


def _worker_phase(row: dict[str, Any]) -> tuple[float, str] | None:
    """(ts, phase) of a worker's ledger row; None for another process's; ValueError for a
    row without a finite ``ts`` and a ``phase``."""
    ts, phase = row.get("ts"), row.get("phase")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(phase, str):
        raise ValueError("no ts or phase")
    if not math.isfinite(ts):
        raise ValueError("no finite ts")
    began = row.get("began")
    if phase == "process start" and isinstance(began, (int, float)) and math.isfinite(began):
        ts = began  # the process's own start, not the row's time after its imports
    return (float(ts), phase) if str(row.get("role", "")).startswith("worker") else None


def read_ledger_phases(
    directory: Path, merge_within_s: float = 1.0, skipped: Skipped | None = None
) -> list[tuple[float, str]]:
    """(epoch ts, label) of the worker phases in a ledger directory.

    Phases closer than ``merge_within_s`` (e.g. every rank's "ready") share one mark.
    Lines without a ``ts`` and ``phase``, and files ``ledger_files`` cannot read, are
    counted in ``skipped`` and left out; the files are streamed, never read whole.
    """
    skipped = skipped if skipped is not None else Skipped()
    points: list[tuple[float, str]] = []
    found = ledger_files.LedgerFiles()
    first_bad: tuple[str, int] | None = None
    bad_rows = 0
    for name, number, row in ledger_files.each(directory, found, LEDGER_CAP):
        try:
            point = _worker_phase(row)
        except ValueError:
            bad_rows += 1
            first_bad = first_bad or (name, number)
            continue
        if point is not None:
            points.append(point)
    first = min(filter(None, (first_bad, found.first_skip)), default=None)
    if first is not None:
        skipped.add(f"{first[0]} line {first[1]}", bad_rows + found.junk_lines)
    for unreadable in found.unreadable:
        skipped.add(unreadable)
    marks: list[tuple[float, list[str]]] = []
    for ts, phase in sorted(points):
        if marks and ts - marks[-1][0] < merge_within_s:
            if phase not in marks[-1][1]:
                marks[-1][1].append(phase)
        else:
            marks.append((ts, [phase]))
    return [(ts, " / ".join(names)) for ts, names in marks]


@dataclass(frozen=True)
class Line:
    """One system figure drawn over the stack: GiB per sample."""

    label: str
    gib: list[float]
    style: dict[str, Any]


def _gigabytes(system: list[dict[str, Any]], key: str) -> list[float] | None:
    """One system figure in GiB per sample, 0 where a sample leaves it empty; None where no
    sample gives it (a CPU-only tree, or a CSV from before the column)."""
    values = [s.get(key) for s in system]
    if all(v is None for v in values):
        return None
    return [(v or 0) / GiB for v in values]


def system_lines(system: list[dict[str, Any]]) -> list[Line]:
    """The lines drawn over the stacked processes. The driver's host copy is the figure the
    host committed; ``drm-total-gtt`` is drawn as what it is, peer imports."""
    lines = []
    first_available = next((s["mem_available"] for s in system if s["mem_available"]), None)
    if first_available is not None:
        drop = [(first_available - (s["mem_available"] or first_available)) / GiB for s in system]
        lines.append(Line("MemAvailable drop since start", drop, {"color": "black", "lw": 1.8}))
    others = _gigabytes(system, "other_processes")
    if others is not None:
        style = {"color": "dimgrey", "lw": 1.5, "ls": "-."}
        lines.append(Line(OTHER_PROCESSES, others, style))
    unseen = next((s["others_unseen"] for s in reversed(system) if s["others_unseen"]), "")
    # Before the others were measured (an older CSV), their growth is in this figure.
    label = NOT_IN_ANY if others is not None else "outside vLLM's tree (others not measured)"
    if unseen:
        label += f": an upper bound (not seen: {unseen})"
    outside = [(s["outside_processes"] or 0) / GiB for s in system]
    lines.append(Line(label, outside, {"color": "crimson", "lw": 1.5, "ls": "--"}))
    copy = _gigabytes(system, "driver_host_copy")
    if copy is not None:
        lines.append(Line(DRIVER_HOST_COPY, copy, {"color": "darkred", "lw": 2.2}))
    imports = _gigabytes(system, "peer_imports")
    if imports is not None:
        lines.append(Line(PEER_IMPORTS, imports, {"color": "purple", "lw": 1.2, "ls": ":"}))
    return lines


def output_path(out: Path) -> Path:
    """The file plot writes for ``-o out``: ``out`` itself, or ``out/host-memory.png`` for
    a directory; PlotError for an extension it cannot write."""
    if out.is_dir():
        return out / DEFAULT_NAME
    if out.suffix.lower() not in FORMATS:
        raise PlotError(
            f"-o {out}: cannot write {out.suffix or 'a file without an extension'}; "
            f"give a name ending in {', '.join(FORMATS)}, or an existing directory"
        )
    return out


def draw_phase_marks(fig: Any, ax: Any, marks: list[tuple[float, str]]) -> list[Any]:
    """A dotted line and an upright label at each mark; a label that would overlap one
    already placed (marks closer than a label's width) moves down below it."""
    renderer = fig.canvas.get_renderer()
    to_axes = ax.transAxes.inverted()
    placed: list[Any] = []
    for x, name in sorted(marks):
        ax.axvline(x, color="grey", lw=0.8, ls=":")
        label = ax.text(
            x,
            1.0,
            name,
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            transform=ax.get_xaxis_transform(),
        )
        for _ in placed:  # each move goes below one placed label: at most that many
            box = label.get_window_extent(renderer)
            clash = next((o for o in placed if box.overlaps(o.get_window_extent(renderer))), None)
            if clash is None:
                break
            label.set_y(to_axes.transform((0, clash.get_window_extent(renderer).y0))[1] - 0.01)
        placed.append(label)
    return placed


def sampling_interval(system: list[dict[str, Any]]) -> float:
    """The median time between the CSV's samples (s); 0 for a single sample."""
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(system)]
    return statistics.median(gaps) if gaps else 0.0


def figure(csv_path: Path, ledger_dir: Path | None = None, skipped: Skipped | None = None) -> Any:
    """The matplotlib figure of ``csv_path``, with the phases of ``ledger_dir`` marked in the
    samples' clock; phases closer than one sampling interval share a mark."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plot needs matplotlib: pip install 'vllm-xpu-memfix[plot]'") from None
    processes, system = read_monitor_csv(csv_path, skipped)
    times = [s["t"] for s in system]
    # Align every process on the system rows' sample times (a process is 0 before it starts).
    stacks, labels = [], []
    for label, series in sorted(processes.items(), key=lambda kv: kv[1][0][0]):
        by_t = dict(series)
        stacks.append([by_t.get(t, 0.0) / GiB for t in times])
        labels.append(label)

    fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    if stacks:
        ax.stackplot(times, stacks, labels=labels, alpha=0.75)
    for line in system_lines(system):
        ax.plot(times, line.gib, label=line.label, **line.style)
    ax.set_xlabel("seconds since monitor start")
    ax.set_ylabel("GiB")
    ax.set_title("Host memory of the vLLM process tree (PSS, stacked by process)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if ledger_dir is not None:
        t0 = system[0]["ts"] - system[0]["t"]
        phases = read_ledger_phases(ledger_dir, sampling_interval(system), skipped)
        draw_phase_marks(fig, ax, [(ts - t0, name) for ts, name in phases])
    return fig


def plot(
    csv_path: Path, out: Path, ledger_dir: Path | None = None, skipped: Skipped | None = None
) -> Path:
    """Draw ``csv_path`` into ``out`` (see :func:`output_path`); returns the file written."""
    out = output_path(out)
    fig = figure(csv_path, ledger_dir, skipped)
    import matplotlib.pyplot as plt

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=DPI)
    except OSError as exc:
        raise PlotError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out


def main(args: argparse.Namespace) -> int:
    csv_path = Path(args.csv)
    problem = files.input_problem(csv_path)
    if problem is not None:
        print(f"plot: {csv_path}: {problem}", file=sys.stderr)
        return 2
    ledger = Path(args.ledger) if args.ledger else None
    if ledger is not None and not ledger.is_dir():
        print(f"plot: --ledger {ledger} is not a directory", file=sys.stderr)
        return 2
    skipped = Skipped()
    try:
        written = plot(csv_path, Path(args.output or DEFAULT_NAME), ledger, skipped)
    except PlotError as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 2
    if skipped.count:
        print(
            f"plot: left out {skipped.count} unreadable row(s) or ledger line(s), the first "
            f"at {skipped.first}",
            file=sys.stderr,
        )
    print(f"plot: wrote {written}")
    return 0
