"""monitor and plot on real process trees started here, and on the constructed multi-GPU
xe trees (tests/data/proc/README.md)."""

from __future__ import annotations

import csv
import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.refusing_proc import RefusingReader
from helpers.xe_trees import FOUR_PINNED, FOUR_UNPINNED, SCENARIOS, TWO_PINNED

from vllm_xpu_memfix.cli import main, monitor
from vllm_xpu_memfix.cli.plot import (
    DRIVER_HOST_COPY,
    NOT_IN_ANY,
    OTHER_PROCESSES,
    PEER_IMPORTS,
    PlotError,
    plot,
    read_ledger_phases,
    read_monitor_csv,
    system_lines,
)

MiB, GiB = 1024**2, 1024**3

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
    assert all(r["driver_host_copy"] == r["peer_imports"] == "" for r in system), "no GPU here"
    assert "driver host copy" not in report


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
    assert by_pid[child]["denied"] == "status, fdinfo"  # the files a process row is read from
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


class RecordedProcess:
    """A rank of a constructed tree, as the sampler lists it."""

    def __init__(self, pid: int, rank: int) -> None:
        self.pid = pid
        self.title = f"VLLM::Worker_TP{rank}"

    def cmdline(self) -> list[str]:
        return [self.title]

    def name(self) -> str:
        return self.title[:15]

    def ppid(self) -> int:
        return 1  # the constructed trees record no parent


def monitor_recorded(scenario, csv_path):
    """monitor's CSV of one constructed tree: a sample at process start, one at ready."""
    ranks = [RecordedProcess(pid, rank) for rank, pid in enumerate(scenario.ranks)]
    sampler = monitor.Sampler(os.getpid())
    sampler.root, sampler.processes = ranks[0], lambda: ranks
    moments = iter(["start", "ready"])

    def keep_going():
        moment = next(moments, None)
        if moment is not None:
            sampler.reader = scenario.reader(moment)
        return moment is not None

    peaks = monitor.record(sampler, csv_path, keep_going, interval=0)
    return list(csv.DictReader(csv_path.open())), peaks


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_monitor_writes_the_committed_copy_and_the_imports_in_their_own_columns(scenario, tmp_path):
    rows, peaks = monitor_recorded(scenario, tmp_path / "monitor.csv")
    start, ready = (r for r in rows if r["pid"] == "system")
    assert start["driver_host_copy"] == start["peer_imports"] == "", "no DRM client yet"
    committed, imports = int(ready["driver_host_copy"]), int(ready["peer_imports"])
    assert committed == pytest.approx(scenario.committed, rel=0.10, abs=128 * MiB)
    # Every rank's allocation counted on each of the gpus - 1 peer cards.
    all_imports = scenario.gpus * (scenario.gpus - 1) * scenario.device
    assert imports == pytest.approx(all_imports, rel=0.02)
    workers = [r for r in rows if r["pid"] != "system" and r["drm_cards"]]
    assert {r["drm_cards"] for r in workers} == {str(scenario.gpus)}
    assert peaks.driver_host_copy == committed and peaks.peer_imports == imports
    assert "(drm-total-gtt: not host memory by itself)" in peaks.report()


def test_with_four_gpus_the_committed_copy_is_not_the_three_fold_gtt_count(tmp_path):
    rows, _ = monitor_recorded(FOUR_PINNED, tmp_path / "monitor.csv")
    ready = [r for r in rows if r["pid"] == "system"][-1]
    assert int(ready["peer_imports"]) > 2.9 * int(ready["driver_host_copy"])


@pytest.mark.parametrize("scenario", [FOUR_PINNED, FOUR_UNPINNED], ids=lambda s: s.name)
def test_plot_draws_the_committed_copy_and_labels_the_gtt_as_imports(scenario, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    monitor_recorded(scenario, tmp_path / "monitor.csv")
    _, system = read_monitor_csv(tmp_path / "monitor.csv")
    lines = {line.label: line.gib for line in system_lines(system)}
    assert lines[DRIVER_HOST_COPY][0] == 0, "no DRM client at process start: nothing held"
    assert lines[DRIVER_HOST_COPY][-1] * GiB == pytest.approx(scenario.committed, rel=0.10)
    assert lines[PEER_IMPORTS][-1] * GiB == pytest.approx(4 * 3 * scenario.device, rel=0.02)
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # legend text stays text
        svg = plot(tmp_path / "monitor.csv", tmp_path / "host-memory.svg").read_text()
    assert DRIVER_HOST_COPY in svg and PEER_IMPORTS in svg


def test_plot_of_an_older_csv_without_the_columns_draws_neither(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    rows, _ = monitor_recorded(TWO_PINNED, tmp_path / "monitor.csv")
    older = [c for c in monitor.COLUMNS if c not in ("driver_host_copy", "peer_imports")]
    with (tmp_path / "older.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=older, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _, system = read_monitor_csv(tmp_path / "older.csv")
    assert [line.label for line in system_lines(system)] == [
        "MemAvailable drop since start",
        OTHER_PROCESSES,
        NOT_IN_ANY,
    ]
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        svg = plot(tmp_path / "older.csv", tmp_path / "older.svg").read_text()
    assert DRIVER_HOST_COPY not in svg and "not in any process" in svg


# A process outside the monitored tree that takes 400 MiB once told, then holds it.
HOLDER = """
import sys, time
sys.stdin.readline()
block = bytearray(400 * 1024 * 1024)
print("held", flush=True)
time.sleep(60)
"""


def test_a_neighbours_growth_is_other_processes_not_outside_any_process(pair):
    """A real process beside the tree grows by 400 MiB: the others' column takes it, and
    "not in any process" (what is left of MemAvailable's drop) does not."""
    parent, _ = pair
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        sampler = monitor.Sampler(parent)
        _, first = sampler.sample()
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "held"
        _, system = sampler.sample()
        grown = system["other_processes"] - first["other_processes"]
        drop = first["mem_available"] - system["mem_available"]
        assert grown >= 380 * MiB, grown
        # Neighbours on a shared host move MemAvailable too; the 400 MiB must not be here.
        assert system["outside_processes"] < drop - 300 * MiB or drop < 300 * MiB
        assert "peak growth of other processes" in sampler.peaks.report()
    finally:
        holder.kill()
        holder.wait()


def test_others_the_kernel_refuses_make_not_in_any_process_an_upper_bound(pair, tmp_path):
    """hidepid=1: another process's status is refused (played by RefusingReader, as root
    reads everything); the CSV says so and the picture labels the remainder a bound."""
    parent, _ = pair
    pytest.importorskip("matplotlib")
    denied = PermissionError(errno.EACCES, "Permission denied")
    sampler = monitor.Sampler(parent, RefusingReader("/", 1, denied))
    csv_path = tmp_path / "monitor.csv"
    moments = iter([1, 2])
    monitor.record(sampler, csv_path, lambda: next(moments, None) is not None, interval=0)
    system = [r for r in csv.DictReader(csv_path.open()) if r["pid"] == "system"]
    assert all("1 process(es) refused" in r["others_unseen"] for r in system)
    _, read = read_monitor_csv(csv_path)
    labels = [line.label for line in system_lines(read)]
    assert any(label.startswith(NOT_IN_ANY + ": an upper bound") for label in labels), labels
    assert "an upper bound" in sampler.peaks.report()


def test_a_workers_start_mark_sits_where_the_process_began_not_after_its_imports(tmp_path):
    """Issue 61 item 2: a worker writes its "process start" row after seconds of imports;
    the row's ``began`` (the process's own start, from /proc) is where the mark goes."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    rows = [
        {"phase": "process start", "ts": 130.0, "began": 100.0, "role": "worker-0", "rank": 0},
        {"phase": "weights loaded", "ts": 140.0, "began": 100.0, "role": "worker-0", "rank": 0},
    ]
    (ledger / "ledger-host-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_ledger_phases(ledger) == [(100.0, "process start"), (140.0, "weights loaded")]


def test_began_at_is_the_kernels_start_time_of_the_process():
    """On this machine's real /proc: between the clock read before the child was started and
    the one after, to a clock tick (a mark within one 0.5 s sample needs better than
    /proc/stat's whole-second boot time, which was up to a second early)."""
    from vllm_xpu_memfix.core.process import began_at

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    after = time.time()
    try:
        began = began_at(child.pid)
        assert began is not None
        assert before - 0.02 <= began <= after + 0.02, (before, began, after)
        assert abs(began - psutil.Process(child.pid).create_time()) < 1.5
    finally:
        child.kill()
        child.wait()
    assert began_at(2**22 + 12345) is None  # no such process


def test_phase_labels_closer_than_their_width_never_overlap():
    """Issue 61 item 3: the KV-cache and warm-up marks of a real start-up come a second or
    two apart; their labels are stacked, and every label box is clear of every other."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_xpu_memfix.cli.plot import draw_phase_marks

    fig, ax = plt.subplots(figsize=(12, 6.5), dpi=100)
    ax.plot([0, 90], [0, 2])
    marks = [
        (0.0, "process start"),
        (30.0, "weights loaded / weights processed"),
        (61.0, "kv cache allocated"),
        (61.6, "warm-up done"),
        (62.1, "ready"),
    ]
    labels = draw_phase_marks(fig, ax, marks)
    renderer = fig.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    assert len(boxes) == 5
    for i, box in enumerate(boxes):
        assert all(not box.overlaps(other) for other in boxes[i + 1 :]), labels[i].get_text()
    assert boxes[3].y1 <= boxes[2].y0  # stacked below, not dropped
    plt.close(fig)
