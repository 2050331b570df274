"""The anonymous + shmem memory of the processes outside one process tree.

What MemAvailable lost that neither vLLM's tree nor any other process maps is the
driver's or the kernel's; to say so, the others are measured too: their PSS where the
kernel lets us read it (``memory.pss_budget``), else their RSS from ``status``. What we
cannot see is said, as :attr:`OthersSample.unseen`: processes whose ``status`` is refused
(``hidepid=1``), a ``/proc`` mounted with ``hidepid=2`` (others' processes are not
listed), or a PID namespace other than the host's (a container sees only its own).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Collection
from dataclasses import dataclass

from vllm_xpu_memfix.memory.pss_budget import PssCache
from vllm_xpu_memfix.memory.snapshot import ProcReader, parse_size

# The inode of the host's (the initial) PID namespace: PROC_PID_INIT_INO in the kernel's
# include/linux/proc_ns.h.
_INIT_PID_NS = 0xEFFFFFFC


@dataclass(frozen=True)
class OthersSample:
    """``anon``: summed anonymous + shmem memory of the others now (bytes); ``by_pid``: the
    same per process; ``unseen``: what could not be read, empty where nothing."""

    anon: int
    by_pid: dict[int, int]
    unseen: str


def _field(text: str, key: str) -> int | None:
    """The size (bytes) on the ``key`` line of a ``status`` text; ``None`` where none."""
    at = text.find(key)
    if at < 0:
        return None
    end = text.find("\n", at)
    return parse_size(text[at + len(key) : None if end < 0 else end])


def _status_rss(text: str) -> tuple[int, int] | None:
    """(RSS, RssAnon + RssShmem) of a ``status`` text; ``None`` for a kernel thread."""
    anon, shmem = _field(text, "RssAnon:"), _field(text, "RssShmem:")
    if anon is None or shmem is None:
        return None
    return anon + shmem + (_field(text, "RssFile:") or 0), anon + shmem


class OtherProcesses:
    """Samples every process outside a tree, sharing ``cache``'s budget."""

    def __init__(self, reader: ProcReader, cache: PssCache) -> None:
        self.reader = reader
        self.cache = cache
        self.kernel_threads: set[int] = set()
        self.limits = self._limits()

    def _limits(self) -> list[str]:
        """What this ``/proc`` hides from us, found once."""
        limits = []
        try:
            namespace = os.stat(self.reader.root / "proc" / "self" / "ns" / "pid").st_ino
            if namespace != _INIT_PID_NS:
                limits.append("other PID namespaces")
        except OSError:
            pass
        try:
            mounts = self.reader.read_text(self.reader.root / "proc" / "mounts")
        except OSError:
            mounts = ""
        for line in mounts.splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[1] == "/proc" and fields[2] == "proc":
                options = dict(o.partition("=")[::2] for o in fields[3].split(","))
                if options.get("hidepid", "0") not in ("0", "off"):
                    limits.append(f"hidepid={options['hidepid']}")
        return limits

    def pids(self) -> list[int]:
        try:
            names = os.listdir(self.reader.root / "proc")
        except OSError:
            return []
        return [int(n) for n in names if n.isdigit()]

    def sample(self, tree: Collection[int], pids: list[int] | None = None) -> OthersSample:
        """The others of ``tree`` now; ``pids``: every process listed (default: listed here)."""
        listed = self.pids() if pids is None else pids
        self.kernel_threads.intersection_update(listed)
        by_pid: dict[int, int] = {}
        refused = 0
        proc = self.reader.root / "proc"
        for pid in listed:
            if pid in tree or pid in self.kernel_threads:
                continue
            try:
                text = self.reader.read_text(proc / f"{pid}/status")
            except OSError as error:
                refused += error.errno in (errno.EACCES, errno.EPERM)
                continue
            rss = _status_rss(text)
            if rss is None:
                self.kernel_threads.add(pid)
                continue
            if pid not in self.cache.parents:
                self.cache.born(pid, _field(text, "PPid:") or 0)
            pss = self.cache.get(pid, *rss)
            by_pid[pid] = rss[1] if pss.anon_pss is None else pss.anon_pss
        unseen = [*self.limits, *([f"{refused} process(es) refused"] if refused else [])]
        return OthersSample(sum(by_pid.values()), by_pid, ", ".join(unseen))
