"""The host's room for more memory: the one figure the load lock, the ledger and doctor use.

The room is the smaller of ``MemAvailable`` (what the kernel can hand out without swapping,
reclaimable page cache included) and, where the process's memory cgroup has a limit, that
limit less the cgroup's usage (v2 ``memory.max - memory.current``, v1
``memory.limit_in_bytes - memory.usage_in_bytes``). Inside a container ``/proc/meminfo``
shows the host's memory, but the cgroup's limit is what the OOM killer enforces. The
cgroup's usage counts its page cache, which the kernel reclaims before it kills, so the
container figure errs low, never high.

Read through :class:`~vllm_xpu_memfix.memory.snapshot.ProcReader` rooted at
``VLLM_XPU_MEMFIX_SYSROOT``, so a recorded tree can stand in for the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_xpu_memfix.core.units import MiB, size
from vllm_xpu_memfix.memory.snapshot import CgroupMemory, ProcReader


@dataclass(frozen=True)
class Room:
    mem_available: int | None
    cgroup: CgroupMemory
    meminfo_path: str = "/proc/meminfo"

    @property
    def problem(self) -> str | None:
        """Why the room is unknown, or None."""
        if self.cgroup.problem:
            return f"cgroup unreadable ({self.cgroup.problem})"
        if self.mem_available is None:
            return f"no MemAvailable in {self.meminfo_path}"
        return None

    @property
    def bytes(self) -> int | None:
        """The room in bytes (never below 0); None where a figure could not be read."""
        if self.problem or self.mem_available is None:
            return None
        cgroup_room = self.cgroup.room
        room = self.mem_available if cgroup_room is None else min(self.mem_available, cgroup_room)
        return max(0, room)

    def describe(self, unit: int = MiB) -> str:
        """``room 2,560 MiB (MemAvailable 23,251 MiB; cgroup limit 8,192 MiB, used 5,632
        MiB)``, or why it is unknown; in ``unit`` (doctor gives the host's memory in GiB)."""
        if self.problem or self.bytes is None:
            return f"room unknown: {self.problem}"
        cgroup = self.cgroup
        if cgroup.limit is None or cgroup.usage is None:
            limit = "no cgroup memory limit"
        else:
            limit = f"cgroup limit {size(cgroup.limit, unit)}, used {size(cgroup.usage, unit)}"
        available = size(self.mem_available or 0, unit)
        return f"room {size(self.bytes, unit)} (MemAvailable {available}; {limit})"


def host_room(root: str | os.PathLike[str] = "/", pid: int | str = "self") -> Room:
    """The room as the files under ``root`` give it, for process ``pid``'s cgroup."""
    reader = ProcReader(root)
    return Room(
        reader.meminfo().get("MemAvailable"),
        reader.cgroup_memory(pid),
        str(reader.root / "proc" / "meminfo"),
    )
