"""The PSS carried between reads, on real processes of this machine: a fork or an exit
outside the monitored tree moves no memory, so the others' figure must not move either."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from vllm_xpu_memfix.memory.others import OtherProcesses
from vllm_xpu_memfix.memory.pss_budget import PssCache
from vllm_xpu_memfix.memory.snapshot import LIVE

MiB = 1024**2

# Holds 300 MiB; on "fork" forks a child that shares those pages (copy on write, untouched),
# on "reap" kills and waits for the last one.
FORKER = """
import os, signal, sys, time
block = bytearray(300 * 1024 * 1024)
print("held", flush=True)
children = []
for line in sys.stdin:
    if line.strip() == "fork":
        children.append(os.fork())
        if children[-1] == 0:
            time.sleep(120)
            os._exit(0)
    else:
        os.kill(children[-1], signal.SIGKILL)
        os.waitpid(children.pop(), 0)
    print(children[-1] if children else 0, flush=True)
"""


class Family:
    """The forker and its child as :class:`OtherProcesses` sees them (PSS renewals
    unbounded: the mechanism is tested, not the budget), apart from the host's others."""

    def __init__(self, parent: int) -> None:
        self.pids = {parent}
        self.cache = PssCache(LIVE, share=1.0)
        self.others = OtherProcesses(LIVE, self.cache)

    def anon(self) -> int:
        """Their anonymous PSS after two samples (a parent's renewal follows its child's
        first sighting by at most one)."""
        for _ in range(2):
            time.sleep(0.1)
            self.cache.tick()
            listed = self.others.pids()
            seen = self.others.sample((), listed)
            self.cache.keep_only(listed)
        return sum(seen.by_pid.get(pid, 0) for pid in self.pids)


@pytest.fixture
def forker():
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    family = Family(proc.pid)

    def say(command: str) -> None:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        family.pids.add(int(proc.stdout.readline()))

    yield family, say
    proc.kill()
    proc.wait()


def test_forks_and_an_exit_beside_the_tree_leave_the_others_where_they_were(forker):
    family, say = forker
    before = family.anon()
    assert before >= 300 * MiB
    figures = []
    for command in ("fork", "fork", "reap"):  # the 300 MiB shared by 2, by 3, by 2 again
        say(command)
        figures.append(family.anon())
    # Carried forward by RSS alone, the parent would keep its 300 MiB beside the first
    # child's 150 after the fork; after the exit, the child left would keep its third.
    for after in figures:
        assert abs(after - before) < 16 * MiB, (before / MiB, [f / MiB for f in figures])
