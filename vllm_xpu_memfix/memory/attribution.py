"""Which cause explains host-memory growth between two snapshots. Pure functions.

The causes are those of the project's root-cause notes: a driver-pinned host
mirror of device memory (cause 1) shows as MemAvailable falling with no process
owning the memory; weight staging, allocator retention and live references
(causes 2, 4, 5) show as anonymous memory of the process; checkpoint page cache
and mmap (cause 3) show as file pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_xpu_memfix.memory.snapshot import Snapshot
from vllm_xpu_memfix.units import MiB

# Growth below this is treated as noise on a busy host.
SIGNIFICANT = 128 * MiB

CAUSES = {
    "outside": "memory outside any process: the driver's pinned host mirror of device "
    "memory (cause 1); check drm-total-gtt / nr_gpu_active and VLLM_XPU_MEMFIX_DRIVER_ENV",
    "anon": "anonymous memory of this process: weight staging, allocator retention or "
    "live references (causes 2, 4, 5)",
    "file": "file pages: checkpoint page cache or mmap (cause 3)",
    "none": "no significant host-memory growth",
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

    @property
    def explanation(self) -> str:
        return CAUSES[self.cause]


def attribute(
    start: Snapshot, end: Snapshot, tree_anon_pss_start: int | None, tree_anon_pss_end: int | None
) -> Attribution:
    """Split host growth from ``start`` to ``end`` and name the largest part's cause.

    The vLLM process tree's share is given by its anonymous + shmem PSS at both ends;
    see :func:`outside_any_process`.
    """
    anon = _delta(start.rss_anon, end.rss_anon)
    file = _delta(start.rss_file, end.rss_file)
    page_cache = _delta(start.cached, end.cached)
    outside = outside_any_process(
        start.mem_available, end.mem_available, tree_anon_pss_start, tree_anon_pss_end
    )
    drm_gtt = _delta(start.drm.total_gtt if start.drm else 0, end.drm.total_gtt if end.drm else 0)
    parts = {
        "outside": max(outside.outside_processes or 0, drm_gtt),
        "anon": anon,
        "file": max(file, page_cache),
    }
    cause = max(parts, key=lambda k: parts[k])
    if parts[cause] < SIGNIFICANT:
        cause = "none"
    return Attribution(
        anon,
        file,
        page_cache,
        outside.tree_anon_pss_growth,
        outside.mem_available_drop,
        outside.outside_processes,
        drm_gtt,
        cause,
    )
