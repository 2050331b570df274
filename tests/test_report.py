"""``vllm-xpu-memfix report``: the machine as the recorded trees give it, redaction, bad ledger
files, and, on a real vLLM server, the preflight's prediction beside what was measured at
ready (the at-ready line and its ledger row).

No Intel GPU host can be reached from here: the GPUs, driver and kernel come from the
constructed sysfs/dpkg/proc trees of ``tests/hosts.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.odd_files import fifo, within
from hosts import B70, build_host

from vllm_xpu_memfix.cli.report import starts
from vllm_xpu_memfix.core.process import start_identity, started_pid
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.startup import prediction_check

ROOT = Path(__file__).resolve().parent.parent


def run_report(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI with vLLM and torch unimportable: report reads metadata, never imports them."""
    code = (
        "import sys; sys.modules['vllm'] = sys.modules['torch'] = None; "
        "from vllm_xpu_memfix.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "report", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT),
            "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"],  # conftest's: none of the user's
            **env,
        },
    )


def cell(text: str, name: str) -> str:
    """The value of the report's row ``name``: a table row, or a list item wrapped over
    lines where the table would pass 100 columns."""
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith(f"| {name} |")]
    if rows:
        (row,) = rows
        return row.split(" | ", 1)[1].rstrip(" |")
    (at,) = [n for n, line in enumerate(lines) if line.startswith(f"- **{name}**: ")]
    item = [lines[at].split(": ", 1)[1]]
    for line in lines[at + 1 :]:
        if not line.startswith("  "):
            break
        item.append(line.strip())
    return " ".join(item)


def test_the_report_reads_in_a_terminal_100_columns_wide(tmp_path):
    """The machine's rows pass 100 columns as a table: a list, every line within 100."""
    result = run_report({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    head = result.stdout.split("Environment (", 1)[0]
    assert "- **switches**: " in head and "| switches |" not in head
    assert max(map(len, head.splitlines())) <= 100


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_ledger_named_that_is_no_directory_is_one_line_and_exit_2(tmp_path, kind):
    given = tmp_path / "ledgr"
    if kind == "file":
        given.write_text("")
    result = run_report({"XDG_CACHE_HOME": str(tmp_path / "cache")}, "--ledger", str(given))
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    said = "does not exist" if kind == "missing" else "not a directory"
    assert "--ledger" in line and said in line


def test_the_machine_comes_from_the_sysroot_without_vllm(tmp_path):
    host = build_host(tmp_path / "host", [B70, B70], runtime="26.14.37833.4", kernel="6.14.0-29")
    result = run_report(
        {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert cell(out, "GPUs").startswith("2x Arc Pro B70 (0xe223), 32.0 GiB each")
    assert cell(out, "compute-runtime").startswith("26.14.37833.4-1~24.04 (dpkg: ")
    assert cell(out, "Level Zero loader") == "1.28.2-1~24.04"
    assert cell(out, "kernel") == "6.14.0-29"
    assert cell(out, "host memory").startswith("MemTotal 128.0 GiB; room 120.0 GiB")
    assert "no start-up recorded here yet" in out


def test_bad_ledger_files_are_counted_never_fatal(tmp_path):
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    fifo(ledger / "ledger-h-1.jsonl")
    (ledger / "ledger-h-2.jsonl").mkdir()
    with (ledger / "ledger-h-3.jsonl").open("wb") as huge:
        huge.truncate(starts.LEDGER_FILE_CAP + 1)
    row = {"phase": "process start", "pid": 4, "role": "worker-0", "rank": 0, "ts": 100.0}
    (ledger / "ledger-h-4.jsonl").write_text(
        json.dumps(row) + "\nnot json\n[1, 2]\n" + json.dumps({**row, "ts": "x"}) + "\n"
    )
    read = within(30, lambda: starts.read(ledger))
    assert len(read.skipped_files) == 3 and read.junk_lines == 3 and read.unnamed_rows == 1
    host = build_host(tmp_path / "host", [])
    result = within(
        60, lambda: run_report({"VLLM_XPU_MEMFIX_SYSROOT": str(host)}, "--ledger", str(ledger))
    )
    assert result.returncode == 0, result.stderr
    assert "- not read: 3 file(s)" in result.stdout
    assert "3 line(s) that are no ledger row" in result.stdout
    assert "start-ups recorded before 0.1.0: 1 row(s) without a start-up identity" in result.stdout


@pytest.mark.server
def test_a_real_start_logs_the_prediction_beside_the_measurement_and_report_shows_it(
    default_start,
):
    """vLLM's API server with the plugin and a ledger: at ready, one INFO line with the
    predicted host need, the measured tree's PSS and their ratio; the API server's ledger
    keeps both; report shows the preflight, the line and the worker's phases."""
    log, server_pid, ledger = default_start.log, default_start.pid, default_start.ledger_dir
    (line,) = [x for x in log.splitlines() if "vllm-xpu-memfix: ready; preflight" in x]
    assert " INFO " in line and len(line.split("] ", 1)[1]) <= 320
    rows = [
        json.loads(x) for p in ledger.glob("ledger-*.jsonl") for x in p.read_text().splitlines()
    ]
    # One start-up: the API server named it, its engine and worker inherited the name.
    (start,) = {r["start"] for r in rows}
    assert started_pid(start) == server_pid and len({r["pid"] for r in rows}) >= 3
    (begun,) = [r for r in rows if "argv" in r]
    assert begun["pid"] == server_pid and f"--port {default_start.port}" in begun["argv"]
    (ready,) = [r for r in rows if r["phase"] == prediction_check.READY and "predicted_host" in r]
    (predicted,) = [r for r in rows if r["phase"] == prediction_check.PREDICTED]
    assert ready["predicted_host"] == predicted["predicted_host"] > 0
    assert ready["measured_host"] == ready["tree_anon_pss"] > 0
    ratio = ready["measured_host"] / ready["predicted_host"]
    assert f"measured {ready['measured_host'] / GiB:,.2f} GiB" in line
    assert line.endswith(f"{ratio:.2f}x")
    out = run_report({"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}).stdout
    assert f"- preflight: `{predicted['line']}`" in out
    assert ready["line"] in out
    (kv,) = [x for x in out.splitlines() if x.startswith("| kv_cache (KV cache allocated) |")]
    worker = next(r for r in rows if r["phase"] == "KV cache allocated")
    assert re.search(rf"\| {worker['rss_anon'] / GiB:,.2f} / - \|", kv), kv


def test_at_ready_puts_the_device_beside_the_workers_vram_and_keeps_a_row(tmp_path):
    """The device side comes from this start-up's worker rows (DRM drm-total-vram): another
    server's sharing the directory, written at the same time with more VRAM, junk and a
    FIFO are passed over (issue 52: "measured 31.00: 3.10x" came from the other server)."""
    from vllm_xpu_memfix.core import config

    ledger = tmp_path / "ledger"
    ledger.mkdir()
    fifo(ledger / "ledger-h-9.jsonl")
    this = start_identity()
    other = {"phase": "warm-up done", "pid": 7, "ts": 1000.0, "drm_total_vram": 31 * GiB}
    other["start"] = f"7-{this.split('-')[1]}-0ther0"
    new = {"phase": "warm-up done", "pid": 8, "ts": 1000.0, "drm_total_vram": 27 * GiB}
    new["start"] = this
    (ledger / "ledger-h-8.jsonl").write_text(f"{json.dumps(other)}\n{{junk\n{json.dumps(new)}\n")
    host = build_host(tmp_path / "host", [B70])
    env = {"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger), "VLLM_XPU_MEMFIX_SYSROOT": str(host)}
    settings = config.load(env)
    prediction = prediction_check.Prediction("fits", 8 * GiB, 30 * GiB, None, 500.0)
    line = within(30, lambda: prediction_check.at_ready(settings, prediction))
    assert line.startswith("vllm-xpu-memfix: ready; preflight (fits) vs measured, host: ")
    assert line.endswith("device a rank: predicted 30.00 GiB, measured 27.00: 0.90x")
    assert len(line) <= 320
    (row,) = [
        json.loads(x)
        for p in ledger.glob("ledger-*-*.jsonl")
        if p.is_file() and p.name != "ledger-h-8.jsonl"
        for x in p.read_text().splitlines()
    ]
    assert row["phase"] == "ready" and row["measured_device"] == 27 * GiB
    assert row["line"] == line and row["predicted_host"] == 8 * GiB


def test_the_prediction_kept_is_the_verdicts_largest_phase(tmp_path):
    from vllm_xpu_memfix.core import config
    from vllm_xpu_memfix.fixes.preflight import Verdict

    host = build_host(tmp_path / "host", [B70])
    settings = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    phases = {
        "load": {"host_gib": 12.5, "device_gib": 20.0},
        "kv_cache": {"host_gib": 40.0, "device_gib": 29.0},
        "warmup": {"host_gib": 41.0, "device_gib": None},
    }
    prediction_check.keep(settings, Verdict("at risk", [], [], [], None, {"phases": phases}), "x")
    (kept,) = prediction_check._KEPT
    assert (kept.verdict, kept.host_bytes, kept.device_bytes) == ("at risk", 41 * GiB, 29 * GiB)
    prediction_check.keep(settings, Verdict("fits", [], [], [], None, {"platform": "cpu"}), "y")
    assert prediction_check._KEPT == []


@pytest.mark.parametrize(
    ("env", "switches", "fixes"),
    [
        ({}, "none set; the rest at their defaults", "on: ledger (auto), host_release (auto)"),
        (
            {
                "VLLM_XPU_MEMFIX_WARMUP_LOCK": "off",
                "VLLM_XPU_MEMFIX_KV_HEADROOM": "on",
                "VLLM_XPU_MEMFIX_LOAD_SLOTS": "zero",
            },
            "VLLM_XPU_MEMFIX_LOAD_SLOTS='zero' is not valid",
            "kv_headroom (on), driver_env (auto), preflight (auto); off: warmup_lock, load_lock",
        ),
        ({"VLLM_XPU_MEMFIX": "0"}, "VLLM_XPU_MEMFIX=0", "none: the plugin is off"),
        (
            {"VLLM_XPU_MEMFIX_PREFLIGHT": "refuse", "VLLM_XPU_MEMFIX_LOAD_SLOTS": "zero"},
            "invalid: VLLM_XPU_MEMFIX_LOAD_SLOTS='zero'",
            "none: vllm serve stops at start-up",
        ),
    ],
)
def test_the_fixes_on_and_off_are_shown_as_the_start_up_would_take_them(
    tmp_path, env, switches, fixes
):
    """Each fix with its effective mode, as the registration line says it; a bad value
    turns off the fixes that read it, unless the preflight is ``refuse`` (issue 59 item 7)."""
    result = run_report({"XDG_CACHE_HOME": str(tmp_path / "cache"), **env})
    assert result.returncode == 0, result.stderr
    assert switches in cell(result.stdout, "switches")
    assert fixes in cell(result.stdout, "fixes")
