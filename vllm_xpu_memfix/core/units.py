"""Byte units, and the one way a byte figure is written for a person.

A quantity is written in one unit wherever it appears (the caller picks it once per
quantity: GiB for the host's and the device's memory, MiB for parts that are small by
nature, such as the sampler burst's terms); :func:`size` writes it. GiB take one decimal
and MiB none, thousands separated; a figure those places would write as zero but which is
not keeps two significant digits (``0.012 GiB``, never ``0.0 GiB``); zero is ``0``, never
``-0``.
"""

from __future__ import annotations

import math

MiB = 1024**2
GiB = 1024**3
_NAMES = {MiB: "MiB", GiB: "GiB"}
_DECIMALS = {MiB: 0, GiB: 1}


def _places(value: float, decimals: int) -> int:
    """``decimals``, or more where those would round a value that is not zero to zero."""
    if value == 0 or not math.isfinite(value) or round(value, decimals) != 0:
        return decimals
    return 1 - math.floor(math.log10(abs(value)))


def rounded(value: float, decimals: int) -> float:
    """``value`` to ``decimals`` places, the rule of :func:`size` for a figure kept as a
    number (doctor's JSON): a value those places make zero keeps two significant digits."""
    return round(value, _places(value, decimals)) + 0.0  # + 0.0: never -0.0


def figure(value: float, decimals: int) -> str:
    """``value`` written by :func:`rounded`'s rule, thousands separated."""
    if round(value, _places(value, decimals)) == 0:
        return "0"
    return f"{value:,.{_places(value, decimals)}f}"


def size(nbytes: float | None, unit: int = GiB) -> str:
    """``nbytes`` in ``unit`` (:data:`GiB` or :data:`MiB`): ``12.3 GiB``, ``0.012 GiB``,
    ``0 GiB``, ``485 MiB``; ``-`` for None (not known). Less than half a byte is zero."""
    if nbytes is None:
        return "-"
    value = 0.0 if abs(nbytes) < 0.5 else nbytes / unit
    return f"{figure(value, _DECIMALS[unit])} {_NAMES[unit]}"
