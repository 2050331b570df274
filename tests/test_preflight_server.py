"""The preflight inside real ``vllm serve`` processes (the CPU build): start-ups it used to
stop with ``refuse`` now serve, and a refusal is one ERROR record and a clean exit.
Each machine is a sysroot tree (tests/hosts.py); vLLM itself runs on its CPU backend."""

from __future__ import annotations

import time

import pytest
from helpers.hub_standin import Server as HubStandIn
from helpers.together import Start, ready_and_answered, serve_together
from hosts import add_igpu, build_host
from test_hub import recorded_data_bytes

pytest.importorskip("vllm")
pytestmark = pytest.mark.server

REFUSE = {"VLLM_XPU_MEMFIX_PREFLIGHT": "refuse"}


def _preflight_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "vllm-xpu-memfix preflight:" in line]


def _exit(server) -> tuple[int, str]:
    assert server.process is not None
    return server.process.wait(timeout=240), server.log_text()


@pytest.fixture(scope="module")
def refuse_starts(tiny_model, tmp_path_factory):
    """The tiny model served under refuse on three machines, two starts at a time: an iGPU
    host with a 3 GiB room, an unreadable room, and half a GiB of room."""
    root = tmp_path_factory.mktemp("refuse-starts")
    igpu = add_igpu(build_host(root / "igpu", [], mem_available_gib=3))
    unreadable = build_host(root / "unreadable", [])
    (unreadable / "proc/meminfo").write_text("MemTotal:       1024 kB\n")
    small = build_host(root / "small", [], mem_available_gib=0.5)

    def start(host, use=ready_and_answered):
        return Start(tiny_model, {**REFUSE, "VLLM_XPU_MEMFIX_SYSROOT": str(host)}, use)

    starts = {"igpu": start(igpu), "unreadable": start(unreadable), "small": start(small, _exit)}
    return serve_together(root / "logs", starts)


def test_an_igpu_host_with_a_small_room_serves_on_the_cpu_backend(refuse_starts):
    """An iGPU in sysfs and a 3 GiB room: the XPU baseline (3.5 GiB a rank) used to refuse
    this; on vLLM's CPU backend the need is the weights, the 1 GiB KV cache and the
    processes (about 1.3 GiB, startup.cpu_backend), still below 85 % of 3 GiB."""
    completion, log = refuse_starts["igpu"].result()
    assert completion["usage"]["completion_tokens"] > 0
    (line,) = _preflight_lines(log)
    assert "FITS on vLLM's CPU backend" in line and "Iris" not in line


def test_an_unreadable_room_is_not_judged_and_serves(refuse_starts):
    completion, log = refuse_starts["unreadable"].result()
    assert completion["usage"]["completion_tokens"] > 0
    (line,) = _preflight_lines(log)
    assert "NOT JUDGED on vLLM's CPU backend: host room unreadable" in line


def test_a_refusal_is_one_error_record_and_a_clean_exit(refuse_starts):
    """Half a GiB of room cannot hold the 1 GiB KV cache: refuse stops the API server
    before EngineCore starts, with one ERROR record and exit status 1, no traceback."""
    code, log = refuse_starts["small"].result()
    assert code == 1
    (line,) = _preflight_lines(log)
    assert " ERROR " in line and "stopped by VLLM_XPU_MEMFIX_PREFLIGHT=refuse" in line
    assert "first remedy a smaller VLLM_CPU_KVCACHE_SPACE" in line
    assert len(line.split("vllm-xpu-memfix preflight:", 1)[1]) <= 320
    assert "Traceback" not in log and "EngineCore" not in log


LIBRARY_CALLER = """
import sys
from vllm import LLM

try:
    LLM(model=sys.argv[1], max_model_len=128, enforce_eager=True)
except RuntimeError as exc:
    print("CALLER caught", type(exc).__name__, "stopped by" in str(exc))
print("CALLER goes on")
"""


def test_a_refusal_inside_llm_is_an_exception_the_caller_catches(tiny_model, tmp_path, clean_env):
    """issue 52: ``LLM(...)`` under refuse raises a RuntimeError the caller catches; its
    program goes on and exits 0 (it was a SystemExit that passed ``except Exception``)."""
    import os
    import subprocess
    import sys

    from vllm_xpu_memfix.cli.demo.server import CPU_DEFAULT_ENV, with_amx_site

    host = build_host(tmp_path / "host", [], mem_available_gib=0.5)
    env = {**os.environ, **CPU_DEFAULT_ENV, **REFUSE, "VLLM_XPU_MEMFIX_SYSROOT": str(host)}
    result = subprocess.run(
        [sys.executable, "-c", LIBRARY_CALLER, str(tiny_model)],
        env=with_amx_site(env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stdout.splitlines() if line.startswith("CALLER")]
    assert said == ["CALLER caught PreflightRefused True", "CALLER goes on"]
    (line,) = _preflight_lines(result.stdout + result.stderr)
    assert " ERROR " in line and "stopped by VLLM_XPU_MEMFIX_PREFLIGHT=refuse" in line


def _wait_for_preflight(server, timeout_s: float = 240.0) -> str:
    """The preflight's line, as soon as the API server logs it (the weights come later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = _preflight_lines(server.log_text())
        if lines:
            return lines[0]
        assert server.process.poll() is None, server.log_text()[-3000:]
        time.sleep(1)
    raise AssertionError(f"no preflight line after {timeout_s:.0f} s")


def test_serve_by_hub_id_sizes_the_checkpoint_from_the_hubs_headers(serve, tmp_path):
    """Issue 57, class 3: ``vllm serve ORG/MODEL`` with an empty cache, the Hub being the
    stand-in (recorded FP8 metadata). vLLM fetches config.json into the cache, then the
    preflight runs: it reads the Hub's headers for the FP8 checkpoint's own bytes, where
    it took the parameters of hf_config at 16 bits (15.0 GiB), and with a 16 GiB room the
    line is FITS. vLLM's later download of the weights is the stand-in's to refuse."""
    host = build_host(tmp_path / "host", [], mem_available_gib=16)
    with HubStandIn() as hub:
        env = {
            **REFUSE,
            "VLLM_XPU_MEMFIX_SYSROOT": str(host),
            "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
            "HF_HUB_OFFLINE": "0",
        }
        server = serve("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", env=env)
        line = _wait_for_preflight(server)
        server.stop()
        weights = recorded_data_bytes("llama-3.1-8b-instruct-fp8") / 2**30
        assert f"weights {weights:,.1f} GiB + KV cache 1.0 GiB" in line, line
        assert "FITS on vLLM's CPU backend" in line
        config = tmp_path / "hf-cache/models--RedHatAI--Meta-Llama-3.1-8B-Instruct-FP8"
        assert list(config.glob("snapshots/*/config.json")), "vLLM fetched config.json"
        assert any(r[2].startswith("bytes=0-") for r in hub.requests), "headers by range"
