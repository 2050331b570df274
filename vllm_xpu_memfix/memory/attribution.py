"""Which cause explains host-memory growth between two snapshots. Pure functions.

The causes are those of the project's root-cause notes: a driver-pinned host
copy of device memory (cause 1) shows as memory the host committed that no process
maps; weight staging, allocator retention and live references (causes 2, 4, 5) show
as anonymous memory of the process; checkpoint page cache and mmap (cause 3) show as
file pages.

The driver's host copy is measured from what the host committed, never from
``drm-total-gtt``: the growth of the kernel's count of GPU-held system memory
(``GPUActive`` / ``nr_gpu_active``) where the kernel has one, else the MemAvailable drop
less the vLLM tree's anonymous growth. ``drm-total-gtt`` counts a peer import on every
card's DRM file, (N-1) times for an allocation with N GPUs, and the imports stay when the
pinning is off (``EnableDeferBacking=0``: a community note on 4x B70, 2026-10-04, saw host
memory held fall 12.6 -> 0.3 GiB with the imports still present), so it is reported as
"peer imports" only.

Before a cause is named, the parts the ledger knows are taken out of the process's
anonymous growth: vLLM's KV cache where it lives in host memory (vLLM's CPU backend,
at vLLM's own byte figure) and the model's weights held in host memory. Only what
remains is blamed on staging, retention or references. On vLLM's CPU backend no GPU
driver can pin a host copy, so memory outside the vLLM processes is not blamed on one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.snapshot import Snapshot

# Growth below this is treated as noise on a busy host.
SIGNIFICANT = 128 * MiB

CAUSES = {
    "outside": "the GPU driver's host copy of device memory, committed outside any process "
    "(cause 1); see VLLM_XPU_MEMFIX_DRIVER_ENV",
    "anon": "anonymous memory of this process beyond the parts the ledger knows: weight "
    "staging, allocator retention or live references (causes 2, 4, 5)",
    "outside_other": "memory outside the vLLM processes that the driver does not hold: other "
    "processes on the host or the kernel",
    "outside_no_gpu": "memory outside the vLLM processes: other processes on the host or the "
    "kernel (vLLM's CPU backend: no GPU driver to pin a host copy)",
    "file": "file pages: checkpoint page cache or mmap (cause 3)",
    "imports_no_copy": "peer imports of device memory are present, but the host holds no "
    "copy of them (the driver's pinning is off, e.g. NEOReadDebugKeys=1 EnableDeferBacking=0, "
    "compute-runtime #953)",
    "imports_unknown": "peer imports of device memory are present; whether the host holds a "
    "copy of them is unknown (no committed figure: MemAvailable, GPUActive or the tree's PSS)",
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


# Where the committed figure came from.
BY_GPU_COUNT = "GPUActive"
BY_OUTSIDE = "outside any process"


@dataclass(frozen=True)
class HostCopy:
    """The host memory the GPU driver holds, from what the host committed.

    ``committed``: system-wide growth of GPU-held memory (``counted_by`` says from which
    figure), ``None`` where no figure tells. ``peer_imports``: the ``drm-total-gtt`` growth
    of processes with clients on ``cards`` >= 2 GPUs; not host memory by itself.
    """

    committed: int | None
    counted_by: str | None
    peer_imports: int = 0
    cards: int = 1

    @property
    def pinned_copy(self) -> int | None:
        """The host copy the pinning would make of these imports: each imported allocation
        once (compute-runtime #953, #980; intel/llvm #22873), where ``drm-total-gtt`` counts
        it on each of the cards - 1 peers. ``None`` without peer imports."""
        if not self.peer_imports or self.cards < 2:
            return None
        return self.peer_imports // (self.cards - 1)

    @property
    def held(self) -> bool | None:
        """Whether the host holds a copy: what it committed is significant and, where peer
        imports are present, at least half the copy the pinning would make of them."""
        if self.committed is None:
            return None
        floor = max(SIGNIFICANT, (self.pinned_copy or 0) // 2)
        return self.committed >= floor

    @property
    def imports_without_copy(self) -> bool:
        """Peer imports are there and the host holds no copy of them: the pinning is off."""
        return self.peer_imports >= SIGNIFICANT and self.held is False


def driver_host_copy(
    start: Snapshot,
    end: Snapshot,
    outside: Outside,
    gpu_driver: bool,
    peer_imports: int = 0,
    cards: int = 1,
) -> HostCopy:
    """What the driver holds between ``start`` and ``end``: the growth of the kernel's GPU
    count where it has one (it counts exactly the GPU-held pages), else, where a GPU driver
    is in use, the memory outside any process. ``peer_imports`` is the ``drm-total-gtt``
    growth over the same time, counted only where the process(es) had clients on 2+ cards.
    """
    imports = peer_imports if cards >= 2 else 0
    if not gpu_driver:
        return HostCopy(None, None, imports, cards)
    gpu_growth = _change(start.gpu_active, end.gpu_active)
    if gpu_growth is not None:
        return HostCopy(gpu_growth, BY_GPU_COUNT, imports, cards)
    if outside.outside_processes is not None:
        return HostCopy(outside.outside_processes, BY_OUTSIDE, imports, cards)
    return HostCopy(None, None, imports, cards)


@dataclass(frozen=True)
class Attribution:
    anon: int
    file: int
    page_cache: int
    tree_anon_pss: int | None
    mem_available_drop: int | None
    outside_processes: int | None
    host_copy: HostCopy
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


def _gtt(snap: Snapshot) -> int:
    return snap.drm.total_gtt if snap.drm else 0


def _copy_part(copy: HostCopy) -> int:
    """The committed memory to blame on the driver's copy: none where imports are present
    and the host holds no copy of them (what it committed is then the driver's own)."""
    if copy.committed is None or copy.imports_without_copy:
        return 0
    return copy.committed


def _quiet_cause(copy: HostCopy, known: int) -> str:
    """The cause where no part is significant."""
    if known >= SIGNIFICANT:
        return "known"
    if copy.peer_imports >= SIGNIFICANT:
        return "imports_no_copy" if copy.held is False else "imports_unknown"
    return "none"


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
    see :func:`outside_any_process`. The driver's host copy comes from committed figures
    (:func:`driver_host_copy`); this process's ``drm-total-gtt`` growth is its peer imports.
    ``known`` names parts of this process's anonymous growth whose owner the ledger
    recorded; they are taken out before a cause is named. ``cpu_backend``: the worker
    runs on vLLM's CPU backend, where there is no GPU driver.
    """
    known = dict(known or {})
    anon = _delta(start.rss_anon, end.rss_anon)
    file = _delta(start.rss_file, end.rss_file)
    page_cache = _delta(start.cached, end.cached)
    outside = outside_any_process(
        start.available, end.available, tree_anon_pss_start, tree_anon_pss_end
    )
    copy = driver_host_copy(
        start,
        end,
        outside,
        gpu_driver=not cpu_backend,
        peer_imports=_gtt(end) - _gtt(start),
        cards=end.drm.cards if end.drm else 1,
    )
    parts = {
        "outside": _copy_part(copy),
        "outside_other": (outside.outside_processes or 0) - (copy.committed or 0),
        "anon": anon - sum(known.values()),
        "file": max(file, page_cache),
    }
    cause = max(parts, key=lambda k: parts[k])
    if parts[cause] < SIGNIFICANT:
        cause = _quiet_cause(copy, sum(known.values()))
    elif cause == "outside_other" and cpu_backend:
        cause = "outside_no_gpu"
    return Attribution(
        anon=anon,
        file=file,
        page_cache=page_cache,
        tree_anon_pss=outside.tree_anon_pss_growth,
        mem_available_drop=outside.mem_available_drop,
        outside_processes=outside.outside_processes,
        host_copy=copy,
        cause=cause,
        known=known,
    )
