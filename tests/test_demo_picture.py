"""`make demo`'s own code path, run under `monitor`, on an idle host and on a busy one: a
real vLLM server on the tiny model, the plugin through its entry point (issue 61)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.demo_marks import assert_marks_where_the_ledger_says

from vllm_xpu_memfix.cli.plot import OTHER_PROCESSES, read_monitor_csv, system_lines
from vllm_xpu_memfix.memory.ledger import PHASES
from vllm_xpu_memfix.memory.snapshot import LIVE

pytest.importorskip("vllm")
pytestmark = pytest.mark.server

MiB, GiB = 1024**2, 1024**3
INTERVAL = 0.5  # monitor's and the demo's default

# A neighbour that takes 1 GiB, writes a byte into each of its pages (so each is resident
# however the allocator gets it), says so, and holds it until its stdin closes.
HOLDER = """
import sys
block = bytearray(1 << 30)
block[::4096] = b"\\1" * (len(block) // 4096)
print("held", flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class DemoRun:
    code: int
    out: str
    workdir: Path
    monitor_dir: Path
    # The demo's own samples (workdir/monitor.csv, what its picture draws): the system rows.
    system: list[dict[str, str]]


@dataclass
class Neighbour:
    started: float = 0.0  # epoch s, before the holder was started
    held: float = 0.0  # epoch s, once it said its 1 GiB was resident
    anon: int = 0  # its anonymous + shmem PSS then (bytes), read by this test


def _first_sample(csv_path: Path, demo: subprocess.Popen[bytes]) -> None:
    """Wait until the demo's sampler has written its first system row."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and demo.poll() is None:
        if csv_path.exists() and ",system,system,system," in csv_path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"the demo wrote no sample into {csv_path}")


@contextmanager
def holding(seen: Neighbour, csv_path: Path, demo: subprocess.Popen[bytes]) -> Iterator[None]:
    """A process outside the demo's tree that starts after its monitor's first sample,
    takes 1 GiB and holds it until the block ends; its times and size go into ``seen``."""
    _first_sample(csv_path, demo)
    seen.started = time.time()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        seen.held = time.time()
        seen.anon = LIVE.take(holder.pid).anon_pss or 0
        yield
    finally:
        holder.kill()
        holder.wait()


def run_demo(root: Path, neighbour: Neighbour | None = None) -> DemoRun:
    """``monitor -- demo`` as the README runs the demo; with ``neighbour``, a 1 GiB holder
    beside it for the rest of the run."""
    workdir, monitor_dir, out = root / "demo", root / "monitor", root / "out.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")}
    env.pop("VLLM_PLUGINS", None)
    cli = [sys.executable, "-m", "vllm_xpu_memfix.cli"]
    command = [*cli, "monitor", "--interval", str(INTERVAL), "--out", str(monitor_dir), "--"]
    command += [*cli, "demo", "--workdir", str(workdir)]
    with (
        out.open("wb") as sink,
        subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        ) as demo,
    ):
        try:
            csv_path = workdir / "monitor.csv"
            with nullcontext() if neighbour is None else holding(neighbour, csv_path, demo):
                demo.wait(timeout=400)
        finally:
            if demo.poll() is None:
                demo.kill()
    with (workdir / "monitor.csv").open() as f:
        system = [row for row in csv.DictReader(f) if row["pid"] == "system"]
    return DemoRun(demo.returncode, out.read_text(errors="replace"), workdir, monitor_dir, system)


@pytest.fixture(scope="module")
def idle_demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    return run_demo(tmp_path_factory.mktemp("idle-demo"))


def test_demo_under_monitor_reports_ledger_csv_and_picture(idle_demo):
    """The README's main job, run under `monitor`: covers a real start of all three roles."""
    assert idle_demo.code == 0, idle_demo.out[-6000:]
    out = idle_demo.out
    for phase in PHASES:
        assert re.search(rf"\] {phase}\s+\d", out), phase
    assert "likely cause:" in out
    assert (idle_demo.workdir / "host-memory.png").stat().st_size > 20_000
    assert "exited with 0" in out and "peak summed RSS" in out
    assert "peak growth of other processes" in out

    with (idle_demo.monitor_dir / "monitor.csv").open() as f:
        roles = {row["role"] for row in csv.DictReader(f)}
    assert {"api_server", "engine_core", "worker", "system"} <= roles


def test_the_demos_phase_marks_sit_where_its_ledger_and_samples_say(idle_demo):
    """Issue 61 item 2 on a live run: the marks of the demo's picture against its ledger,
    and the worker's band against its marks (tests/helpers/demo_marks.py)."""
    assert idle_demo.code == 0, idle_demo.out[-6000:]
    assert_marks_where_the_ledger_says(
        idle_demo.workdir / "monitor.csv", idle_demo.workdir / "ledger"
    )


def _peak_outside(run: DemoRun) -> float:
    return max(int(row["outside_processes"] or 0) for row in run.system)


def test_a_neighbour_taking_1_gib_is_drawn_as_other_processes_not_as_not_in_any_process(
    idle_demo, tmp_path
):
    """Issue 61's first "done when": the demo on a busy host, where a process outside vLLM's
    tree starts after the monitor and takes and holds 1 GiB. That GiB is the others' growth
    in the demo's CSV and picture, and "not in any process" stays within 0.3 GiB of the idle
    run's (the module's other demo)."""
    neighbour = Neighbour()
    busy = run_demo(tmp_path, neighbour)
    assert busy.code == 0, busy.out[-6000:]
    assert neighbour.anon >= GiB, neighbour
    samples = [(float(row["ts"]), int(row["other_processes"])) for row in busy.system]
    before = [others for ts, others in samples if ts < neighbour.started]
    after = [others for ts, others in samples if ts > neighbour.held]
    assert before and after, (neighbour, samples[:5])
    step = after[0] - before[-1]
    # The step spans the holder's start and at most two samples: what else outside the tree
    # moves in that second (this test, the demo's and monitor's own processes) is a few MiB
    # on a CI host; the holder's interpreter is inside its measured PSS.
    assert abs(step - neighbour.anon) <= 64 * MiB, (step / MiB, neighbour.anon / MiB)
    _, read = read_monitor_csv(busy.workdir / "monitor.csv")
    drawn = next(line for line in system_lines(read) if line.label == OTHER_PROCESSES)
    assert max(drawn.gib) >= (step - 64 * MiB) / GiB
    # monitor's summary, from its own samples (the holder is outside its tree too)
    summary = re.search(r"peak growth of other processes ([\d,]+) MiB", busy.out)
    assert summary and int(summary.group(1).replace(",", "")) >= 1000, busy.out[-2000:]

    idle, busier = _peak_outside(idle_demo), _peak_outside(busy)
    assert abs(busier - idle) <= 0.3 * GiB, (busier / GiB, idle / GiB)
