"""Real vLLM servers started two at a time, for a module's tests that each need a start of
its own configuration but only read what it logged and answered.

A start on the CPU build is mostly one process at a time importing vLLM (the API server,
then EngineCore, then the worker), each on one core: on the 2-core test bed two starts side
by side take about as long as one. vLLM's CPU worker binds its OpenMP threads to the first
core by default (``VLLM_CPU_OMP_THREADS_BIND=auto`` with one core kept for the other
processes), so the two would compute on one core: each start gets a core of its own
instead, unless its ``env`` binds. Each start runs in a thread; what it gives back, or what
it raised, is handed to the test that reads it, so one failed start fails only its test.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.cli.demo.server import Server

AT_ONCE = 2  # the test bed's cores


@dataclass(frozen=True)
class Start:
    """One server: ``use(server)`` runs once it is started (it waits for ready itself, or for
    the exit it expects) and returns what the test reads; the server is stopped after."""

    model: str | Path
    env: Mapping[str, str | None]
    use: Callable[[Server], Any]
    extra_args: tuple[str, ...] = ()


def _plugin_variables_unset() -> dict[str, str | None]:
    """No plugin variable of the developer's shell reaches these servers (conftest's
    ``clean_env`` does the same for the function-scoped ``serve``)."""
    names = [n for n in os.environ if n.startswith("VLLM_XPU_MEMFIX") or n == "VLLM_PLUGINS"]
    return dict.fromkeys(names)


def _run(start: Start, log_path: Path, cores: queue.Queue[int]) -> Any:
    core = cores.get()
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), **_plugin_variables_unset(), **start.env}
    server = Server(start.model, log_path, env=env, extra_args=start.extra_args)
    try:
        server.start()
        return start.use(server)
    finally:
        server.stop()
        cores.put(core)


def serve_together(root: Path, starts: Mapping[str, Start]) -> dict[str, Future[Any]]:
    """Run every start, :data:`AT_ONCE` at a time, each logging to ``root/NAME.log``; returns
    when all are done. ``result()`` of a name's future is its ``use``'s value, or raises
    what its start raised."""
    root.mkdir(parents=True, exist_ok=True)
    cores: queue.Queue[int] = queue.Queue()
    for core in sorted(os.sched_getaffinity(0))[:AT_ONCE]:
        cores.put(core)
    with ThreadPoolExecutor(max_workers=cores.qsize()) as pool:
        return {
            name: pool.submit(_run, start, root / f"{name}.log", cores)
            for name, start in starts.items()
        }


def ready_and_answered(server: Server) -> tuple[dict[str, Any], str]:
    """The common ``use``: ready, one two-token completion, then the log."""
    server.wait_ready()
    return server.complete("Hello", max_tokens=2), server.log_text()
