"""The constructed multi-GPU xe trees of ``tests/data/proc`` (see its README): each holds
the ranks' ``/proc`` at process start (``start``) and at the first batch (``ready``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_xpu_memfix.memory.snapshot import ProcReader, Snapshot

DATA = Path(__file__).resolve().parent.parent / "data" / "proc"
KiB, GiB = 1024, 1024**3


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    pinned: bool
    # What the host commits for the driver over the start-up, all ranks (the README's figure).
    committed: int
    # What one rank holds on its own device, imported on each of the other gpus - 1 cards.
    device: int

    def reader(self, moment: str) -> ProcReader:
        return ProcReader(DATA / self.name / moment)

    @property
    def ranks(self) -> list[int]:
        return sorted(
            int(p.name) for p in (DATA / self.name / "start" / "proc").iterdir() if p.name.isdigit()
        )

    def rank_zero(self, moment: str) -> Snapshot:
        return self.reader(moment).take(self.ranks[0])

    def tree_anon_pss(self, moment: str) -> int:
        reader = self.reader(moment)
        return sum(reader.process_anon_pss(str(pid)) or 0 for pid in self.ranks)


_OWN_GTT_2, _OWN_GTT_4 = 96 * 1024 * KiB, 78_644 * KiB
TWO_PINNED = Scenario("xe-2gpu-pinned", 2, True, 2 * (18 * GiB + _OWN_GTT_2), 18 * GiB)
TWO_UNPINNED = Scenario("xe-2gpu-unpinned", 2, False, 2 * _OWN_GTT_2, 18 * GiB)
FOUR_PINNED = Scenario(
    "xe-4gpu-pinned", 4, True, 4 * (3_224_370 * KiB + _OWN_GTT_4), 3_224_370 * KiB
)
FOUR_UNPINNED = Scenario("xe-4gpu-unpinned", 4, False, 4 * _OWN_GTT_4, 3_224_370 * KiB)
SCENARIOS = (TWO_PINNED, TWO_UNPINNED, FOUR_PINNED, FOUR_UNPINNED)
