"""One start-up per ledger identity (issue 52, item 5): the process that starts vLLM names the
start-up, its engine and workers inherit the name, and the at-ready line, the OOM-kill line
and ``report`` take only that start-up's rows, however many servers share the directory.
The two-server ledgers here are recorded rows in the shape the plugin writes; the real
server test of tests/test_report.py checks a real start's rows carry one identity."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import run_report

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.process import START_VARIABLE, start_identity, started_pid
from vllm_xpu_memfix.core.units import GiB


def _worker_identity(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    queue.put(start_identity())


def test_the_main_process_names_the_start_and_its_children_inherit_it(monkeypatch):
    monkeypatch.delenv(START_VARIABLE, raising=False)
    mine = start_identity()
    assert started_pid(mine) == os.getpid() and os.environ[START_VARIABLE] == mine
    assert start_identity() == mine, "asked again, the same"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=_worker_identity, args=(queue,), name="VllmWorker-0")
    worker.start()
    assert queue.get(timeout=60) == mine  # a vLLM worker: its start-up's identity
    worker.join(60)
    code = "from vllm_xpu_memfix.core.process import start_identity; print(start_identity())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    own = child.stdout.strip()  # another program's main process: a start-up of its own
    assert own != mine and started_pid(own) not in (None, os.getpid())


def _row(start: str, pid: int, phase: str, ts: float, **extra: object) -> str:
    row = {"start": start, "pid": pid, "role": "worker-0", "rank": 0, "phase": phase, "ts": ts}
    return json.dumps({**row, **extra}) + "\n"


def two_servers(ledger: Path) -> tuple[str, str]:
    """Two servers' start-ups, interleaved in time, in one directory."""
    first, second = "100-5-aaaaaa", "200-6-bbbbbb"
    ledger.mkdir(parents=True)
    for start, pid, t, vram in ((first, 101, 1000.0, 31), (second, 201, 1001.0, 27)):
        text = _row(start, pid - 1, "process start", t, role="main", argv=f"vllm serve m{pid}")
        (ledger / f"ledger-h-{pid - 1}.jsonl").write_text(text)
        text = "".join(
            _row(start, pid, phase, t + i * 2, drm_total_vram=vram * GiB, rss_anon=pid * 2**20)
            for i, phase in enumerate(("process start", "weights processed", "warm-up done"))
        )
        (ledger / f"ledger-h-{pid}.jsonl").write_text(text)
    return first, second


def test_report_shows_one_start_up_never_both(tmp_path):
    ledger = tmp_path / "ledger"
    two_servers(ledger)
    out = run_report({"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}).stdout
    assert "#### Start-up 2 of 2" in out and "`vllm serve m201`" in out
    assert "worker-0 rank 0 pid 201" in out and "worker-0 rank 0 pid 101" not in out
    (listed,) = [line for line in out.splitlines() if line.startswith("- 1: ")]
    assert "started by pid 100, 2 process(es)" in listed
    first = run_report({"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}, "--start", "1").stdout
    assert "#### Start-up 1 of 2" in first and "pid 101" in first and "pid 201" not in first
    missing = run_report({"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}, "--start", "3").stdout
    assert "no start-up 3: the ledger" in missing and "holds 1 to 2" in missing


def test_the_at_ready_device_figure_is_this_start_ups_own(tmp_path):
    from vllm_xpu_memfix.startup import prediction_check

    first, second = two_servers(tmp_path / "ledger")
    assert prediction_check.workers_vram(tmp_path / "ledger", first) == 31 * GiB
    assert prediction_check.workers_vram(tmp_path / "ledger", second) == 27 * GiB


def test_the_oom_kill_line_never_names_another_servers_process(tmp_path, monkeypatch):
    from vllm_xpu_memfix.memory import oom_victim

    _, second = two_servers(tmp_path / "ledger")
    monkeypatch.setenv(START_VARIABLE, second)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-9")
    rows = oom_victim.ledger_rows(tmp_path / "ledger", since=0.0)
    assert {r["pid"] for r in rows.last} == {200, 201} and rows.skipped == 0


def test_the_identity_leaves_vllms_compile_cache_key_alone_and_reaches_ray_workers(monkeypatch):
    """vLLM 0.32 hashes every variable of its table into the compile-cache key
    (envs.compile_factors) and copies every VLLM_* variable to its Ray workers
    (ray/ray_env.py get_env_vars_to_copy; RayExecutorV2's get_driver_env_vars copies all)."""
    envs = pytest.importorskip("vllm.envs")
    from vllm.ray.ray_env import get_env_vars_to_copy

    config.announce_to_vllm()
    monkeypatch.setenv(START_VARIABLE, "1-2-aaaaaa")
    before = envs.compile_factors()
    monkeypatch.setenv(START_VARIABLE, "3-4-bbbbbb")
    assert envs.compile_factors() == before
    assert START_VARIABLE in get_env_vars_to_copy()


def test_report_finds_the_last_start_up_with_no_switch_set(tmp_path):
    """The default ledger directory, under the user's cache, is where report looks."""
    cache = tmp_path / "cache"
    assert config.load({"XDG_CACHE_HOME": str(cache)}).ledger_dir == (
        cache / "vllm-xpu-memfix" / "ledger"
    )
    assert config.load({"VLLM_XPU_MEMFIX_LEDGER_DIR": "off"}).ledger_dir is None
    two_servers(cache / "vllm-xpu-memfix" / "ledger")
    out = run_report({"XDG_CACHE_HOME": str(cache)}).stdout
    assert "#### Start-up 2 of 2 (ledger " in out and "`vllm serve m201`" in out
