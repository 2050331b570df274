"""What the driver guard (``fixes/driver_env``) logs, from its decision: one finding per
record, the most serious first, each with doctor's cause code where one applies (``log.see``:
``vllm-xpu-memfix explain CODE``) and within ``log.LIMIT`` characters.

The order: compute-runtime #916's failure (every allocation fails), the host copy the
driver will pin, a value not understood, then what the guard set and why; details at
DEBUG. A finding about the host rather than the process (#916, the host copy, a value every
rank inherits) is said at its level by process 0 and by the first live process on the
host that has it (``host_lock.first_alive``, so once per Ray node), at DEBUG by the others;
Intel's two positions on the key only by the first process on the host that sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from vllm_xpu_memfix.core import causes, config, host_lock
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.log import get_logger, listed, see
from vllm_xpu_memfix.core.patching import log_when_configured
from vllm_xpu_memfix.intel import driver_facts as facts

if TYPE_CHECKING:
    from vllm_xpu_memfix.intel import driver

logger = get_logger("driver_env")

FIX = config.DRIVER_ENV
HEAD = "vllm-xpu-memfix: driver guard"
READ, DEFER, NO_PEER = facts.READ_DEBUG_KEYS, facts.DEFER_BACKING, facts.FORCE_PEER_ACCESS
HOST_COPY, XE_PEER_OOM = causes.DRIVER_HOST_COPY, causes.XE_PEER_CONTEXT_OOM
INTERIM_SPEAKER = "driver_env-interim"
RANKS = ("worker", "ray_worker")


class Decision(Protocol):
    """What the records read of the guard's decision (``driver_env.Decision``)."""

    @property
    def reason(self) -> str: ...
    @property
    def env(self) -> dict[str, str]: ...
    @property
    def user_set(self) -> dict[str, str]: ...
    @property
    def visible_intel(self) -> int: ...
    @property
    def copy_expected(self) -> bool | None: ...
    @property
    def host_copy(self) -> bool | None: ...
    @property
    def xe_peer_oom(self) -> driver.XePeerOom | None: ...
    @property
    def not_understood(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Finding:
    """One record: its level, its text and, for a finding about the host, the topic its
    speaker registers under (said at ``level`` by the speaker and process 0, DEBUG else)."""

    level: int
    text: str
    host_wide: str | None = None


def shown(env: Mapping[str, str]) -> str:
    """``K=v K=v`` on one line; a value that is not one plain word is quoted."""
    return " ".join(
        f"{k}={v if v.isprintable() and v.split() == [v] else repr(v)}" for k, v in env.items()
    )


def xe_peer_oom_findings(oom: driver.XePeerOom) -> list[Finding]:
    """compute-runtime #916: certain (ERROR) or not ruled out (WARNING), then its remedies."""
    where = f"{oom.intel_gpus} Intel GPUs in one context, compute-runtime {oom.runtime}"
    if oom.certain:
        head = (
            f"{HEAD}: {facts.XE_PEER_OOM_FAILURE} here ({facts.XE_PEER_OOM_THREAD}: {where}, "
            f"kernel {oom.kernel})"
        )
    else:
        head = (
            f"{HEAD}: {facts.XE_PEER_OOM_THREAD} could not be ruled out ({where}; unknown: "
            f"{listed(oom.unknown, 110)}): if it holds, every device allocation fails"
        )
    kernel = ".".join(map(str, facts.KERNEL_FIXED))
    remedies = (
        f"{HEAD}: remedies for {facts.XE_PEER_OOM_THREAD}: kernel {kernel} or later; "
        f"compute-runtime {facts.XE_PEER_OOM_FIXED.tag} or later "
        f"({facts.XE_PEER_OOM_FIXED_ON_MASTER.name} on master); or {FIX.env}=no_peer_access "
        f"(no P2P); no report shows {DEFER}=0 helping. See {see(XE_PEER_OOM)}"
    )
    level = logging.ERROR if oom.certain else logging.WARNING
    return [Finding(level, head, XE_PEER_OOM), Finding(level, remedies, XE_PEER_OOM)]


def host_copy(decision: Decision) -> Finding:
    return Finding(
        logging.WARNING,
        f"{HEAD}: the Intel driver will pin a host copy of every device allocation here "
        f"({decision.reason}; {facts.HOST_COPY_THREADS}). See {see(HOST_COPY)}",
        HOST_COPY,
    )


def host_findings(decision: Decision) -> list[Finding]:
    """What holds for the host whatever this process sets, most serious first."""
    found = xe_peer_oom_findings(decision.xe_peer_oom) if decision.xe_peer_oom else []
    if decision.host_copy:
        found.append(host_copy(decision))
    found += [
        Finding(logging.WARNING, f"{HEAD}: not understood, taken as absent: {value}", "values")
        for value in decision.not_understood
    ]
    return found


def applied(role: str, decision: Decision, loaded: list[str], interim: bool) -> list[Finding]:
    """The guard set its variables here; ``interim``: this process says Intel's positions."""
    who = "vLLM" if role == "main" else "process (not inherited)"
    level = logging.WARNING if role in ("main", *RANKS) else logging.INFO
    why, *notes = decision.reason.split("; ")
    if NO_PEER in decision.env:
        effect = (
            f": no peer access, so no host copy and no #916 failure, but no P2P. "
            f"See {see(XE_PEER_OOM)}"
        )
    else:
        effect = f" to keep the driver from pinning a host copy. See {see(HOST_COPY)}"
    said = [
        Finding(level, f"{HEAD}: set {shown(decision.env)} in this {who} ({why}){effect}"),
        *(Finding(level, f"{HEAD}: {note}") for note in notes),
        Finding(logging.INFO, f"{HEAD}: opt out with {FIX.env}=off"),
    ]
    if loaded:
        said.append(
            Finding(
                level,
                f"{HEAD}: the Intel driver is already loaded here ({loaded[0]}): the variables "
                "take effect in the processes this one spawns, not in this one nor in Ray "
                "workers (vllm-xpu-memfix ray-env prints them for Ray)",
            )
        )
    if NO_PEER in decision.env:
        said.append(Finding(logging.DEBUG, f"{HEAD}: cost of no P2P: {facts.NO_PEER_ACCESS_COST}"))
        return [*host_findings(decision), *said]
    said.append(Finding(logging.DEBUG, f"{HEAD}: evidence: {facts.HOST_COPY_THREADS}"))
    if interim:
        said += [
            Finding(logging.INFO, f"{HEAD}: {DEFER}=0 is {facts.INTERIM}. See {see(HOST_COPY)}"),
            Finding(
                logging.DEBUG,
                f"{HEAD}: compute-runtime {facts.PRODUCTION_ROUTE.name} is "
                f"{facts.PRODUCTION_ROUTE_CAVEATS}",
            ),
        ]
    return [*host_findings(decision), *said]


def _not_applied_level(role: str, decision: Decision) -> int:
    if role == "ray_worker" or (role in RANKS and decision.user_set):
        return logging.INFO  # Ray nodes can differ; say per node what each has
    if role == "main" and (decision.user_set or decision.visible_intel >= 2):
        return logging.INFO
    return logging.DEBUG


def not_applied(role: str, decision: Decision) -> list[Finding]:
    if role in RANKS and decision.user_set and not decision.host_copy:
        head = f"{HEAD}: driver variables in this worker: {shown(decision.user_set)}"
    elif decision.host_copy or decision.visible_intel >= 2:
        head = f"{HEAD} set nothing: {decision.reason}"
    elif role == "ray_worker":
        head = f"{HEAD} not needed on this node: {decision.reason}"
    else:
        head = f"{HEAD} not needed: {decision.reason}"
    return [*host_findings(decision), Finding(_not_applied_level(role, decision), head)]


def too_late(role: str, seen: Decision, late: dict[str, str], loaded: list[str]) -> list[Finding]:
    """The driver is mapped into this rank and started without ``seen.env``."""
    if late:
        what = f"{shown(late)} were set after the Intel driver started"
    else:
        what = f"the Intel driver started without {shown(seen.env)}"
    if NO_PEER in seen.env:
        lost, cause = "P2P stays on", XE_PEER_OOM
    elif seen.copy_expected:
        lost, cause = "it will pin a host copy of every device allocation", HOST_COPY
    else:
        lost, cause = "this process runs without them", ""
    pointer = f" See {see(cause)}" if cause else ""
    # Verified with Ray 2.60 and vLLM 0.32 (docs/multi-node.md, tests/test_ray.py): a Ray
    # worker process starts with the raylet's environment plus its runtime_env env_vars,
    # and Ray merges the job's env_vars into those an actor is given (vLLM 0.32's executors
    # give theirs env_vars: RayExecutorV2._build_runtime_env). vLLM's copies of the
    # driver's variables (VLLM_RAY_EXTRA_ENV_VARS_TO_COPY in the legacy executor's
    # update_environment_variables, the driver environment in
    # RayExecutorV2.initialize_worker) run after the worker has resolved the platform.
    error = (
        f"{HEAD} cannot take effect in this {role}: {what}; {lost}. Set them before the "
        f"process starts (vllm-xpu-memfix ray-env prints them).{pointer}"
    )
    return [
        *host_findings(seen),
        Finding(logging.ERROR, error),
        Finding(logging.DEBUG, f"{HEAD}: the Intel driver in this {role}: {loaded[0]}"),
        Finding(logging.DEBUG, f"{HEAD}: this {role} would need them: {seen.reason}"),
    ]


def _speaks(settings: Settings, name: str) -> bool:
    try:
        return host_lock.first_alive(settings.lock_dir, name)
    except (host_lock.LockDirError, OSError):
        return True  # said twice rather than never


def speaks_interim(settings: Settings) -> bool:
    """Whether this process, which set the key, names Intel's two positions for the host."""
    return _speaks(settings, INTERIM_SPEAKER)


def emit(role: str, settings: Settings, findings: list[Finding]) -> list[tuple[int, str]]:
    """Log ``findings``, the most serious first: each finding about the host at its level
    where this process speaks for the host on it, at DEBUG elsewhere. Returns what was said."""
    said: list[tuple[int, str]] = []
    speaking: dict[str, bool] = {}
    for finding in findings:
        level = finding.level
        if finding.host_wide is not None:
            name = f"driver_env-{finding.host_wide}"
            if name not in speaking:
                speaking[name] = _speaks(settings, name) or role == "main"
            level = level if speaking[name] else logging.DEBUG
        said.append((level, finding.text))
    said.sort(key=lambda record: -record[0])
    for level, text in said:
        log_when_configured(logger, level, text)
    return said
