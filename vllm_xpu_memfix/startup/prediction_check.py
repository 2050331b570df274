"""The preflight's prediction held against what the start-up measured, once vLLM is ready.

The preflight (``fixes/preflight``) hands its verdict here (:func:`keep`): each phase's need
from the verdict's JSON (the XPU start-up model's phases, or the CPU backend's weights and
KV cache); unless ``VLLM_XPU_MEMFIX_LEDGER_DIR`` is ``off``, it is also a ``preflight`` ledger
row.
When the API server has its engine (``build_and_serve``, called by ``run_server_worker``
once ``build_async_engine_client`` has started the engine: weights loaded, KV cache
allocated, warm-up done; before the HTTP server listens), one INFO line puts the predicted host need
(the largest phase's) beside the host memory measured then: the vLLM tree's anonymous +
shmem PSS plus the rise of the memory GPU drivers hold (``GPUActive``) since the preflight,
as a ratio; and the device where this start-up's worker rows read it (DRM
``drm-total-vram``; rows carry their start-up, ``core.process.start_identity``).
The API server's ``ready`` ledger row keeps the figures; ``vllm-xpu-memfix report`` shows
them. Measured at ready, not over the start: a transient peak while loading is not in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patch
from vllm_xpu_memfix.core.process import start_identity
from vllm_xpu_memfix.core.units import GiB, MiB
from vllm_xpu_memfix.memory import ledger_files

logger = get_logger("prediction_check")

PREDICTED = "preflight"
READY = "ready"
# The API server calls build_and_serve once, when its engine is up, before it serves. It is
# defined in vllm/entrypoints/openai/api_server.py in 0.26.0 to 0.28.0 and in
# vllm/entrypoints/launchers/api_server/entry.py from 0.29.0 (the old module re-exports it
# there); read in each release's wheel (docs/compat.md, tests/data/ready_hook.json).
READY_TARGETS = (
    "vllm.entrypoints.launchers.api_server.entry:build_and_serve",
    "vllm.entrypoints.openai.api_server:build_and_serve",
)
# Ledger rows read back for the device figure: a start's few workers write a few KiB each.
LEDGER_CAP = 4 * MiB


@dataclass(frozen=True)
class Prediction:
    verdict: str
    host_bytes: float
    device_bytes: float | None  # a rank's, where the device was judged
    gpu_active: int | None  # the GPU drivers' host memory when the preflight ran
    started: float
    host_includes: str = ""  # what the predicted host figure counts, in words


_KEPT: list[Prediction] = []  # this process's last preflight prediction


def _ledger(settings: Settings, tree_pss: int | None = None) -> Any:
    from vllm_xpu_memfix.core.process import current_role
    from vllm_xpu_memfix.memory.ledger import Ledger

    return Ledger(str(current_role()), settings.ledger_dir, tree_anon_pss=lambda: tree_pss)


def keep(settings: Settings, verdict: Any, line: str) -> None:
    """Keep the preflight verdict's prediction for :func:`patch`'s line (never raises)."""
    try:
        _KEPT[:] = (
            [] if verdict.json.get("phases") is None else [_predicted(settings, verdict, line)]
        )
    except Exception as exc:  # never into vLLM
        logger.debug("vllm-xpu-memfix: no prediction kept (internal error: %r)", exc)


def _predicted(settings: Settings, verdict: Any, line: str) -> Prediction:
    from vllm_xpu_memfix.memory.snapshot import ProcReader

    phases = {
        name: (p["host_gib"] * GiB, None if p["device_gib"] is None else p["device_gib"] * GiB)
        for name, p in verdict.json["phases"].items()
    }
    devices = [device for _, device in phases.values() if device is not None]
    prediction = Prediction(
        verdict.verdict,
        max(host for host, _ in phases.values()),
        max(devices) if devices else None,
        ProcReader(settings.sysroot).take("self", pss=False).gpu_active,
        time.time(),
        str(verdict.json.get("host_includes") or ""),
    )
    if settings.ledger_dir is not None:
        _ledger(settings).record(
            PREDICTED,
            verdict=verdict.verdict,
            predicted_host=round(prediction.host_bytes),
            predicted_device=_rounded(prediction.device_bytes),
            predicted_phases={
                name: {"host": round(host), "device": _rounded(device)}
                for name, (host, device) in phases.items()
            },
            line=line,
        )
    return prediction


def patches(fix: str, settings: Settings) -> tuple[Patch, ...]:
    """The ready point's patches, one per place a release line has it: the line, once per
    prediction, before vLLM serves."""

    def at_ready_hook(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        if _KEPT:
            try:
                logger.info("%s", at_ready(settings, _KEPT.pop()))
            except Exception as exc:  # never into vLLM
                logger.debug("vllm-xpu-memfix: no ready line (internal error: %r)", exc)
        return wrapped(*args, **kwargs)

    return tuple(
        Patch(fix, target, at_ready_hook, once=True, optional=True, group=READY)
        for target in READY_TARGETS
    )


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


def workers_vram(directory: Path | None, start: str) -> int | None:
    """The largest device memory one process of start-up ``start`` held (DRM
    ``drm-total-vram`` of its ledger rows: another server's sharing the directory are not
    this one's); None where no row reads it."""
    if directory is None:
        return None
    largest = None
    for row in ledger_files.read(directory, LEDGER_CAP).rows:
        vram = row.get("drm_total_vram")
        if isinstance(vram, int) and row.get("start") == start:
            largest = max(largest or 0, vram)
    return largest


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}x" if predicted > 0 else "n/a"


def at_ready(settings: Settings, prediction: Prediction) -> str:
    """Measure, keep a ``ready`` ledger row, and return the line."""
    from vllm_xpu_memfix.memory.snapshot import ProcReader
    from vllm_xpu_memfix.memory.tree import tree_anon_pss

    tree = tree_anon_pss()
    now = ProcReader(settings.sysroot).take("self", pss=False).gpu_active
    held = None
    if now is not None and prediction.gpu_active is not None:
        held = max(0, now - prediction.gpu_active)
    measured = None if tree is None else tree + (held or 0)
    vram = workers_vram(settings.ledger_dir, start_identity())
    host = f"host: predicted {prediction.host_bytes / GiB:,.2f} GiB"
    if prediction.host_includes:
        host += f" ({prediction.host_includes})"
    if measured is None:
        host += ", measured n/a (the vLLM tree's PSS could not be read)"
    else:
        what = "vLLM tree's anon PSS" + (" + GPUActive rise" if held is not None else "")
        host += (
            f", measured {measured / GiB:,.2f} GiB ({what}): "
            f"{_ratio(measured, prediction.host_bytes)}"
        )
    device = ""
    if prediction.device_bytes is not None:
        device = f"; device a rank: predicted {prediction.device_bytes / GiB:,.2f} GiB"
        if vram is not None:
            device += f", measured {vram / GiB:,.2f}: {_ratio(vram, prediction.device_bytes)}"
    line = f"vllm-xpu-memfix: ready; preflight ({prediction.verdict}) vs measured, {host}{device}"
    if settings.ledger_dir is not None:
        _ledger(settings, tree).record(
            READY,
            predicted_host=round(prediction.host_bytes),
            measured_host=measured,
            gpu_active_rise=held,
            predicted_device=None
            if prediction.device_bytes is None
            else round(prediction.device_bytes),
            measured_device=vram,
            line=line,
        )
    return line
