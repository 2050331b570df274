"""The shape every timing benchmark here shares: its options ``--rounds`` and ``--out``,
a first line naming the date and this machine, and a Markdown table printed and, with
``--out FILE``, written to that file."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path


def arguments(description: str, rounds: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path)
    return parser


def this_machine() -> str:
    """The date, the CPU, its count and the load when the run started: the table's
    figures mean little without them on a shared machine."""
    return (
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )


def emit(rows: list[str], out: Path | None) -> int:
    text = "\n".join(rows) + "\n"
    print(text, end="")
    if out:
        out.write_text(text)
    return 0
