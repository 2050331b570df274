"""Driver guard: keep the Intel driver from pinning a host copy of device memory.

Problem
    From compute-runtime 26.09 on (defer backing enabled for Battlemage, commit
    d793c96442), with two or more Battlemage GPUs in one Level Zero context, every
    device allocation made resident on a peer is backed there by an equal-size block
    of host memory that is committed and pinned. RSS does not show it and swap cannot
    take it. Reported in compute-runtime #953, #980 and #968 and a community note on
    4x B70; what each measured, on which stack and with which key, is in docs/fixes.md
    (driver_env). No Intel GPU here has measured this guard.
    A second failure with the same GPUs (compute-runtime #916): with 2+ Intel GPUs
    (any, A770 included) in one context, compute-runtime from 25.44 to before 26.22.38646.4 and a
    kernel before 7.1, every device allocation fails with UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
    Intel's workaround there is ``ForceZeDeviceCanAccessPerReturnValue=0``; whether
    ``EnableDeferBacking=0`` helps is not established.
    Intel says two things: its vLLM engineer recommends ``NEOReadDebugKeys=1
    EnableDeferBacking=0`` until the driver is fixed (vllm #50269); compute-runtime's
    maintainer calls debug keys debug-only and names compute-runtime 26.05 as the
    production route (compute-runtime #953, quoted in llm-scaler #618).
Mechanism
    In process 0 (the API server or the ``LLM`` process), before EngineCore and the
    workers are spawned, read from files only (sysfs, dpkg or the driver's file name,
    ``/proc/sys/kernel/osrelease``, all under the sysroot) and from the environment
    (``intel/driver_facts``), then decide, and say so (``intel/driver_records``: one
    finding per record, the most serious first):
    one Intel GPU visible, or the user's ``ForceZeDeviceCanAccessPerReturnValue=0`` or
    ``EnableDeferBacking=0`` (with ``NEOReadDebugKeys=1``): no copy, nothing set;
    2+ Battlemage visible and the runtime in the affected range (or unknown): set
    ``EnableDeferBacking=0``, and ``NEOReadDebugKeys=1`` unless the user set it to 1
    already. A key the user set to a value the driver takes is never overridden; a value
    it would not take (``maybe``) is named and treated as absent. Spawned children
    inherit what is set; each worker logs what it has. The first process on the host
    that sets the key (and no other while it lives) names Intel's two positions in a
    record of its own (``host_lock.first_alive`` in the lock directory).
    One Battlemage beside another Intel GPU: nothing is set. The copy has been reported
    only between Battlemage GPUs, and defer backing is on for Battlemage only, so a
    debug key is not applied where no report shows the copy; ``on`` applies it anyway.
    #916's condition gives an ERROR and its remedies (kernel 7.1; compute-runtime
    26.22.38646.4 or later, 26.27 on master; or ``no_peer_access``); where the runtime
    or the kernel cannot be read and the rest holds, a WARNING that it could not be ruled
    out. The plugin never turns P2P off by itself.
    Every other process first reads ``/proc/self/maps``: where Level Zero is already
    mapped, the driver has read its keys, so the guard sets nothing there and decides
    on the environment the process started with (``/proc/self/environ``): an ERROR if
    the driver started without what the guard would set. That is always the case for
    vLLM's Ray workers, which start the driver before they load plugins
    (docs/multi-node.md; ``vllm-xpu-memfix ray-env`` prints what a node needs).
Targets
    None in vLLM: the process environment at plugin registration.
Switch
    ``VLLM_XPU_MEMFIX_DRIVER_ENV``: auto (as above); on: set ``EnableDeferBacking=0``
    wherever the user has not set the keys; no_peer_access: set
    ``NEOReadDebugKeys=1 ForceZeDeviceCanAccessPerReturnValue=0`` instead, which avoids
    both the copy and #916 but costs P2P; off: never.
    ``VLLM_XPU_MEMFIX_SYSROOT`` roots the file look-ups.
Upstream
    Belongs in compute-runtime (#953, #968, #980 are open; #916 is fixed in kernel 7.1
    and worked around from 26.22.38646.4), or in Unified Runtime, which makes every
    allocation resident on every peer: intel/llvm #21889 restricted that to P2P peers, #22796
    made it opt-in (``SYCL_UR_L0_RESTRICT_USM_RESIDENCY_TO_P2P=1``, UR 2026.2.0 on).
Remove when
    A compute-runtime release no longer pins the copy; the fix lies outside vLLM, so
    ``auto`` re-decides from the installed runtime at every start.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.process import current_role, environ_at_start
from vllm_xpu_memfix.intel import driver_facts as facts
from vllm_xpu_memfix.intel import driver_records as records
from vllm_xpu_memfix.intel.driver_records import shown

if TYPE_CHECKING:
    from vllm_xpu_memfix.intel import driver

FIX = config.DRIVER_ENV
REMOVE_WHEN = RemoveWhen("compute-runtime stops pinning a host copy of device allocations")
READ, DEFER, NO_PEER = facts.READ_DEBUG_KEYS, facts.DEFER_BACKING, facts.FORCE_PEER_ACCESS
DRIVER_KEYS = (READ, DEFER, NO_PEER)
GUARD_ENV = {READ: "1", DEFER: "0"}
NO_PEER_ACCESS_ENV = {READ: "1", NO_PEER: "0"}
EVIDENCE = facts.HOST_COPY_THREADS
SPAWNERS = ("main", "engine_core")  # they start vLLM's ranks, which inherit what they set


@dataclass(frozen=True)
class Decision:
    """What the guard decides for one environment on one host, from files only.

    ``apply`` is whether it sets anything (``env``); ``reason`` says why in one clause.
    ``copy_expected`` is whether the driver would pin the host copy were nothing set (an
    unreadable runtime counts as affected; None: not decided, the guard is off);
    ``host_copy`` whether it still will once ``env`` is set. ``xe_peer_oom`` is
    compute-runtime #916's condition where it holds or could not be ruled out, for the
    environment once ``env`` is set. ``not_understood`` names each value taken as absent.
    """

    apply: bool
    reason: str
    visible_battlemage: int = 0
    runtime: driver.Runtime | None = None
    user_set: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    visible_intel: int = 0
    kernel: driver.Kernel | None = None
    copy_expected: bool | None = None
    xe_peer_oom: driver.XePeerOom | None = None
    not_understood: tuple[str, ...] = ()

    @property
    def host_copy(self) -> bool | None:
        return None if self.copy_expected is None else self.copy_expected and not self.apply


@dataclass(frozen=True)
class Host:
    """What the guard needs to know of a machine: its visible GPUs, runtime and kernel
    (read only where 2+ GPUs could share a context), and where the GPUs were looked for."""

    intel: int
    battlemage: int
    runtime: driver.Runtime | None
    kernel: driver.Kernel | None
    drm: str

    @classmethod
    def of(
        cls,
        visible: Sequence[driver.Gpu],
        runtime: Callable[[], driver.Runtime | None],
        kernel: Callable[[], driver.Kernel | None],
        drm: str,
    ) -> Host:
        # dpkg's status file costs ~10 ms: only a host with a peer to share with pays it.
        several = len(visible) >= 2
        return cls(
            len(visible),
            sum(gpu.is_battlemage for gpu in visible),
            runtime() if several else None,
            kernel() if several else None,
            drm,
        )


def read_host(settings: Settings, environ: Mapping[str, str]) -> Host:
    """This machine as the guard sees it, from files under the sysroot."""
    from vllm_xpu_memfix.intel import driver

    root = settings.sysroot
    return Host.of(
        driver.visible_gpus(driver.intel_gpus(root), environ),
        lambda: driver.compute_runtime(root),
        lambda: driver.kernel(root),
        str(root / "sys/class/drm"),
    )


def _no_copy(host: Host, keys: facts.DebugKeys) -> str | None:
    """Why there is no host copy to guard against, or None where there may be one."""
    from vllm_xpu_memfix.intel import driver

    why = driver.why_no_host_copy(host.intel, host.battlemage, host.runtime, keys, host.drm)
    if (
        why is not None
        and host.intel >= 2
        and host.battlemage < 2
        and keys.host_copy_prevented_by is None
    ):
        why += f"; {FIX.env}=on sets the key anyway"
    return why


def _copy_expected(host: Host) -> str:
    others = host.intel - host.battlemage
    beside = f" (and {others} other Intel GPU(s))" if others else ""
    version = host.runtime.version if host.runtime else "unknown (taken as affected)"
    return f"{host.battlemage} Battlemage GPUs visible{beside}, compute-runtime {version}"


def _keys_to_set(
    key: str, keys: facts.DebugKeys, environ: Mapping[str, str]
) -> tuple[dict[str, str], str]:
    """What to set so the driver reads ``key=0``, and what to add to the reason; nothing
    where the user gave ``NEOReadDebugKeys`` or ``key`` a value the driver takes."""
    given = keys.values
    if given.get(READ, 1) != 1 or given.get(key, 0) != 0:
        blocker = READ if given.get(READ, 1) != 1 else key
        return {}, f"; {blocker}={environ[blocker]} set by the user is left as it is"
    env = {} if keys.read else {READ: "1"}
    notes = []
    if given.get(key) == 0:
        notes.append(f"{key}=0 was set without {READ}=1, without which the driver ignores it")
    else:
        env[key] = "0"
    if key != NO_PEER and given.get(NO_PEER) == 0 and not keys.read:
        notes.append(f"{READ}=1 also makes the driver read {NO_PEER}=0 set here (no P2P)")
    return env, "".join(f"; {note}" for note in notes)


def _choose(
    mode: Mode, host: Host, keys: facts.DebugKeys, environ: Mapping[str, str]
) -> tuple[dict[str, str], str, bool]:
    """What to set, why, and whether the driver would pin the copy without it."""
    no_copy = _no_copy(host, keys)
    if mode is Mode.NO_PEER_ACCESS and not keys.peer_access_off:
        env, note = _keys_to_set(NO_PEER, keys, environ)
        return env, f"{FIX.env}=no_peer_access{note}", no_copy is None
    if mode is Mode.ON and keys.host_copy_prevented_by is None:
        env, note = _keys_to_set(DEFER, keys, environ)
        return env, f"{FIX.env}=on{note}", no_copy is None
    if no_copy is not None:
        return {}, no_copy, False
    env, note = _keys_to_set(DEFER, keys, environ)
    return env, f"{_copy_expected(host)}{note}", True


def decide(settings: Settings, environ: Mapping[str, str]) -> Decision:
    """What the guard sets in ``environ`` and why; reads files only, changes nothing."""
    return decide_for(settings, environ, lambda: read_host(settings, environ))


def decide_for(
    settings: Settings, environ: Mapping[str, str], host_of: Callable[[], Host]
) -> Decision:
    """:func:`decide` on a machine given as a :class:`Host` (``doctor --host``: a described
    one); ``host_of`` is asked only where the switch lets the guard look."""
    from vllm_xpu_memfix.intel import driver

    keys = facts.debug_keys(environ)
    user_set = {k: environ[k] for k in DRIVER_KEYS if k in environ}
    mode = settings.mode(FIX)
    if not settings.enabled:
        return Decision(False, f"{config.MASTER.name}=0 (the plugin is off)", user_set=user_set)
    if mode is Mode.OFF:
        return Decision(False, f"{FIX.env}=off", user_set=user_set)
    host = host_of()
    env, reason, copy_without = _choose(mode, host, keys, environ)
    peer_access_off = facts.debug_keys({**environ, **env}).peer_access_off
    kernel_problem = (host.kernel.problem,) if host.kernel and host.kernel.problem else ()
    return Decision(
        apply=bool(env),
        reason=reason,
        visible_battlemage=host.battlemage,
        runtime=host.runtime,
        user_set=user_set,
        env=env,
        visible_intel=host.intel,
        kernel=host.kernel,
        copy_expected=copy_without,
        xe_peer_oom=driver.xe_peer_oom(host.intel, host.runtime, host.kernel, peer_access_off),
        not_understood=keys.not_understood + kernel_problem,
    )


def xe_peer_oom_lines(oom: driver.XePeerOom) -> list[str]:
    """compute-runtime #916: the failure and whether it is certain; then the remedies."""
    where = (
        f"{oom.intel_gpus} Intel GPUs in one context, compute-runtime {oom.runtime}, "
        f"kernel {oom.kernel}"
    )
    if oom.certain:
        head = f"WARNING {facts.XE_PEER_OOM_THREAD}: {where}: {facts.XE_PEER_OOM_FAILURE}"
    else:
        head = (
            f"{facts.XE_PEER_OOM_THREAD} could not be ruled out ({where}; unknown: "
            f"{' and '.join(oom.unknown)}): if it holds, {facts.XE_PEER_OOM_FAILURE}"
        )
    kernel = ".".join(map(str, facts.KERNEL_FIXED))
    return [
        f"{head}; no report shows {DEFER}=0 helping",
        f"Remedies: kernel {kernel} or later; "
        f"compute-runtime {facts.XE_PEER_OOM_FIXED.tag} or later "
        f"({facts.XE_PEER_OOM_FIXED_ON_MASTER.name} on master); or {FIX.env}=no_peer_access "
        f"({shown(NO_PEER_ACCESS_ENV)}), which costs P2P: {facts.NO_PEER_ACCESS_COST}",
    ]


def xe_peer_oom_warning(oom: driver.XePeerOom) -> str:
    """:func:`xe_peer_oom_lines` as one text."""
    return ". ".join(xe_peer_oom_lines(oom))


def remarks(decision: Decision) -> list[str]:
    """What the decision's lines add to it, one finding each: the pinned copy, #916 and
    its remedies, values not understood."""
    remarks = []
    if decision.host_copy:
        remarks.append(
            f"The driver will pin a host copy of every device allocation here ({EVIDENCE})"
        )
    if decision.xe_peer_oom is not None:
        remarks += xe_peer_oom_lines(decision.xe_peer_oom)
    if decision.not_understood:
        remarks.append(f"Not understood, taken as absent: {'; '.join(decision.not_understood)}")
    return remarks


def summary_lines(decision: Decision) -> list[str]:
    """The decision, then each of its :func:`remarks`: what ``check`` and ``doctor`` print,
    a line each."""
    what = f"sets {shown(decision.env)}" if decision.apply else "sets nothing"
    return [f"{what}: {decision.reason}", *remarks(decision)]


def summary(decision: Decision) -> str:
    """:func:`summary_lines` as one text (doctor's JSON)."""
    return ". ".join(summary_lines(decision))


def without_guard(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as it would be had nobody set the driver keys."""
    return {k: v for k, v in environ.items() if k not in DRIVER_KEYS}


def apply(decision: Decision, environ: MutableMapping[str, str]) -> None:
    environ.update(decision.env)


def patches(_settings: Settings) -> tuple[Patch, ...]:
    return ()  # acts on the process environment at registration


def install(_patcher: Patcher, settings: Settings) -> None:
    """Decide and set in every process where the driver can still read the keys.

    Process 0 sets them before EngineCore and the workers are spawned, so they
    inherit them. A rank that did not inherit them sets them itself, but only if
    Level Zero is not mapped into it yet: the driver reads them once, when it
    starts. A vLLM worker on Ray registers the plugin after it has resolved
    vLLM's platform, which on XPU starts the driver (0.32: the actor's module
    imports ``vllm.platforms.current_platform``; ``load_general_plugins`` runs in
    ``init_worker``); there the guard can only say so.
    """
    from vllm_xpu_memfix.intel import driver

    role = current_role().role
    loaded = driver.loaded_driver_libraries()
    if loaded and role not in SPAWNERS:
        _report_too_late(role, settings, loaded)
        return
    decision = decide(settings, os.environ)
    apply(decision, os.environ)
    if decision.apply:
        interim = DEFER in decision.env and records.speaks_interim(settings)
        said = records.applied(role, decision, loaded, interim)
    else:
        said = records.not_applied(role, decision)
    records.emit(role, settings, said)


def _report_too_late(role: str, settings: Settings, loaded: list[str]) -> None:
    """The driver is mapped into this rank: set nothing, and judge what the driver saw when
    it started (the environment this process started with)."""
    from vllm_xpu_memfix.intel import driver

    at_start = environ_at_start()
    started_with = dict(os.environ) if at_start is None else at_start
    seen = decide(settings, started_with)
    if not seen.apply:
        records.emit(role, settings, records.not_applied(role, seen))
        return
    # What was not set cannot avoid compute-runtime #916 either.
    oom = driver.xe_peer_oom(
        seen.visible_intel,
        seen.runtime,
        seen.kernel,
        facts.debug_keys(started_with).peer_access_off,
    )
    seen = replace(seen, xe_peer_oom=oom)
    late = {
        k: v for k, v in seen.env.items() if os.environ.get(k) == v and started_with.get(k) != v
    }
    records.emit(role, settings, records.too_late(role, seen, late, loaded))
