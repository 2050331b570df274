"""A start-up on vLLM's CPU backend, judged in its own terms: the weights and the KV cache
are host memory (vLLM 0.32's CPU platform sizes the KV cache from
``VLLM_CPU_KVCACHE_SPACE`` into ``cache_config.kv_cache_memory_bytes``, per worker).
Neither the XPU per-rank baseline nor any driver cost applies. What the weights and the KV
cache take is certain, and only that can make the verdict "will run out of memory"; the
processes' own memory (Python, torch, vLLM: API server, EngineCore, each worker) comes on
top, an estimate from the test bed, so it can make the verdict "at risk" and is in each
phase's figure, as the measurement at ready includes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.startup import codes
from vllm_xpu_memfix.startup.phases import AT_RISK_SHARE

# The processes' own host memory on vLLM 0.32's CPU backend (anonymous PSS), from the ledger
# of one demo start (benchmarks/results/process-baseline-2026-12-05.md): 1,287 MiB for the
# API server, EngineCore and one worker at ready less the KV cache, of which the worker's
# own RssAnon less the KV cache was 430 MiB (1,454 - 1,024).
SHARED_PROCESSES = 857 * 2**20
PER_WORKER = 430 * 2**20
# What each phase's host figure counts, for the line at ready.
INCLUDES = "weights + KV cache + the processes (estimated)"


def processes(workers: int) -> float:
    """The vLLM processes' own host memory with ``workers`` workers (an estimate)."""
    return float(SHARED_PROCESSES + PER_WORKER * max(1, workers))


@dataclass(frozen=True)
class CpuOutcome:
    """The verdict, the phase it fails at (None where it fits), and the line's words."""

    verdict: str
    phase: str | None
    why: str
    remedy: str
    # Each phase's need, in the shape of the XPU judgement's JSON (no device here).
    gib: dict[str, Any] = field(default_factory=dict)


def judge(weights: float, kv_cache: float, room: Room, workers: int = 1) -> CpuOutcome | None:
    """``weights`` and ``kv_cache`` (every worker's) against the room; None where the room
    could not be read (the host is then not judged)."""
    space = room.bytes
    if space is None:
        return None
    own = processes(workers)
    phases = ((codes.LOAD, weights), (codes.KV_CACHE, weights + kv_cache))
    gib = {
        "phases": {
            p: {"host_gib": round((n + own) / 2**30, 2), "device_gib": None} for p, n in phases
        },
        "host_includes": INCLUDES,
    }
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
    need = weights + kv_cache + own
    verdict = codes.AT_RISK if need > AT_RISK_SHARE * space else codes.FITS
    sizes += f" + the processes about {own / 2**30:,.1f} GiB"
    return CpuOutcome(verdict, None, f"{sizes}, {of_room}", "", gib)
