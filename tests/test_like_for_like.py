"""Predicted and measured, like for like (issue 51, class 7): on vLLM's CPU backend each
phase's host figure counts the processes' own memory, as the measurement at ready does;
only the weights and the KV cache (certain) can make a verdict "will run out of memory";
and the at-ready line says what its predicted figure includes."""

from __future__ import annotations

from hosts import B70, build_host

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.memory.room import host_room
from vllm_xpu_memfix.startup import codes, cpu_backend, prediction_check

GiB = 2**30


def room(tmp_path, gib: float):
    host = tmp_path / f"host-{gib}"
    return host_room(host if host.exists() else build_host(host, [], mem_available_gib=gib))


def test_each_phase_counts_the_processes_own_memory(tmp_path):
    out = cpu_backend.judge(0.5 * GiB, 1 * GiB, room(tmp_path, 8), workers=2)
    own = cpu_backend.processes(2)
    assert own > cpu_backend.processes(1) > 0
    phases = out.gib["phases"]
    assert phases[codes.LOAD]["host_gib"] == round((0.5 * GiB + own) / GiB, 2)
    assert phases[codes.KV_CACHE]["host_gib"] == round((1.5 * GiB + own) / GiB, 2)
    assert out.gib["host_includes"] == cpu_backend.INCLUDES


def test_the_processes_estimate_makes_a_verdict_at_risk_never_will_run_out(tmp_path):
    """1.5 GiB of weights and KV cache fit 2 GiB; with the processes they do not: at
    risk, since their figure is the test bed's, not this machine's."""
    out = cpu_backend.judge(0.5 * GiB, 1 * GiB, room(tmp_path, 2))
    assert out.verdict == codes.AT_RISK and out.phase is None
    assert "the processes about" in out.why
    assert cpu_backend.judge(1.5 * GiB, 1 * GiB, room(tmp_path, 2)).verdict == codes.RUNS_OUT


def test_the_ready_line_says_what_the_prediction_includes(tmp_path):
    host = build_host(tmp_path / "host", [B70])
    settings = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    prediction = prediction_check.Prediction("fits", 2 * GiB, None, None, 0.0, cpu_backend.INCLUDES)
    line = prediction_check.at_ready(settings, prediction)
    assert f"host: predicted 2.00 GiB ({cpu_backend.INCLUDES})" in line
