"""``vllm-xpu-memfix plot``: a picture of a ``monitor`` CSV, with ledger phases marked."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.units import GiB

WIDTH_IN, HEIGHT_IN, DPI = 12, 6.5, 100


class PlotError(RuntimeError):
    pass


def _number(value: str) -> float | None:
    return float(value) if value not in ("", "None") else None


def read_monitor_csv(
    path: Path,
) -> tuple[dict[str, list[tuple[float, float]]], list[dict[str, Any]]]:
    """Per-process (t, bytes) series, PSS where known else RSS; and the system rows."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    labels: dict[str, str] = {}
    system: list[dict[str, Any]] = []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["pid"] == "system":
                system.append(
                    {
                        k: _number(v) if k not in ("pid", "label", "role") else v
                        for k, v in row.items()
                    }
                )
                continue
            value = _number(row["pss"]) or _number(row["rss"]) or 0.0
            series[row["pid"]].append((float(row["t"]), value))
            labels[row["pid"]] = row["label"]  # the last label is the most telling
    if not system:
        raise PlotError(f"{path} holds no samples; is it a vllm-xpu-memfix monitor CSV?")
    return {labels[pid]: points for pid, points in series.items()}, system


def read_ledger_phases(directory: Path, merge_within_s: float = 1.0) -> list[tuple[float, str]]:
    """(epoch ts, label) of the worker phases in a ledger directory.

    Phases closer than ``merge_within_s`` (e.g. every rank's "ready") share one mark.
    """
    points = []
    for path in sorted(directory.glob("ledger-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if str(row.get("role", "")).startswith("worker"):
                points.append((float(row["ts"]), str(row["phase"])))
    marks: list[tuple[float, list[str]]] = []
    for ts, phase in sorted(points):
        if marks and ts - marks[-1][0] < merge_within_s:
            if phase not in marks[-1][1]:
                marks[-1][1].append(phase)
        else:
            marks.append((ts, [phase]))
    return [(ts, " / ".join(names)) for ts, names in marks]


def plot(csv_path: Path, out: Path, ledger_dir: Path | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plot needs matplotlib: pip install 'vllm-xpu-memfix[plot]'") from None
    processes, system = read_monitor_csv(csv_path)
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
    first_available = next((s["mem_available"] for s in system if s["mem_available"]), None)
    if first_available is not None:
        drop = [(first_available - (s["mem_available"] or first_available)) / GiB for s in system]
        ax.plot(times, drop, color="black", lw=1.8, label="MemAvailable drop since start")
    outside = [(s["outside_processes"] or 0) / GiB for s in system]
    ax.plot(times, outside, color="crimson", lw=1.5, ls="--", label="not in any process")
    if ledger_dir is not None:
        t0 = system[0]["ts"] - system[0]["t"]
        for ts, name in read_ledger_phases(ledger_dir):
            ax.axvline(ts - t0, color="grey", lw=0.8, ls=":")
            ax.text(ts - t0, ax.get_ylim()[1], name, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds since monitor start")
    ax.set_ylabel("GiB")
    ax.set_title("Host memory of the vLLM process tree (PSS, stacked by process)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def main(args: argparse.Namespace) -> int:
    csv_path = Path(args.csv)
    if not csv_path.is_file():
        print(f"plot: no such file: {csv_path}", file=sys.stderr)
        return 2
    ledger = Path(args.ledger) if args.ledger else None
    if ledger is not None and not ledger.is_dir():
        print(f"plot: --ledger {ledger} is not a directory", file=sys.stderr)
        return 2
    try:
        print(f"plot: wrote {plot(csv_path, Path(args.output), ledger)}")
    except PlotError as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 2
    return 0
