"""Which vLLM process this is, read without importing vLLM or Ray."""

from __future__ import annotations

import multiprocessing
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from vllm_xpu_memfix.core import files

_WORKER = re.compile(r"VllmWorker-(\d+)")
# vLLM 0.32's RayExecutorV2 names each worker actor
# vllm_Worker_<instance id>[_TP<i>][_PP<j>][_PCP<k>] (v1/executor/ray_utils.py,
# build_actor_name; the instance id is digits). The legacy RayExecutor leaves its
# RayWorkerWrapper actors unnamed; they are known by their class in the task name.
_RAY_ACTOR_NAME = re.compile(r"vllm_Worker_(?P<instance>[^_]+)(?P<rank>(?:_(?:TP|PP|PCP)\d+)*)")
_RAY_WORKER_TASKS = ("RayWorkerProc.", "RayWorkerWrapper.")
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class RayPlacement:
    """Where a Ray actor runs, from Ray's runtime context.

    ``rank`` is the actor name's suffix (``TP1``, ``TP1_PP0``; ``0`` for a one-rank
    engine), ``None`` for an unnamed actor. ``instance`` is vLLM's instance id.
    """

    node_id: str
    rank: str | None
    instance: str | None
    placement_group: str | None
    job: str | None


@dataclass(frozen=True)
class ProcessRole:
    role: str
    index: int | None = None
    ray: RayPlacement | None = None
    note: str | None = None

    def __str__(self) -> str:
        return self.role if self.index is None else f"{self.role}-{self.index}"

    def describe(self) -> str:
        """``role=...`` for the registration line; on Ray also rank and node."""
        text = f"role={self}"
        if self.ray is not None:
            text += (
                f" rank={self.ray.rank or 'unknown'} node={socket.gethostname()}"
                f" ray_node={self.ray.node_id[:8]}"
            )
        return f"{text}; {self.note}" if self.note else text


def ray_placement() -> tuple[RayPlacement | None, bool, str | None]:
    """This process's Ray actor, whether it hosts a vLLM worker, and a note if Ray is unusable.

    Only a Ray that is already imported is asked (``sys.modules``): importing it
    costs half a second and a process that never imported it is no Ray actor.
    """
    ray = sys.modules.get("ray")
    if ray is None:
        return None, False, None
    try:
        if not ray.is_initialized():
            return None, False, None
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None, False, None  # the driver or a task: not an actor
        name = context.get_actor_name() or ""
        task = context.get_task_name() or ""
        node, group, job = (
            context.get_node_id(),
            context.get_placement_group_id(),
            context.get_job_id(),
        )
    except Exception as exc:
        return (
            None,
            False,
            f"ray is imported but gives no runtime context ({type(exc).__name__}: {exc}); "
            "role taken from the process name",
        )
    match = _RAY_ACTOR_NAME.fullmatch(name)
    rank = (match.group("rank").lstrip("_") or "0") if match else None
    placement = RayPlacement(
        str(node), rank, match.group("instance") if match else None, group, job
    )
    return placement, bool(match) or task.startswith(_RAY_WORKER_TASKS), None


def current_role() -> ProcessRole:
    """Role from the multiprocessing process name, which vLLM sets before plugins load,
    or from Ray's runtime context in a Ray actor (whose process name is ``MainProcess``).

    The process title is not usable at registration time: in a worker it is
    still the spawn command line.
    """
    name = multiprocessing.current_process().name
    match = _WORKER.fullmatch(name)
    if match:
        return ProcessRole("worker", int(match.group(1)))
    if name.startswith("EngineCore"):
        return ProcessRole("engine_core")
    placement, vllm_worker, note = ray_placement()
    if vllm_worker:
        return ProcessRole("ray_worker", ray=placement)
    return ProcessRole("main" if name == "MainProcess" else "other", ray=placement, note=note)


def instance_key() -> str:
    """What the ranks of one vLLM engine share on a host, for the locks' ``instance`` scope.

    Multiprocessing ranks are children of their engine's EngineCore process: its
    pid. Ray actors are children of the node's raylet, shared by every engine on
    the node, so a Ray worker uses vLLM's instance id from its actor name, else its
    placement group (one per engine), else its Ray job.
    """
    role = current_role()
    ray = role.ray
    if role.role != "ray_worker" or ray is None:
        return f"engine{os.getppid()}"
    if ray.instance:
        key = f"vllm{ray.instance}"
    elif ray.placement_group:
        key = f"pg{ray.placement_group}"
    else:
        key = f"job{ray.job}"
    return _KEY_CHARS.sub("_", key)


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None where it is gone:
    with the pid, it names a process even after the pid is reused."""
    try:
        stat = files.read_bytes(f"/proc/{pid}/stat", files.ATTRIBUTE_CAP)
        # Field 22, starttime; the fields after the command name, which may hold spaces.
        return stat.rpartition(b")")[2].split()[19].decode("ascii")
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def began_at(pid: int | None = None) -> float | None:
    """When process ``pid`` (this one where None) started, in epoch seconds, to a clock
    tick; None where /proc cannot say. The kernel counts a process's start in ticks of
    CLOCK_BOOTTIME (proc(5)); the boot's epoch is taken from that clock, not from
    /proc/stat's ``btime``, which is whole seconds (up to a second early)."""
    ticks = start_time(os.getpid() if pid is None else pid)
    if ticks is None or not ticks.isdigit():
        return None
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot + int(ticks) / os.sysconf("SC_CLK_TCK")


def instance_token() -> str:
    """:func:`instance_key` and the start time of this process's parent (the EngineCore of
    multiprocessing ranks): a decision a previous engine left under a pid that was reused
    then carries another token."""
    return f"{instance_key()}@{start_time(os.getppid()) or '?'}"


def environ_at_start() -> dict[str, str] | None:
    """The environment this process was started with (``/proc/self/environ``).

    Later ``os.environ`` changes do not show there; ``None`` where it cannot be read.
    """
    try:
        raw = files.read_bytes("/proc/self/environ", files.LIST_CAP)
    except OSError:
        return None
    pairs = (item.decode(errors="surrogateescape").partition("=") for item in raw.split(b"\0"))
    return {key: value for key, sep, value in pairs if sep}


# The vLLM instance (start-up) a process belongs to: set by the process that starts it (the
# API server, or an ``LLM(...)`` script) and inherited by the engine and the workers,
# through the environment: multiprocessing copies it, and vLLM 0.32's Ray executors copy
# every ``VLLM_*`` variable to their actors (ray/ray_env.py, v1/executor/ray_env_utils.py).
START_VARIABLE = "VLLM_XPU_MEMFIX_START"


def start_identity(environ: MutableMapping[str, str] = os.environ) -> str:
    """This start-up's identity, ``<pid>-<start time>-<nonce>`` of the process that started
    it. The main process of a program starts one (a ``vllm serve`` started from another
    vLLM program is a start-up of its own); every other process takes its parent's."""
    inherited = environ.get(START_VARIABLE, "")
    if inherited and current_role().role != "main":
        return inherited
    pid = os.getpid()
    mine = f"{pid}-{start_time(pid) or '?'}-"
    if inherited.startswith(mine):  # this process started it already
        return inherited
    identity = mine + secrets.token_hex(3)
    environ[START_VARIABLE] = identity
    return identity


def starts_the_instance(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process starts its vLLM instance (the API server, an ``LLM(...)``
    program), not an engine or worker of one, which inherits its start identity."""
    role = current_role().role
    return role == "main" or (role == "other" and not environ.get(START_VARIABLE))


def started_pid(identity: object) -> int | None:
    """The pid of the process that started ``identity``'s start-up, where it is one."""
    head = str(identity).split("-", 1)[0]
    return int(head) if head.isdigit() else None
