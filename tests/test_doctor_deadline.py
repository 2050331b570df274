"""doctor's deadline on vLLM's configuration (issue 59, item 4): the one step that can wait
on a slow Hub without a bound of its own. The timer is real (SIGALRM through
``cli.doctor.deadline``); the slow Hub is the stand-in dripping its bytes, and vLLM is the
test bed's real CPU build reading it through huggingface_hub."""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest
from helpers.hub_standin import File, Server
from test_bad_input_doctor import doctor, report, safetensors_bytes
from test_doctor_no_remote_code import CONFIG

from vllm_xpu_memfix.cli.doctor import deadline


def test_the_deadline_cuts_a_blocked_step_and_puts_the_timer_back():
    before = signal.getsignal(signal.SIGALRM)
    left, right = socket.socketpair()
    started = time.monotonic()
    cut = pytest.raises(TimeoutError, match=r"a read was cut at doctor's deadline of 1 s")
    with left, right, cut, deadline.run(1.0):  # cut half a second early, the reserve
        deadline.step("a read", left.recv, 1)  # nothing is ever sent
    assert 0.4 < time.monotonic() - started < 3
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert deadline.left(7.0) == 7.0  # no run under way


def test_past_the_deadline_local_work_goes_on_a_step_is_not_run_and_grace_stops_the_rest(
    monkeypatch,
):
    monkeypatch.setattr(deadline, "GRACE", 0.5)
    asked: list[str] = []
    left, right = socket.socketpair()
    with left, right, deadline.run(0.4):  # steps cut at 0.2 s, the rest stopped at 0.9 s
        time.sleep(0.4)  # local work across the cut: not cut
        assert deadline.left() == 0
        with pytest.raises(TimeoutError, match="had passed"):
            deadline.step("the Hub", asked.append, "asked")
        started = time.monotonic()
        with pytest.raises(deadline.PastDeadline):
            left.recv(1)  # outside any step: stopped at the grace
        assert time.monotonic() - started < 1.5
    assert asked == []


def test_a_slow_hub_costs_the_whole_run_no_more_than_the_deadline(tmp_path):
    """Every 1 KiB of the stand-in's answers comes 0.5 s late; the draft model's config.json,
    which vLLM reads and doctor does not, is 60 KiB: about 30 s a fetch. With --deadline 15
    (vLLM's import takes about 8 s of it here) the run answers within 15 + 5 s: vLLM's
    configuration (or, on a loaded machine, its import) was cut, and the line is judged as
    read, with --params where the model's config.json did not reach the cache in time."""
    pytest.importorskip("vllm")
    config = {key: value for key, value in CONFIG.items() if key != "auto_map"}
    config["model_type"], config["architectures"] = "qwen3", ["Qwen3ForCausalLM"]
    text = json.dumps(config).encode()
    slow = json.dumps({**config, "padding": "x" * 60_000}).encode()
    weights = safetensors_bytes()
    model = {"config.json": File(text, len(text), False)}
    draft = {"config.json": File(slow, len(slow), False)}
    for repo in (model, draft):
        repo["model.safetensors"] = File(weights, len(weights), True)
    host = tmp_path / "cpu-host.toml"
    host.write_text("gpu = []\n\n[host]\nram_gib = 64\n")
    with Server({"org/model": model, "org/slow-draft": draft}) as hub:
        hub.drip_s = 0.5
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "c"), "HF_HUB_OFFLINE": "0"}
        started = time.monotonic()
        got = report(
            doctor(
                *("--host", str(host), "--deadline", "15", "--params", "1B", "--json", "--"),
                *("vllm", "serve", "org/model", "--speculative-config"),
                '{"model": "org/slow-draft", "num_speculative_tokens": 2}',
                **env,
            )
        )
        took = time.monotonic() - started
    line = got["serve_line"]
    assert "deadline of 15 s" in (line["configuration"] or line["parser"]), line
    assert took < 15 + 5, took
