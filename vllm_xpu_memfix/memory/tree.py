"""Find the processes of one vLLM instance and their roles."""

from __future__ import annotations

import os

import psutil

from vllm_xpu_memfix.memory.snapshot import LIVE, ProcReader


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.Error, OSError):
        return []


def role_of(cmdline: list[str]) -> str:
    """vLLM role from a command line, which carries the title vLLM sets (``VLLM::Worker_TP0``)."""
    joined = " ".join(cmdline)
    if "::EngineCore" in joined:
        return "engine_core"
    if "::Worker" in joined:
        return "worker"
    if "::APIServer" in joined or "vllm.entrypoints" in joined or _is_vllm_script(cmdline):
        return "api_server"
    return "other"


def _is_vllm_script(cmdline: list[str]) -> bool:
    return any(os.path.basename(arg) == "vllm" for arg in cmdline[:2])


def is_vllm_process(proc: psutil.Process) -> bool:
    return role_of(_cmdline(proc)) in ("engine_core", "worker", "api_server")


def instance_root(pid: int | None = None) -> psutil.Process:
    """The top-most vLLM process above ``pid`` (default: this process)."""
    proc = psutil.Process(pid or os.getpid())
    while True:
        try:
            parent = proc.parent()
        except psutil.Error:
            return proc
        if parent is None or not is_vllm_process(parent):
            return proc
        proc = parent


def tree_pids(root: psutil.Process) -> list[int]:
    try:
        return [root.pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return [root.pid]


def tree_anon_pss(pid: int | None = None, reader: ProcReader = LIVE) -> int | None:
    """Summed anonymous + shmem PSS of this vLLM instance's process tree; ``None`` if unreadable."""
    values = [reader.process_anon_pss(str(p)) for p in tree_pids(instance_root(pid))]
    known = [v for v in values if v is not None]
    return sum(known) if known else None
