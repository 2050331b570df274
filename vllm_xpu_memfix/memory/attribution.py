"""Which cause explains host-memory growth between two snapshots. Pure functions.

The causes are those of the project's root-cause notes: a driver-pinned host
mirror of device memory (cause 1) shows as MemAvailable falling with no process
owning the memory; weight staging, allocator retention and live references
(causes 2, 4, 5) show as anonymous memory of the process; checkpoint page cache
and mmap (cause 3) show as file pages.

Before a cause is named, the parts the ledger knows are taken out of the process's
anonymous growth: vLLM's KV cache where it lives in host memory (vLLM's CPU backend,
at vLLM's own byte figure) and the model's weights held in host memory. Only what
remains is blamed on staging, retention or references. On vLLM's CPU backend no GPU
driver can pin a mirror, so memory outside the vLLM processes is not blamed on one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.snapshot import Snapshot

# Growth below this is treated as noise on a busy host.
SIGNIFICANT = 128 * MiB

CAUSES = {
    "outside": "memory outside any process: the driver's pinned host mirror of device "
    "memory (cause 1); check drm-total-gtt / nr_gpu_active and VLLM_XPU_MEMFIX_DRIVER_ENV",
    "anon": "anonymous memory of this process beyond the parts the ledger knows: weight "
    "staging, allocator retention or live references (causes 2, 4, 5)",
    "outside_no_gpu": "memory outside the vLLM processes: other processes on the host or the "
    "kernel (vLLM's CPU backend: no GPU driver to pin a mirror)",
    "file": "file pages: checkpoint page cache or mmap (cause 3)",
    "none": "no significant host-memory growth",
    "known": "the parts the ledger knows; nothing significant is unexplained",
}


def _change(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def _delta(before: int | None, after: int | None) -> int:
    return _change(before, after) or 0


@dataclass(frozen=True)
class Outside:
    """Memory the system lost that no process of the tree maps, between two moments."""

    mem_available_drop: int | None
    tree_anon_pss_growth: int | None
    outside_processes: int | None


def outside_any_process(
    mem_available_start: int | None,
    mem_available_end: int | None,
    tree_anon_pss_start: int | None,
    tree_anon_pss_end: int | None,
) -> Outside:
    """Memory outside any process: the MemAvailable drop minus the growth of the
    process tree's anonymous + shmem PSS, i.e. memory the system lost that no process
    of the tree maps. File pages are left out on both sides, since MemAvailable counts page
    cache as available. Other processes on the host add noise. ``None`` where a figure
    is unknown.
    """
    drop = _change(mem_available_end, mem_available_start)
    growth = _change(tree_anon_pss_start, tree_anon_pss_end)
    outside = None if drop is None or growth is None else drop - growth
    return Outside(drop, growth, outside)


@dataclass(frozen=True)
class Attribution:
    anon: int
    file: int
    page_cache: int
    tree_anon_pss: int | None
    mem_available_drop: int | None
    outside_processes: int | None
    drm_gtt: int
    cause: str
    # Parts of the anonymous growth with a known owner, e.g. {"KV cache": bytes}.
    known: Mapping[str, int] = field(default_factory=dict)

    @property
    def unexplained_anon(self) -> int:
        """Anonymous growth that no known part accounts for."""
        return self.anon - sum(self.known.values())

    @property
    def explanation(self) -> str:
        return CAUSES[self.cause]


def attribute(
    start: Snapshot,
    end: Snapshot,
    tree_anon_pss_start: int | None,
    tree_anon_pss_end: int | None,
    known: Mapping[str, int] | None = None,
    cpu_backend: bool = False,
) -> Attribution:
    """Split host growth from ``start`` to ``end`` and name the largest part's cause.

    The vLLM process tree's share is given by its anonymous + shmem PSS at both ends;
    see :func:`outside_any_process`. ``known`` names parts of this process's anonymous
    growth whose owner the ledger recorded; they are taken out before a cause is named.
    ``cpu_backend``: the worker runs on vLLM's CPU backend, where there is no GPU driver.
    """
    known = dict(known or {})
    anon = _delta(start.rss_anon, end.rss_anon)
    file = _delta(start.rss_file, end.rss_file)
    page_cache = _delta(start.cached, end.cached)
    outside = outside_any_process(
        start.mem_available, end.mem_available, tree_anon_pss_start, tree_anon_pss_end
    )
    drm_gtt = _delta(start.drm.total_gtt if start.drm else 0, end.drm.total_gtt if end.drm else 0)
    parts = {
        "outside": max(outside.outside_processes or 0, drm_gtt),
        "anon": anon - sum(known.values()),
        "file": max(file, page_cache),
    }
    cause = max(parts, key=lambda k: parts[k])
    if parts[cause] < SIGNIFICANT:
        cause = "known" if sum(known.values()) >= SIGNIFICANT else "none"
    elif cause == "outside" and cpu_backend:
        cause = "outside_no_gpu"
    return Attribution(
        anon,
        file,
        page_cache,
        outside.tree_anon_pss_growth,
        outside.mem_available_drop,
        outside.outside_processes,
        drm_gtt,
        cause,
        known,
    )
