"""PSS of many processes, sampled often, at a bounded share of one core.

The kernel walks every mapped page to answer ``/proc/<pid>/smaps_rollup``: about 13 ms
per GiB of a vLLM worker on the 2-core test bed, so reading a 60 GiB worker every 0.5 s
would take more than the core. :class:`PssCache` reads it when a process is first seen,
then again only when the process's RSS (from ``status``, a few microseconds) has moved
or its reading has aged, and only while the reads have spent less than ``share`` of the
wall time. Between reads a process's PSS is carried forward by its RSS change: new
private pages count in full in both. A fork or an exit moves the shares of pages the parent
and its children had in common without moving their RSS; their readings are then renewed
first (:meth:`PssCache.born`, :meth:`PssCache.keep_only`).
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.snapshot import ProcReader, anon_pss, parse_key_sizes

# The share of one core the PSS reads may take, averaged over time.
SHARE = 0.005
# A reading is renewed once the process's RSS moved this much, or it is this old.
MOVED = 32 * MiB
REFRESH_S = 10.0
_ROLLUP_KEYS = frozenset({"Pss", "Pss_Anon", "Pss_Shmem"})


@dataclass(frozen=True)
class Pss:
    """A process's PSS and anonymous + shmem PSS (bytes); ``refused``: the kernel refuses
    its ``smaps_rollup`` to us, so both figures are ``None``."""

    pss: int | None
    anon_pss: int | None
    refused: bool = False


@dataclass
class _Reading:
    pss: int | None
    anon_pss: int | None
    rss: int
    anon_rss: int
    at: float


class PssCache:
    """:class:`Pss` per pid, renewed within a CPU budget (see the module's docstring)."""

    def __init__(
        self,
        reader: ProcReader,
        share: float = SHARE,
        moved: int = MOVED,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.reader = reader
        self.share = share
        self.moved = moved
        self.refresh_s = refresh_s
        self.clock = clock
        self.cpu_clock = cpu_clock
        self.readings: dict[int, _Reading] = {}
        self.refused: set[int] = set()
        # CPU seconds the reads may still spend; a first reading may run it into debt.
        self.credit = 0.0
        self.last = clock()
        self.spent_s = 0.0
        self.reads = 0
        self.ticks = 0
        # The parent of each process seen (see born()).
        self.parents: dict[int, int] = {}

    def tick(self) -> None:
        """Accrue the budget for the time since the last tick (once per sample)."""
        now = self.clock()
        self.ticks += 1
        self.credit = min(self.credit + self.share * (now - self.last), self.share * self.refresh_s)
        self.last = now

    def get(self, pid: int, rss: int, anon_rss: int) -> Pss:
        """``pid``'s PSS for its RSS and anonymous + shmem RSS now (bytes)."""
        if pid in self.refused:
            return Pss(None, None, refused=True)
        old = self.readings.get(pid)
        if old is None or (self.credit > 0 and self._due(old, rss)):
            fresh = self._read(pid, rss, anon_rss)
            if fresh is None:
                return Pss(None, None, refused=pid in self.refused)
            self.readings[pid] = old = fresh
        return Pss(
            None if old.pss is None else max(0, old.pss + rss - old.rss),
            None if old.anon_pss is None else max(0, old.anon_pss + anon_rss - old.anon_rss),
        )

    def _due(self, old: _Reading, rss: int) -> bool:
        return abs(rss - old.rss) >= self.moved or self.clock() - old.at >= self.refresh_s

    def _read(self, pid: int, rss: int, anon_rss: int) -> _Reading | None:
        started = self.cpu_clock()
        try:
            text = self.reader.read_text(self.reader.root / "proc" / str(pid) / "smaps_rollup")
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM):
                self.refused.add(pid)
            return None
        finally:
            cost = self.cpu_clock() - started
            self.credit -= cost
            self.spent_s += cost
            self.reads += 1
        rollup = parse_key_sizes(text, _ROLLUP_KEYS)
        return _Reading(
            rollup.get("Pss"),
            anon_pss(rollup.get("Pss_Anon"), rollup.get("Pss_Shmem")),
            rss,
            anon_rss,
            self.clock(),
        )

    def born(self, pid: int, parent: int) -> None:
        """``pid`` is seen for the first time, a child of ``parent``: after the first sample,
        the readings of ``parent`` and its other children are renewed as soon as the budget
        allows."""
        if pid not in self.parents:
            self.parents[pid] = parent
            if self.ticks > 1:
                self._expire(parent)

    def _expire(self, parent: int) -> None:
        """Renew ``parent``'s reading and its children's, who share its pages."""
        for pid in (parent, *(p for p, of in self.parents.items() if of == parent)):
            reading = self.readings.get(pid)
            if reading is not None:
                reading.at = -math.inf

    def keep_only(self, pids: Iterable[int]) -> None:
        """Forget the processes not in ``pids`` (gone), so a reused pid starts afresh; their
        parents' and siblings' readings are renewed as soon as the budget allows."""
        alive = set(pids)
        for gone in self.parents.keys() - alive:
            self._expire(self.parents.pop(gone))
        self.readings = {p: r for p, r in self.readings.items() if p in alive}
        self.refused &= alive
