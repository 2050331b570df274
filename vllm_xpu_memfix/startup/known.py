"""A value the start-up model reads, as a range with where it came from.

Every input that can be unknown is a :class:`Known`: exact where it was read or given, a
range where it was not (the format of a checkpoint not at hand, activations of a model
without ``hidden_size``), with ``origin`` saying where it came from and ``settle`` what
would settle it. A verdict is certain only where the ranges it rests on are
(``startup.phases``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class Source(str, Enum):
    READ = "read"  # from vLLM for the described release and platform, the metadata, the host
    GIVEN = "given"  # the serve line, the host file, doctor's flags
    ASSUMED = "assumed"  # a default where nothing was read or given


@dataclass(frozen=True)
class Known:
    """``low`` to ``high`` (equal where exact); ``origin``: where it came from, e.g.
    "checkpoint headers", "--quantization"; ``settle``: what would make it exact, e.g.
    "pass --quantization, or go online" ("" where it is exact)."""

    low: float
    high: float
    source: Source
    origin: str
    settle: str = ""

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"{self.origin}: low {self.low} above high {self.high}")

    @classmethod
    def exact(cls, value: float, source: Source, origin: str) -> Known:
        return cls(value, value, source, origin)

    @classmethod
    def between(
        cls, low: float, high: float, source: Source, origin: str, settle: str = ""
    ) -> Known:
        return cls(low, high, source, origin, settle)

    @property
    def certain(self) -> bool:
        return self.low == self.high

    @property
    def ends(self) -> tuple[float, float]:
        return self.low, self.high

    def at(self, value: float) -> Known:
        """This input pinned at ``value`` (a corner of the range, for judging it)."""
        return replace(self, low=value, high=value)

    def scale(self, factor: float) -> Known:
        ends = sorted((self.low * factor, self.high * factor))
        return replace(self, low=ends[0], high=ends[1])

    def add(self, other: Known | float) -> Known:
        if isinstance(other, Known):
            return replace(self, low=self.low + other.low, high=self.high + other.high)
        return replace(self, low=self.low + other, high=self.high + other)


def exact(value: float, origin: str, source: Source = Source.READ) -> Known:
    """Shorthand for the common case: a value read (or ``source``) at ``origin``."""
    return Known.exact(value, source, origin)
