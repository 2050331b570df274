"""Which vLLM process this is, read without importing vLLM."""

from __future__ import annotations

import multiprocessing
import re
from dataclasses import dataclass

_WORKER = re.compile(r"VllmWorker-(\d+)")


@dataclass(frozen=True)
class ProcessRole:
    role: str
    index: int | None = None

    def __str__(self) -> str:
        return self.role if self.index is None else f"{self.role}-{self.index}"


def current_role() -> ProcessRole:
    """Role from the multiprocessing process name, which vLLM sets before plugins load.

    The process title is not usable at registration time: in a worker it is
    still the spawn command line.
    """
    name = multiprocessing.current_process().name
    match = _WORKER.fullmatch(name)
    if match:
        return ProcessRole("worker", int(match.group(1)))
    if name.startswith("EngineCore"):
        return ProcessRole("engine_core")
    if name == "MainProcess":
        return ProcessRole("main")
    return ProcessRole("other")
