"""monitor and plot on real process trees started here."""

from __future__ import annotations

import csv
import errno
import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.refusing_proc import RefusingReader

from vllm_xpu_memfix.cli import main, monitor
from vllm_xpu_memfix.cli.plot import PlotError, plot, read_ledger_phases

MiB = 1024**2

# A parent that starts a child holding 150 MiB for a while, then exits with code 3.
TREE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import time; block = bytearray(150 * 1024 * 1024); time.sleep(2.0)"])
child.wait()
sys.exit(3)
"""


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor")
    code, csv_path, peaks = monitor.run([sys.executable, "-c", TREE], out, interval=0.1)
    rows = list(csv.DictReader(csv_path.open()))
    return code, csv_path, peaks, rows


def test_monitor_returns_the_commands_exit_code_and_samples_its_children(tree_run):
    code, _, peaks, rows = tree_run
    assert code == 3
    pids = {r["pid"] for r in rows if r["pid"] != "system"}
    assert len(pids) >= 2, "the child that appeared later is sampled too"
    system = [r for r in rows if r["pid"] == "system"]
    assert system and all(int(r["mem_available"]) > 0 for r in system)
    assert max(peaks.per_process.values()) >= 150 * MiB
    assert peaks.summed_rss >= 150 * MiB
    report = peaks.report()
    assert "peak summed RSS" in report and "largest MemAvailable drop" in report


def test_plot_draws_a_png_of_the_expected_size_with_ledger_marks(tree_run, tmp_path):
    _, csv_path, _, rows = tree_run
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    t0 = float(rows[0]["ts"])
    phases = [("process start", t0), ("weights loaded", t0 + 1.5), ("weights processed", t0 + 1.8)]
    (ledger / "ledger-host-1.jsonl").write_text(
        "".join(
            json.dumps({"phase": p, "ts": ts, "role": "worker-0", "rank": 0}) + "\n"
            for p, ts in phases
        )
    )
    assert read_ledger_phases(ledger) == [
        (t0, "process start"),
        (t0 + 1.5, "weights loaded / weights processed"),
    ]
    png = plot(csv_path, tmp_path / "out.png", ledger)
    assert png_size(png) == (1200, 650)
    assert png.stat().st_size > 20_000


def test_plot_without_matplotlib_says_how_to_get_it(tree_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"pip install 'vllm-xpu-memfix\[plot\]'"):
        plot(tree_run[1], tmp_path / "out.png")


def test_plot_rejects_a_csv_without_samples(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text(",".join(monitor.COLUMNS) + "\n")
    assert main(["plot", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert "holds no samples" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.csv")]) == 2


def test_monitor_forwards_sigterm_and_exits_with_the_childs_code(tmp_path):
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_xpu_memfix.cli",
            "monitor",
            "--interval",
            "0.1",
            "--out",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            child,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "up"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 7, err
    assert "exited with 7" in out
    assert (tmp_path / "monitor.csv").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["monitor", "--"], 2, "give the command to run after --"),
        (["monitor", "--", "/no/such/program"], 2, "cannot run '/no/such/program': no such file"),
    ],
)
def test_monitor_usage_errors(argv, code, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == code
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# A parent and a child that both sleep; the parent prints the child's pid.
PAIR = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
child.wait()
"""


@pytest.fixture
def pair():
    parent = subprocess.Popen([sys.executable, "-c", PAIR], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    yield parent.pid, child
    psutil.Process(child).kill()
    parent.wait(timeout=20)


def test_a_process_hidden_from_us_stays_in_the_tree_and_is_reported_once(pair, monkeypatch):
    """hidepid=1 or another user's process: its /proc files and psutil's cmdline are
    refused (EACCES); the process is still there, so it stays, counted as unreadable."""
    parent, child = pair
    hidden_cmdline = psutil.Process.cmdline

    def cmdline(self):
        if self.pid == child:
            raise psutil.AccessDenied(self.pid)
        return hidden_cmdline(self)

    monkeypatch.setattr(psutil.Process, "cmdline", cmdline)
    denied = PermissionError(errno.EACCES, "Permission denied")
    sampler = monitor.Sampler(parent, RefusingReader("/", child, denied))
    for _ in range(3):
        rows, system = sampler.sample()
    by_pid = {row["pid"]: row for row in rows}
    assert set(by_pid) == {parent, child}
    assert by_pid[child]["rss"] is None and by_pid[child]["pss"] is None
    assert by_pid[child]["denied"] == "status, smaps_rollup, cgroup, fdinfo"
    assert by_pid[parent]["rss"] > 0 and by_pid[parent]["denied"] == ""
    assert system["rss"] == by_pid[parent]["rss"]
    report = sampler.peaks.report()
    assert "not allowed to read 1 process(es)" in report
    assert report.count(f"({child})") == 1, report
    assert f"({parent})" in report


def test_a_process_gone_between_listing_and_reading_leaves_the_tree(pair):
    parent, child = pair
    gone = ProcessLookupError(errno.ESRCH, "No such process")
    rows, _ = monitor.Sampler(parent, RefusingReader("/", child, gone)).sample()
    assert [row["pid"] for row in rows] == [parent]
