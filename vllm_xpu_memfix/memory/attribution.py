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


def _delta(before: int | None, after: int | None) -> int:
    return 0 if before is None or after is None else after - before


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

    "Outside any process" is the MemAvailable drop minus the growth of the vLLM
    process tree's anonymous + shmem PSS: memory the system lost that no vLLM
    process maps. File pages are left out on both sides, since MemAvailable
    counts page cache as available. Other processes on the host add noise.
    """
    anon = _delta(start.rss_anon, end.rss_anon)
    file = _delta(start.rss_file, end.rss_file)
    page_cache = _delta(start.cached, end.cached)
    drop = None
    if start.mem_available is not None and end.mem_available is not None:
        drop = start.mem_available - end.mem_available
    tree = None
    if tree_anon_pss_start is not None and tree_anon_pss_end is not None:
        tree = tree_anon_pss_end - tree_anon_pss_start
    outside = None if drop is None or tree is None else drop - tree
    drm_gtt = _delta(start.drm.total_gtt if start.drm else 0, end.drm.total_gtt if end.drm else 0)
    parts = {
        "outside": max(outside or 0, drm_gtt),
        "anon": anon,
        "file": max(file, page_cache),
    }
    cause = max(parts, key=lambda k: parts[k])
    if parts[cause] < SIGNIFICANT:
        cause = "none"
    return Attribution(anon, file, page_cache, tree, drop, outside, drm_gtt, cause)
