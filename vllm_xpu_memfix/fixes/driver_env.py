"""Driver guard: stop the Intel driver from pinning a host mirror of device memory.

Problem
    From compute-runtime 26.09 on, with two or more Battlemage GPUs in one
    Level Zero context, every device allocation also pins an equal-size block
    of host memory (GTT) through peer residency. RSS does not show it and swap
    cannot take it. 4 x 0.92 x 31.89 GiB = 117 GiB is llm-scaler #703's
    ">120 GB spike" at KV-cache allocation; compute-runtime #968 measured
    55.12 GiB falling to 1.55 GiB once it was avoided. Intel's answer in vllm
    #50269 and compute-runtime #953 is ``NEOReadDebugKeys=1 EnableDeferBacking=0``.
Mechanism
    In process 0 (the API server or the ``LLM`` process), before EngineCore and
    the workers are spawned, count the visible Battlemage GPUs from sysfs and
    read the compute-runtime version from dpkg or the driver's file name,
    without loading the driver. If at least two are visible and the runtime is
    in the affected range (or its version cannot be read), set both variables
    in ``os.environ``; spawned children inherit them. Variables the user set
    are respected. Each worker logs whether the variables arrived.
    Every other process first reads ``/proc/self/maps``: where Level Zero's
    driver or loader is already mapped, the driver has read its settings, so
    the guard sets nothing there and, if the variables were missing when the
    process started (``/proc/self/environ``), logs an ERROR: this process will
    pin the mirror, and how to give the variables to it before it starts. That
    is always the case for vLLM's Ray workers, which start the driver before
    they load plugins (docs/multi-node.md).
Targets
    None in vLLM: the process environment at plugin registration.
Switch
    ``VLLM_XPU_MEMFIX_DRIVER_ENV`` (auto: when the conditions above hold; on:
    whenever the user has not set the variables; off: never).
    ``VLLM_XPU_MEMFIX_SYSROOT`` roots the sysfs/dpkg/library look-ups.
Upstream
    Belongs in compute-runtime (#953, #968, #980 are open). Until then, a
    launcher-side default that vLLM's XPU platform could also apply.
Remove when
    A compute-runtime release no longer pins the mirror; the fix lies outside
    vLLM, so ``auto`` re-decides from the installed runtime at every start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.process import current_role, environ_at_start

if TYPE_CHECKING:
    from vllm_xpu_memfix.intel import driver

logger = get_logger("driver_env")

FIX = config.DRIVER_ENV
REMOVE_WHEN = RemoveWhen("compute-runtime stops pinning a host mirror of device allocations")
GUARD_ENV = {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}
EVIDENCE = "vllm #50269, compute-runtime #953 and #968"
SPAWNERS = ("main", "engine_core")  # they start vLLM's ranks, which inherit what they set
RANKS = ("worker", "ray_worker")
# Verified with Ray 2.60 and vLLM 0.32 (docs/multi-node.md, tests/test_ray.py): a Ray
# worker process starts with the raylet's environment plus its runtime_env env_vars,
# and Ray merges the job's env_vars into those an actor is given (vLLM 0.32's executors
# give theirs env_vars: RayExecutorV2._build_runtime_env). vLLM's copies of the
# driver's variables (VLLM_RAY_EXTRA_ENV_VARS_TO_COPY in the legacy executor's
# update_environment_variables, the driver environment in
# RayExecutorV2.initialize_worker) run after the worker has resolved the platform.
FIX_BEFORE_START = (
    "the variables must be in the environment the process starts with. On Ray: "
    "`export NEOReadDebugKeys=1 EnableDeferBacking=0` on every node before `ray start`, or "
    "put them in the Ray job's runtime_env env_vars (ray.init(runtime_env={'env_vars': "
    "{'NEOReadDebugKeys': '1', 'EnableDeferBacking': '0'}}) before the engine is created); "
    "`vllm-xpu-memfix ray-env` prints both. vLLM's copying of variables to Ray workers "
    "(VLLM_RAY_EXTRA_ENV_VARS_TO_COPY, the driver's environment) comes too late"
)


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    visible_battlemage: int = 0
    runtime: driver.Runtime | None = None
    user_set: dict[str, str] = field(default_factory=dict)


def decide(settings: Settings, environ: Mapping[str, str]) -> Decision:
    """Whether to set the guard variables, and why; reads files only."""
    from vllm_xpu_memfix.intel import driver

    user_set = {k: environ[k] for k in GUARD_ENV if k in environ}
    mode = settings.mode(FIX)
    if mode is Mode.OFF or not settings.enabled:
        return Decision(False, f"{FIX.env}=off", user_set=user_set)
    intel = driver.intel_gpus(settings.sysroot)
    gpus = driver.visible_gpus(intel, environ)
    bmg = sum(gpu.is_battlemage for gpu in gpus)
    # Reading dpkg's status file costs ~10 ms; only a host that could be affected pays it.
    runtime = driver.compute_runtime(settings.sysroot) if bmg >= 2 else None
    version = runtime.version if runtime else "unknown"

    if user_set:
        shown = " ".join(f"{k}={v}" for k, v in user_set.items())
        apply, reason = False, f"respecting {shown} already set"
    elif mode is Mode.ON:
        apply, reason = True, f"{FIX.env}=on"
    elif not intel:
        drm = settings.sysroot / "sys/class/drm"
        apply, reason = False, f"no Intel GPU under {drm}; the mirror needs 2 or more Battlemage"
    elif bmg < 2:
        apply, reason = False, f"{bmg} Battlemage GPU(s) visible; the mirror needs 2 or more"
    elif runtime is not None and not runtime.pins_host_copy:
        apply, reason = False, f"compute-runtime {version} is outside the affected range"
    else:
        apply, reason = True, f"{bmg} Battlemage GPUs visible, compute-runtime {version}"
    return Decision(apply, reason, bmg, runtime, user_set)


def without_guard(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as it would be had nobody set the guard variables."""
    return {k: v for k, v in environ.items() if k not in GUARD_ENV}


def apply(decision: Decision, environ: MutableMapping[str, str]) -> None:
    if decision.apply:
        environ.update(GUARD_ENV)


def patches(_settings: Settings) -> tuple[Patch, ...]:
    return ()  # acts on the process environment at registration


def install(_patcher: Patcher, settings: Settings) -> None:
    """Decide and set in every process where the driver can still read the variables.

    Process 0 sets them before EngineCore and the workers are spawned, so they
    inherit them. A rank that did not inherit them sets them itself, but only if
    Level Zero is not mapped into it yet: the driver reads them once, when it
    starts. A vLLM worker on Ray registers the plugin after it has resolved
    vLLM's platform, which on XPU starts the driver (0.32: the actor's module
    imports ``vllm.platforms.current_platform``; ``load_general_plugins`` runs in
    ``init_worker``); there the guard can only say so.
    """
    from vllm_xpu_memfix.intel import driver

    role = current_role()
    decision = decide(settings, os.environ)
    loaded = driver.loaded_driver_libraries()
    if loaded and role.role not in SPAWNERS:
        _report_too_late(role.role, settings, decision, loaded)
        return
    apply(decision, os.environ)
    if decision.apply:
        log = logger.warning if role.role in ("main", "worker", "ray_worker") else logger.info
        log(
            "vllm-xpu-memfix: set NEOReadDebugKeys=1 EnableDeferBacking=0 in this %s (%s). "
            "Without them the Intel driver pins a host copy of every device allocation on "
            "multi-GPU Battlemage (%s). Opt out: %s=off%s",
            "vLLM" if role.role == "main" else "process, which did not inherit them",
            decision.reason,
            EVIDENCE,
            FIX.env,
            f". The Intel driver is already loaded here ({loaded[0]}), so they take effect in "
            "the processes this one spawns, not in this one nor in Ray workers (docs/multi-node.md)"
            if loaded
            else "",
        )
    else:
        _report_not_applied(role.role, decision)


def _report_not_applied(role: str, decision: Decision) -> None:
    if role in RANKS and decision.user_set:
        shown = " ".join(f"{k}={v}" for k, v in decision.user_set.items())
        logger.info("vllm-xpu-memfix: driver variables in this worker: %s", shown)
    elif decision.user_set and role == "main":
        logger.info("vllm-xpu-memfix: driver guard: %s", decision.reason)
    elif role == "ray_worker":
        # Ray nodes can differ; say per node why nothing was needed.
        logger.info("vllm-xpu-memfix: driver guard not needed on this node: %s", decision.reason)
    else:
        logger.debug("vllm-xpu-memfix: driver guard not needed: %s", decision.reason)


def _report_too_late(role: str, settings: Settings, decision: Decision, loaded: list[str]) -> None:
    """The driver is mapped into this rank: set nothing, and say whether that costs the mirror."""
    needed = decide(settings, without_guard(os.environ))
    at_start = environ_at_start()
    late = {
        k: v for k, v in decision.user_set.items() if at_start is not None and at_start.get(k) != v
    }
    if needed.apply and (decision.apply or late):
        if late:
            shown = " ".join(f"{k}={v}" for k, v in late.items())
            what = (
                f"{shown} were set in this process after it started (on Ray: vLLM copies the "
                "driver's environment into its workers then), when the Intel GPU driver was "
                f"already loaded ({loaded[0]})"
            )
        else:
            what = (
                f"the Intel GPU driver is already loaded ({loaded[0]}) and NEOReadDebugKeys=1 "
                "EnableDeferBacking=0 were not in this process's environment when it started"
            )
        logger.error(
            "vllm-xpu-memfix: driver guard cannot take effect in this %s process: %s; the "
            "driver reads them only when it starts. The host mirror of every device "
            "allocation will be pinned in this process (%s; %s). Nothing was set. Fix: %s",
            role,
            what,
            needed.reason,
            EVIDENCE,
            FIX_BEFORE_START,
        )
    else:
        _report_not_applied(role, decision)
