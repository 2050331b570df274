"""Weights built to sit on Q4_0's near-ties, where the order of rounding decides a value.

``x * id + 8.5`` is truncated to the 4-bit value. Where its exact value lies just below
an integer, closer than the rounding step of the product ``x * id`` itself, rounding
the product first can lift it onto the integer, while one rounding of the whole
multiply-add (at the finer step of a smaller sum) keeps it below. Random weights hit
such values rarely (a few hundred packed words of a 27B layer's 44 M); a probe made of
them shows in a few thousand words whether two quantizers round alike.

Such values sit next to the quantizer's decision boundaries ``x = (n - 8.5) * d`` of a
group whose maximum ``m`` makes ``1 / d`` inexact (an odd mantissa): weights already on a
Q4_0 grid, as a dequantized checkpoint holds, are exactly there. The values are chosen
from exact arithmetic alone, not from either rounding rule.

Each probe row is one group: its maximum ``m`` first, then values of the same dtype
whose exact ``x * id + 8.5`` (``id`` the fp32 ``1 / (m / -8)``) lies below an integer by
less than one fp32 ulp of ``x * id``.
"""

from __future__ import annotations

import torch

# Group maxima m = c * 2^e with c odd, so that 1/d is inexact; both signs.
MAXIMA = tuple(
    sign * c * 2.0**exponent
    for exponent in (-12, -10, -8)
    for c in (3, 5, 7, 9, 11, 13, 15, 19, 23, 27)
    for sign in (1.0, -1.0)
)
NEIGHBOURS = 8  # representable values tried on each side of every decision boundary

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def near_ties(m: float, dtype: torch.dtype) -> torch.Tensor:
    """The values of ``dtype`` within ``|m|`` whose exact ``x * id + 8.5`` lies below an
    integer by less than an fp32 ulp of ``x * id``, for the group maximum ``m``."""
    m32 = torch.tensor(m, dtype=dtype).float()
    d = m32 / -8.0
    inverse = (1.0 / d).double()
    boundaries = (torch.arange(1, 16, dtype=torch.float64) - 8.5) * d.double()
    start = boundaries.to(dtype).view(_BITS[dtype]).to(torch.int64)
    steps = torch.arange(-NEIGHBOURS, NEIGHBOURS + 1)
    x = (start[:, None] + steps[None, :]).flatten().to(_BITS[dtype]).view(dtype).unique()
    x = x[torch.isfinite(x) & (x.float().abs() <= m32.abs())]
    product = x.double() * inverse  # exact
    exact = product + 8.5  # exact wherever it matters (q4_0_reference.fused_scale_and_shift)
    below = exact.ceil() - exact
    product_ulp = torch.ldexp(torch.ones_like(product), torch.frexp(product)[1] - 24)
    return x[(below > 0) & (below < product_ulp)]


def near_tie_probe(group_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[rows, group_size]`` of ``dtype``: one group per maximum in :data:`MAXIMA` that has
    near-ties, each group filled by cycling through them after ``m``."""
    rows = []
    for m in MAXIMA:
        ties = near_ties(m, dtype)
        if ties.numel() == 0:
            continue
        fill = ties.repeat(-(-(group_size - 1) // ties.numel()))[: group_size - 1]
        rows.append(torch.cat([torch.tensor([m], dtype=dtype), fill]))
    return torch.stack(rows)
