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

from vllm_xpu_memfix import config
from vllm_xpu_memfix.config import Mode, Settings
from vllm_xpu_memfix.log import get_logger
from vllm_xpu_memfix.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.process import current_role

if TYPE_CHECKING:  # imported where used: registration must stay cheap
    from vllm_xpu_memfix import driver

logger = get_logger("driver_env")

FIX = config.DRIVER_ENV
REMOVE_WHEN = RemoveWhen("compute-runtime stops pinning a host mirror of device allocations")
GUARD_ENV = {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}
EVIDENCE = "vllm #50269, compute-runtime #953 and #968"


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    visible_battlemage: int = 0
    runtime: driver.Runtime | None = None
    user_set: dict[str, str] = field(default_factory=dict)


def decide(settings: Settings, environ: Mapping[str, str]) -> Decision:
    """Whether to set the guard variables, and why; reads files only."""
    from vllm_xpu_memfix import driver

    user_set = {k: environ[k] for k in GUARD_ENV if k in environ}
    mode = settings.mode(FIX)
    if mode is Mode.OFF or not settings.enabled:
        return Decision(False, f"{FIX.env}=off", user_set=user_set)
    gpus = driver.visible_gpus(driver.intel_gpus(settings.sysroot), environ)
    bmg = sum(gpu.is_battlemage for gpu in gpus)
    # Reading dpkg's status file costs ~10 ms; only a host that could be affected pays it.
    runtime = driver.compute_runtime(settings.sysroot) if bmg >= 2 else None
    version = runtime.version if runtime else "unknown"

    if user_set:
        shown = " ".join(f"{k}={v}" for k, v in user_set.items())
        apply, reason = False, f"respecting {shown} already set"
    elif mode is Mode.ON:
        apply, reason = True, f"{FIX.env}=on"
    elif bmg < 2:
        apply, reason = False, f"{bmg} Battlemage GPU(s) visible; the mirror needs 2 or more"
    elif runtime is not None and not runtime.affected:
        apply, reason = False, f"compute-runtime {version} is outside the affected range"
    else:
        apply, reason = True, f"{bmg} Battlemage GPUs visible, compute-runtime {version}"
    return Decision(apply, reason, bmg, runtime, user_set)


def apply(decision: Decision, environ: MutableMapping[str, str]) -> None:
    if decision.apply:
        environ.update(GUARD_ENV)


def patches(_settings: Settings) -> tuple[Patch, ...]:
    return ()  # acts on the process environment at registration


def install(_patcher: Patcher, settings: Settings) -> None:
    """Decide and set in every process, before any of them starts the driver.

    Process 0 sets the variables before EngineCore and the workers are spawned,
    so they inherit them. A worker that did not inherit them (Ray on another
    node) sets them itself: its plugin loads before the worker starts Level Zero.
    """
    role = current_role().role
    decision = decide(settings, os.environ)
    apply(decision, os.environ)
    if decision.apply:
        log = logger.warning if role in ("main", "worker") else logger.info
        log(
            "vllm-xpu-memfix: set NEOReadDebugKeys=1 EnableDeferBacking=0 in this %s (%s). "
            "Without them the Intel driver pins a host copy of every device allocation on "
            "multi-GPU Battlemage (%s). Opt out: %s=off",
            "vLLM" if role == "main" else "process, which did not inherit them",
            decision.reason,
            EVIDENCE,
            FIX.env,
        )
    elif role == "worker" and decision.user_set:
        shown = " ".join(f"{k}={v}" for k, v in decision.user_set.items())
        logger.info("vllm-xpu-memfix: driver variables in this worker: %s", shown)
    elif decision.user_set and role == "main":
        logger.info("vllm-xpu-memfix: driver guard: %s", decision.reason)
    else:
        logger.debug("vllm-xpu-memfix: driver guard not needed: %s", decision.reason)
