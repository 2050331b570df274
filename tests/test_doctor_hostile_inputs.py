"""doctor on hostile inputs answers within its deadline plus 5 s, in at most one line on
error, with no traceback and no credential on its output (issue 59, "Done when").

The Hub is the stand-in (tests/helpers/hub_standin.py) serving recorded real metadata
(sentence-transformers/all-MiniLM-L6-v2's config.json and safetensors header) with each of
its hostile answers; the inputs on disk are a FIFO named as a ``--config`` and as a
``.gguf``, and a GGUF header written big-endian. Every case is the real command in a fresh
process; they run side by side, each against its own stand-in, to keep the file short.
"""

from __future__ import annotations

import base64
import os
import struct
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.hub_standin import File, Server, StandIn, recorded_repos
from test_bad_input_doctor import doctor

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
HUGE = "org/huge-config"
SECRET = "s3cr3t-pw"
DEADLINE = 5
VLLM_DEADLINE = 20  # vLLM's import alone takes about 8 s of it here
HOST = "gpu = []\n\n[host]\nram_gib = 64\n"


@dataclass
class Case:
    name: str
    args: tuple[str, ...]
    deadline: int = DEADLINE
    hostile: Callable[[StandIn], None] | None = None  # the stand-in's answer; None: no Hub
    credentials: bool = False  # user:password@ in HF_ENDPOINT
    took: float = 0.0
    result: subprocess.CompletedProcess[str] | None = None
    hub: StandIn | None = field(default=None, repr=False)


def _repos() -> dict[str, dict[str, File]]:
    repos = recorded_repos()
    small = {name: repos[MODEL][name] for name in ("config.json", "model.safetensors")}
    config = small["config.json"]
    huge = File(config.head, 300 * 1024 * 1024, False)  # its recorded bytes, then zeros
    return {MODEL: small, HUGE: {**small, "config.json": huge}}


def _set(field_name: str, value: object) -> Callable[[StandIn], None]:
    return lambda hub: setattr(hub, field_name, value)


def _run(case: Case, tmp: Path, host: Path) -> Case:
    env = {"HF_HUB_CACHE": str(tmp / "hf-cache"), "HF_HOME": str(tmp / "hf-home")}
    args = ("--host", str(host), "--deadline", str(case.deadline), "--json", *case.args)
    if case.hostile is None:
        started = time.monotonic()
        case.result = doctor(*args, HF_HUB_OFFLINE="1", **env)
        case.took = time.monotonic() - started
        return case
    with Server(_repos()) as hub:
        case.hostile(hub)
        url = hub.url.replace("://", f"://memfix:{SECRET}@") if case.credentials else hub.url
        started = time.monotonic()
        case.result = doctor(*args, HF_ENDPOINT=url, HF_HUB_OFFLINE="0", **env)
        case.took = time.monotonic() - started
        case.hub = hub
    return case


def _big_endian_gguf(path: Path) -> None:
    """A GGUF version 3 header with no tensors, every number written big-endian."""
    path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0) + bytes(64))


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("hostile")
    host = tmp / "cpu-host.toml"
    host.write_text(HOST)
    os.mkfifo(tmp / "flags.yaml")
    os.mkfifo(tmp / "model.gguf")
    _big_endian_gguf(tmp / "big-endian.gguf")
    line = ("--", "vllm", "serve")
    cases = [
        Case("drip", (MODEL,), hostile=_set("drip_s", 0.5)),
        Case("range ignored", (MODEL,), hostile=_set("ignore_range", True)),
        Case("huge config.json", (HUGE,), hostile=lambda hub: None),
        Case("redirect loop", (MODEL,), hostile=_set("redirect_loop", True)),
        Case("credentials", (MODEL,), hostile=_set("redirect", True), credentials=True),
        Case(
            "vLLM's path: drip, credentials",
            ("--params", "1B", *line, MODEL, "--max-model-len", "256"),
            deadline=VLLM_DEADLINE,
            hostile=_set("drip_s", 0.2),
            credentials=True,
        ),
        Case(
            "FIFO --config", ("--params", "1B", *line, "org/x", "--config", str(tmp / "flags.yaml"))
        ),
        Case("FIFO .gguf", (str(tmp / "model.gguf"),)),
        Case("big-endian GGUF", (str(tmp / "big-endian.gguf"),)),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        done = list(pool.map(lambda c: _run(c, tmp / c.name.replace(" ", "-"), host), cases))
    return {case.name: case for case in done}


def _assert_answered_in_time(case: Case) -> subprocess.CompletedProcess[str]:
    result = case.result
    assert result is not None
    assert case.took < case.deadline + 5, (case.name, case.took, result.stderr[-500:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    if result.returncode != 0:
        assert result.returncode == 2 and result.stdout == "", (case.name, result)
        assert len(result.stderr.splitlines()) == 1, result.stderr
    if case.credentials:
        encoded = base64.b64encode(f"memfix:{SECRET}".encode()).decode()
        assert SECRET not in result.stdout + result.stderr
        assert encoded not in result.stdout + result.stderr
    return result


@pytest.mark.parametrize(
    "name",
    [
        "drip",
        "range ignored",
        "huge config.json",
        "redirect loop",
        "credentials",
        "vLLM's path: drip, credentials",
        "FIFO --config",
        "FIFO .gguf",
        "big-endian GGUF",
    ],
)
def test_each_hostile_input_is_answered_within_the_deadline_in_one_line(answered, name):
    _assert_answered_in_time(answered[name])


def test_what_each_hostile_answer_is_told(answered):
    """What doctor says of each, so that a quick answer is not an empty one."""
    drip = answered["drip"].result
    assert drip is not None and "the Hub did not answer within" in drip.stderr
    ignored = answered["range ignored"]
    assert ignored.result is not None and ignored.hub is not None
    assert "the server ignored Range" in ignored.result.stdout
    assert ignored.hub.weight_bytes_served() < 90_868_376  # never the whole file
    huge = answered["huge config.json"]
    assert huge.result is not None and "above doctor's cap" in huge.result.stderr
    assert huge.hub is not None
    assert not any(m == "GET" and p.endswith("/config.json") for m, p, _ in huge.hub.requests)
    loop = answered["redirect loop"].result
    assert loop is not None and "TooManyRedirects" in loop.stderr
    for name in ("credentials", "vLLM's path: drip, credentials"):
        sent = answered[name].hub
        assert sent is not None and sent.credentials, f"{name}: the Hub was never asked"
    fifo = answered["FIFO .gguf"].result
    assert fifo is not None and "a FIFO, not a regular file" in fifo.stderr
    big = answered["big-endian GGUF"].result
    assert big is not None and "a big-endian GGUF file" in big.stderr
