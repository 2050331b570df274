"""Real vLLM (CPU build) serving a model made at test time, plugin loaded through its
entry point in real API-server, EngineCore and worker processes."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from helpers import plugin_records
from helpers.together import Start, ready_and_answered, serve_together

from vllm_xpu_memfix.cli.demo.tiny_model import parameter_bytes
from vllm_xpu_memfix.core.log import CUT_MARK, LIMIT
from vllm_xpu_memfix.memory.ledger import PHASES, PSS_PHASES

pytest.importorskip("vllm")
pytestmark = pytest.mark.server

REGISTERED = re.compile(r"vllm-xpu-memfix \S+ registered \(pid=(\d+) role=([\w-]+)\)")


def test_plugin_loads_in_every_process_and_server_still_serves(serve, small_model, tmp_path):
    ledger_dir = tmp_path / "ledger"
    records_path = tmp_path / "plugin-records.txt"
    logging_config = plugin_records.capture(tmp_path / "logging.json", records_path)
    server = serve(
        small_model,
        env={
            "VLLM_XPU_MEMFIX_LEDGER": "on",
            "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger_dir),
            "VLLM_LOGGING_CONFIG_PATH": str(logging_config),  # vLLM's own, plus a capture
        },
    )
    server.wait_ready()
    completion = server.complete("Hello, how are you", max_tokens=4)
    assert completion["usage"]["completion_tokens"] > 0
    chat = server.chat("Hi", max_tokens=4)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] > 0

    log = server.log_text()
    registrations = dict(REGISTERED.findall(log))
    assert len(registrations) >= 3, log
    assert {"main", "engine_core", "worker-0"} <= set(registrations.values())
    assert re.search(r"vllm-xpu-memfix: rank 0 load_model took \d+\.\d+ s", log), (
        "patch ran in worker"
    )
    assert "Unknown vLLM environment variable detected: VLLM_XPU_MEMFIX" not in log

    # Every record the plugin logged in every process, DEBUG included, as the records
    # themselves: each within the limit, none cut, no DEBUG record that says WARNING.
    records = plugin_records.read(records_path)
    assert {str(r.pid) for r in records} >= set(registrations), "records from every process"
    too_long = [r for r in records if len(r.message) > LIMIT or r.message.endswith(CUT_MARK)]
    assert not too_long, too_long
    assert not [r for r in records if r.level == "DEBUG" and "WARNING" in r.message]
    main_pid = next(int(pid) for pid, role in registrations.items() if role == "main")
    assert any(r.pid == main_pid and "driver guard not needed" in r.message for r in records), (
        "process 0's guard record, made before vLLM configured logging, is not lost"
    )

    # The ledger: a table with every phase (a record per row), then the attribution and the
    # likely cause, from the worker.
    worker_pid = next(pid for pid, role in registrations.items() if role == "worker-0")
    own = [r.message for r in records if r.pid == int(worker_pid)]
    table_at = own.index("vllm-xpu-memfix: host-memory ledger, rank 0 (worker-0), MiB")
    table = own[table_at + 2 : table_at + 2 + len(PHASES)]
    assert [row.split("  ")[0] for row in table] == list(PHASES)
    assert re.search(r"rank 0 attribution since process start: anon \+[\d,]+ MiB", log)
    assert "vllm-xpu-memfix: rank 0 likely cause: " in log

    by_pid = {}
    for path in ledger_dir.glob("ledger-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        by_pid[rows[0]["pid"]] = rows
    assert set(map(int, registrations)) <= set(by_pid), "every process writes its JSON lines"
    worker = {row["phase"]: row for row in by_pid[int(worker_pid)]}
    assert [row["phase"] for row in by_pid[int(worker_pid)]] == list(PHASES)
    weights = parameter_bytes(small_model)
    assert worker["weights processed"]["rss_anon"] - worker["process start"]["rss_anon"] >= weights
    assert worker["KV cache sized"]["kv_cache_bytes"] == 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1
    assert worker["KV cache sized"]["kv_cache_device"] == "cpu"
    assert worker["weights processed"]["host_weight_bytes"] > 0
    assert "(known: KV cache 1,024 MiB, weights " in log, "the host KV cache is taken out"
    assert worker["KV cache allocated"]["rss_anon"] - worker["KV cache sized"][
        "rss_anon"
    ] >= 0.9 * (1 << 30)
    costs = {row["phase"]: row["ledger_cost_s"] for row in by_pid[int(worker_pid)]}
    cheap = [cost for phase, cost in costs.items() if phase not in PSS_PHASES]
    assert max(cheap) < 0.01, f"ledger cost per phase (s): {costs}"


@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory):
    """Each kind of path a switch cannot use, two starts' worth: a home that does not exist,
    a component too long for the filesystem, a file where a directory is wanted, a path
    under a file, and no permission. Root may write anywhere DAC protects, so the last is
    /proc/sys, which refuses even root (access(2) says so; mkdir there fails)."""
    root = tmp_path_factory.mktemp("bad-paths")
    afile = root / "afile"
    afile.write_text("not a directory\n")
    return [
        {
            "VLLM_XPU_MEMFIX_LEDGER_DIR": "~nouser-memfix/ledger",
            "VLLM_XPU_MEMFIX_LOCK_DIR": str(root / ("x" * 300)),
            "VLLM_XPU_MEMFIX_SYSROOT": str(afile),
        },
        {
            "VLLM_XPU_MEMFIX_LEDGER_DIR": "/proc/sys/vllm-xpu-memfix-ledger",
            "VLLM_XPU_MEMFIX_LOCK_DIR": str(afile / "locks"),
        },
    ]


@pytest.fixture(scope="module")
def oom_paths(tmp_path_factory):
    """A host whose kernel counted 5 OOM kills, and a ledger directory."""
    from hosts import build_host

    root = tmp_path_factory.mktemp("oom")
    host = build_host(root / "host", [])
    (host / "proc/vmstat").write_text("oom_kill 5\n")
    return host, root / "ledger"


@pytest.fixture(scope="module")
def switch_starts(tiny_model, bad_paths, oom_paths, tmp_path_factory):
    """The tiny model served with each switch setting below, and the start whose worker is
    killed, two starts at a time: each test reads only its own start's answer and log."""
    envs = {
        "master-off": {"VLLM_XPU_MEMFIX": "0"},
        "allow-list": {"VLLM_PLUGINS": "some_other_plugin"},
        "invalid": {"VLLM_XPU_MEMFIX_LEDGER": "sometimes"},
        "bad-0": bad_paths[0],
        "bad-1": bad_paths[1],
    }
    starts = {name: Start(tiny_model, env, ready_and_answered) for name, env in envs.items()}
    host, ledger_dir = oom_paths
    oom_env = {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger_dir)}
    starts["oom-kill"] = Start(tiny_model, oom_env, _kill_the_worker(host, ledger_dir))
    return serve_together(tmp_path_factory.mktemp("switch-starts"), starts)


def test_master_switch_off_applies_no_patch(switch_starts):
    completion, log = switch_starts["master-off"].result()
    assert completion["usage"]["completion_tokens"] > 0
    assert len(re.findall(r"vllm-xpu-memfix \S+ disabled by VLLM_XPU_MEMFIX=0", log)) >= 3
    assert "registered" not in "".join(
        line for line in log.splitlines() if "vllm-xpu-memfix" in line
    )
    assert "load_model took" not in log


def test_plugin_allow_list_without_it_keeps_it_out(switch_starts):
    completion, log = switch_starts["allow-list"].result()
    assert completion["usage"]["completion_tokens"] > 0
    assert "vllm-xpu-memfix" not in log


def test_invalid_switch_turns_its_fix_off_with_a_clear_error_and_vllm_serves(switch_starts):
    """A bad value stops nothing (issue 52, item 4): that fix is off, named in an ERROR."""
    completion, log = switch_starts["invalid"].result()
    assert completion["usage"]["completion_tokens"] > 0
    assert (
        "VLLM_XPU_MEMFIX_LEDGER='sometimes' is not valid; accepted values: auto, on, off; "
        "turned off: ledger" in log
    )
    registered = [line for line in log.splitlines() if " registered (pid=" in line]
    assert registered and all("off: ledger" in line for line in registered)


@pytest.mark.parametrize("which", [0, 1], ids=["home-long-file", "no-permission-under-file"])
def test_no_bad_path_stops_vllm_and_each_is_one_error(switch_starts, bad_paths, which):
    """Issue 59: any path a switch cannot use turns its fixes off with one ERROR, logged by
    the process that starts vLLM only (not again by EngineCore and the worker), and vLLM
    serves. Several switches are bad at once to share one start."""
    bad = bad_paths[which]
    completion, log = switch_starts[f"bad-{which}"].result()
    assert completion["usage"]["completion_tokens"] > 0
    assert "Traceback" not in log
    for name in bad:
        errors = [line for line in log.splitlines() if f"vllm-xpu-memfix: {name}=" in line]
        assert len(errors) == 1, (name, errors)
        assert "ERROR" in errors[0] and "turned off: " in errors[0], errors[0]
        fixes = errors[0].rsplit("turned off: ", 1)[1].split(", ")
        registered = [line for line in log.splitlines() if " registered (pid=" in line]
        assert len(registered) >= 3, registered  # API server, EngineCore, worker
        for line in registered:
            off = line.rsplit("off: ", 1)[1]
            assert all(fix in off for fix in fixes), (fixes, line)


def test_the_v2_model_runner_ends_the_ledger_after_its_warm_up(serve, tiny_model, tmp_path):
    """With VLLM_USE_V2_MODEL_RUNNER=1 (the default runner from vLLM 0.34, and Intel's 0.26
    image's, llm-scaler #697), the warm-up runs batches itself; "ready" must come after
    "warm-up done", and the table must be logged once. vLLM refuses the V2 runner without
    Triton ("Model Runner V2 requires Triton"), and the CPU build's Triton has no CPU
    backend, so this runs only where Triton can drive the device; the same order is tested
    on vLLM's own Worker class in tests/test_ledger.py everywhere."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("vLLM's V2 model runner needs Triton, which has no backend on this CPU build")
    ledger_dir = tmp_path / "ledger"
    server = serve(
        tiny_model,
        env={"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger_dir)},
    )
    server.wait_ready()
    assert server.complete("Hello", max_tokens=2)["usage"]["completion_tokens"] > 0
    log = server.log_text()
    assert log.count("vllm-xpu-memfix: host-memory ledger, rank 0") == 1, log[-3000:]
    for path in ledger_dir.glob("ledger-*.jsonl"):
        rows = {
            json.loads(line)["phase"]: json.loads(line) for line in path.read_text().splitlines()
        }
        if str(rows.get("process start", {}).get("role", "")).startswith("worker"):
            assert rows["ready"]["ts"] >= rows["warm-up done"]["ts"]
            return
    raise AssertionError(f"no worker ledger:\n{log[-3000:]}")


def test_the_api_server_logs_exactly_one_preflight_line(default_start):
    lines = [line for line in default_start.log.splitlines() if "preflight:" in line]
    assert len(lines) == 1, lines
    assert "FITS on vLLM's CPU backend" in lines[0] and "KV cache 1.0 GiB" in lines[0]


def _kill_the_worker(host, ledger_dir):
    """The ``use`` of the OOM start: once the worker wrote its first ledger row, the kernel's
    counter rises (as the OOM killer's would) and the worker is SIGKILLed; the API server's
    exit follows. Returns the worker's pid and the log."""

    def use(server):
        assert server.process is not None
        deadline = time.monotonic() + 240
        worker = None
        while worker is None and time.monotonic() < deadline and server.process.poll() is None:
            for path in ledger_dir.glob("ledger-*.jsonl"):
                rows = [json.loads(line) for line in path.read_text().splitlines() if line]
                if rows and rows[0]["role"].startswith("worker"):
                    worker = rows[0]["pid"]
            time.sleep(0.2)
        assert worker is not None, server.log_text()[-3000:]
        (host / "proc/vmstat").write_text("oom_kill 6\n")
        os.kill(worker, signal.SIGKILL)
        server.process.wait(timeout=180)
        return worker, server.log_text()

    return use


def test_a_worker_killed_at_start_up_with_oom_kill_risen_is_named_with_its_phase(
    switch_starts, oom_paths
):
    worker, log = switch_starts["oom-kill"].result()
    (line,) = [line for line in log.splitlines() if "OOM killer acted" in line]
    assert "oom_kill 5 -> 6" in line and f"pid={worker} after phase" in line
    recorded = [
        json.loads(text)
        for path in oom_paths[1].glob("ledger-*.jsonl")
        for text in path.read_text().splitlines()
    ]
    assert any(r["phase"] == "killed by the OOM killer" for r in recorded)
