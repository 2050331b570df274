"""The preflight inside real ``vllm serve`` processes (the CPU build): start-ups it used to
stop with ``refuse`` now serve, and a refusal is one ERROR record and a clean exit.
Each machine is a sysroot tree (tests/hosts.py); vLLM itself runs on its CPU backend."""

from __future__ import annotations

import pytest
from hosts import add_igpu, build_host

pytest.importorskip("vllm")
pytestmark = pytest.mark.server

REFUSE = {"VLLM_XPU_MEMFIX_PREFLIGHT": "refuse"}


def _preflight_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "vllm-xpu-memfix preflight:" in line]


def test_an_igpu_host_with_a_small_room_serves_on_the_cpu_backend(serve, tiny_model, tmp_path):
    """An iGPU in sysfs and a 3 GiB room: the XPU baseline (3.5 GiB a rank) used to refuse
    this; on vLLM's CPU backend the need is the weights, the 1 GiB KV cache and the
    processes (about 1.3 GiB, startup.cpu_backend), still below 85 % of 3 GiB."""
    host = add_igpu(build_host(tmp_path / "host", [], mem_available_gib=3))
    server = serve(tiny_model, env={**REFUSE, "VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    server.wait_ready()
    assert server.complete("Hello", max_tokens=2)["usage"]["completion_tokens"] > 0
    (line,) = _preflight_lines(server.log_text())
    assert "FITS on vLLM's CPU backend" in line and "Iris" not in line


def test_an_unreadable_room_is_not_judged_and_serves(serve, tiny_model, tmp_path):
    host = build_host(tmp_path / "host", [])
    (host / "proc/meminfo").write_text("MemTotal:       1024 kB\n")
    server = serve(tiny_model, env={**REFUSE, "VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    server.wait_ready()
    assert server.complete("Hello", max_tokens=2)["usage"]["completion_tokens"] > 0
    (line,) = _preflight_lines(server.log_text())
    assert "NOT JUDGED on vLLM's CPU backend: host room unreadable" in line


def test_a_refusal_is_one_error_record_and_a_clean_exit(serve, tiny_model, tmp_path):
    """Half a GiB of room cannot hold the 1 GiB KV cache: refuse stops the API server
    before EngineCore starts, with one ERROR record and exit status 1, no traceback."""
    host = build_host(tmp_path / "host", [], mem_available_gib=0.5)
    server = serve(tiny_model, env={**REFUSE, "VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    assert server.process is not None
    assert server.process.wait(timeout=240) == 1
    log = server.log_text()
    (line,) = _preflight_lines(log)
    assert " ERROR " in line and "stopped by VLLM_XPU_MEMFIX_PREFLIGHT=refuse" in line
    assert "first remedy a smaller VLLM_CPU_KVCACHE_SPACE" in line
    assert len(line.split("vllm-xpu-memfix preflight:", 1)[1]) <= 320
    assert "Traceback" not in log and "EngineCore" not in log
