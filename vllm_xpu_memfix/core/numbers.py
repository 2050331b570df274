"""The one rule for every number the plugin reads, from a variable or a CLI option, and
the wording of a refusal: ``NAME='value' is not valid; accepted values: ...``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


class ConfigError(ValueError):
    """A ``VLLM_XPU_MEMFIX*`` variable holds a value the plugin does not accept."""


def shown(value: str, limit: int = 60) -> str:
    """``value`` quoted for a one-line message, cut after ``limit`` characters."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} chars)"


def printable(text: str, limit: int | None = 200) -> str:
    """``text`` for a line a person reads: each character that is not printable (CR, LF,
    ESC and the other controls, a lone surrogate from undecodable bytes) written as its
    escape, and cut after ``limit`` characters with a mark (``…``)."""
    head = text if limit is None else text[:limit]
    escaped = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in head
    )
    return escaped if head == text else f"{escaped}… ({len(text):,} chars)"


def refusal(value: str, accepted: str) -> str:
    return f"{shown(value)} is not valid; accepted values: {accepted}"


def invalid(name: str, value: str, accepted: str) -> ConfigError:
    return ConfigError(f"{name}={refusal(value, accepted)}")


_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _plain(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else repr(number)


@dataclass(frozen=True)
class Bounds:
    """The one rule for every number the plugin reads, from a variable or a CLI option:
    plain decimal digits (no ``nan``, ``inf``, ``1_000``), finite, and within
    ``minimum``..``maximum`` (strictly above ``minimum`` when ``above_minimum``)."""

    minimum: float
    maximum: float
    integer: bool = False
    above_minimum: bool = False
    unit: str = ""

    @property
    def accepted(self) -> str:
        low, high = _plain(self.minimum), _plain(self.maximum)
        unit = f" ({self.unit})" if self.unit else ""
        if self.integer:
            return f"an integer from {low} to {high}{unit}"
        if self.above_minimum:
            return f"a number above {low} and at most {high}{unit}"
        return f"a number from {low} to {high}{unit}"

    def value_of(self, raw: str) -> float | None:
        """The number ``raw`` spells (an ``int`` for integers), or None when it spells
        none within the bounds."""
        text = raw.strip()
        if not (_INTEGER if self.integer else _DECIMAL).fullmatch(text):
            return None
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:  # more digits than int() converts
            return None
        if not math.isfinite(value) or not self.minimum <= value <= self.maximum:
            return None
        if self.above_minimum and value == self.minimum:
            return None
        return value

    def parse(self, name: str, raw: str) -> float:
        """:meth:`value_of`, or :class:`ConfigError` naming ``name``, ``raw`` and the range."""
        value = self.value_of(raw)
        if value is None:
            raise invalid(name, raw, self.accepted)
        return value

    def refusal(self, raw: str) -> str:
        """Why ``raw`` is refused, without a name (a CLI parser puts the option's)."""
        return refusal(raw, self.accepted)


SLOTS = Bounds(1, 1024, integer=True)
# A day: a finite wait, so start-up never hangs on the plugin.
TIMEOUT_S = Bounds(0, 86_400, above_minimum=True, unit="seconds")
MIB = Bounds(0, 1 << 20, integer=True, unit="MiB")  # up to 1 TiB
