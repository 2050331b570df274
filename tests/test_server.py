"""Real vLLM (CPU build) serving a model made at test time, plugin loaded through its
entry point in real API-server, EngineCore and worker processes."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.server

REGISTERED = re.compile(r"vllm-xpu-memfix \S+ registered \(pid=(\d+) role=([\w-]+)\)")


def test_plugin_loads_in_every_process_and_server_still_serves(serve, tiny_model):
    server = serve(tiny_model, env={"VLLM_XPU_MEMFIX_LEDGER": "on"})
    server.wait_ready()
    completion = server.complete("Hello, how are you", max_tokens=4)
    assert completion["choices"][0]["text"] != "" or completion["usage"]["completion_tokens"] > 0
    chat = server.chat("Hi", max_tokens=4)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] > 0

    log = server.log_text()
    registrations = {pid: role for pid, role in REGISTERED.findall(log)}
    roles = set(registrations.values())
    assert len(registrations) >= 3, log
    assert {"main", "engine_core", "worker-0"} <= roles
    assert re.search(r"vllm-xpu-memfix: rank 0 load_model took \d+\.\d+ s", log), (
        "built-in patch ran in the worker"
    )
    assert "Unknown vLLM environment variable detected: VLLM_XPU_MEMFIX" not in log


def test_master_switch_off_applies_no_patch(serve, tiny_model):
    server = serve(tiny_model, env={"VLLM_XPU_MEMFIX": "0"})
    server.wait_ready()
    assert server.complete("Hello", max_tokens=2)["usage"]["completion_tokens"] > 0
    log = server.log_text()
    assert len(re.findall(r"vllm-xpu-memfix \S+ disabled by VLLM_XPU_MEMFIX=0", log)) >= 3
    assert "registered" not in "".join(
        line for line in log.splitlines() if "vllm-xpu-memfix" in line
    )
    assert "load_model took" not in log


def test_plugin_allow_list_without_it_keeps_it_out(serve, tiny_model):
    server = serve(tiny_model, env={"VLLM_PLUGINS": "some_other_plugin"})
    server.wait_ready()
    assert server.complete("Hello", max_tokens=2)["usage"]["completion_tokens"] > 0
    assert "vllm-xpu-memfix" not in server.log_text()


def test_invalid_switch_stops_start_up_with_a_clear_error(serve, tiny_model):
    server = serve(tiny_model, env={"VLLM_XPU_MEMFIX_LEDGER": "sometimes"})
    assert server.process is not None
    server.process.wait(timeout=180)
    assert server.process.returncode != 0
    assert (
        "VLLM_XPU_MEMFIX_LEDGER='sometimes' is not valid; accepted values: auto, on, off"
        in server.log_text()
    )
