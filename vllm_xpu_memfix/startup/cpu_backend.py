"""A start-up on vLLM's CPU backend, judged in its own terms: the weights and the KV cache
are host memory (vLLM 0.32's CPU platform sizes the KV cache from
``VLLM_CPU_KVCACHE_SPACE`` into ``cache_config.kv_cache_memory_bytes``, per worker).
Neither the XPU per-rank baseline nor any driver cost applies, so the need here is a floor:
what it counts is certain to be taken, and the processes themselves come on top."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.startup import codes
from vllm_xpu_memfix.startup.phases import AT_RISK_SHARE


@dataclass(frozen=True)
class CpuOutcome:
    """The verdict, the phase it fails at (None where it fits), and the line's words."""

    verdict: str
    phase: str | None
    why: str
    remedy: str
    # Each phase's need, in the shape of the XPU judgement's JSON (no device here).
    gib: dict[str, Any] = field(default_factory=dict)


def judge(weights: float, kv_cache: float, room: Room) -> CpuOutcome | None:
    """``weights`` and ``kv_cache`` (every worker's) against the room; None where the room
    could not be read (the host is then not judged)."""
    space = room.bytes
    if space is None:
        return None
    phases = ((codes.LOAD, weights), (codes.KV_CACHE, weights + kv_cache))
    gib = {"phases": {p: {"host_gib": round(n / 2**30, 2), "device_gib": None} for p, n in phases}}
    sizes = f"weights {weights / 2**30:,.1f} GiB + KV cache {kv_cache / 2**30:,.1f} GiB"
    of_room = f"of the host's room {space / 2**30:,.1f} GiB"
    limited = room.cgroup.room is not None and room.cgroup.room <= (room.mem_available or 0)
    for phase, need in phases:
        if need > space:
            remedy = (
                "a smaller VLLM_CPU_KVCACHE_SPACE"
                if phase == codes.KV_CACHE
                else codes.CONTAINER_LIMIT
                if limited
                else codes.MORE_HOST_RAM
            )
            return CpuOutcome(codes.RUNS_OUT, phase, f"{sizes} above {of_room}", remedy, gib)
    verdict = codes.AT_RISK if weights + kv_cache > AT_RISK_SHARE * space else codes.FITS
    return CpuOutcome(verdict, None, f"{sizes}, {of_room}", "", gib)
