from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_xpu_memfix.cli.demo.server import Server

# No test reaches the Hugging Face Hub: doctor and the preflight ask it for a model that is
# not at hand, so the suite runs offline; tests/test_hub.py gives its own stand-in Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_xpu_memfix.cli.demo.tiny_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_xpu_memfix.cli.demo.tiny_model import SMALL, make_model

    return make_model(tmp_path_factory.mktemp("small-model"), SMALL)


@pytest.fixture(scope="session")
def built_release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel) of this checkout, built once for the tests that read or install them."""
    from helpers.release_build import build_release

    return build_release(tmp_path_factory.mktemp("release"))


@pytest.fixture(autouse=True, scope="session")
def ledger_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The plugin's default ledger directory is under $XDG_CACHE_HOME: every process the
    suite starts writes there, never into the developer's cache. vLLM's and the Hub's
    caches stay where they were."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    kept = {"VLLM_CACHE_ROOT": str(home / "vllm"), "HF_HOME": str(home / "huggingface")}
    with pytest.MonkeyPatch.context() as env:
        for name, value in kept.items():
            env.setenv(name, os.environ.get(name, value))
        cache = tmp_path_factory.mktemp("xdg-cache")
        env.setenv("XDG_CACHE_HOME", str(cache))
        yield cache / "vllm-xpu-memfix" / "ledger"


# Variables the Intel driver reads: a test that leaves one changed in os.environ changes
# what every later process of the run inherits (the Ray cluster, servers).
DRIVER_VARIABLES = (
    "NEOReadDebugKeys",
    "EnableDeferBacking",
    "ForceZeDeviceCanAccessPerReturnValue",
    "ZE_AFFINITY_MASK",
    "ONEAPI_DEVICE_SELECTOR",
)


@pytest.fixture(autouse=True)
def no_driver_variable_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in DRIVER_VARIABLES}
    yield
    after = {name: os.environ.get(name) for name in DRIVER_VARIABLES}
    assert after == before, f"{request.node.nodeid} left driver variables changed: {after}"


@pytest.fixture(autouse=True)
def plugin_records_keep_their_shape(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every record the plugin logs during any test, at whatever level that test lets through,
    is within core.log's limit and no DEBUG record says WARNING (core.log notes each that is
    not; vLLM only ever sees it cut)."""
    from vllm_xpu_memfix.core import log

    log.VIOLATIONS.clear()
    yield
    broken, log.VIOLATIONS[:] = list(log.VIOLATIONS), []
    assert not broken, f"{request.node.nodeid} logged records out of shape: {broken}"


def _plugin_variables() -> list[str]:
    return [n for n in os.environ if n.startswith("VLLM_XPU_MEMFIX") or n == "VLLM_PLUGINS"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plugin variable from the developer's shell leaks into a test."""
    for name in _plugin_variables():
        monkeypatch.delenv(name)


@pytest.fixture
def serve(tmp_path: Path, clean_env: None) -> Iterator[Callable[..., Server]]:
    """Start real vLLM servers; every one is stopped at teardown, pass or fail."""
    started: list[Server] = []

    def start(model: Path, env: dict[str, str | None] | None = None, **kwargs: object) -> Server:
        server = Server(model, tmp_path / f"server-{len(started)}.log", env=env, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


@dataclass(frozen=True)
class FinishedStart:
    """A server that became ready and was stopped: its log at ready, its ids, its ledgers."""

    log: str
    pid: int
    port: int
    ledger_dir: Path


@pytest.fixture(scope="session")
def default_start(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> FinishedStart:
    """One start of vLLM's server on the tiny model with every switch at its default (only the
    ledger in a directory of its own), shared by the tests that read what such a start logs
    and records."""
    root = tmp_path_factory.mktemp("default-start")
    env: dict[str, str | None] = dict.fromkeys(_plugin_variables())
    env["VLLM_XPU_MEMFIX_LEDGER_DIR"] = str(root / "ledger")
    with Server(tiny_model, root / "server.log", env=env) as server:
        server.wait_ready()
        assert server.process is not None
        return FinishedStart(server.log_text(), server.process.pid, server.port, root / "ledger")
