"""Q4_0 test material shared by the CPU tests and the device exactness run.

``ggml_scalar`` transliterates GGML's ``quantize_row_q4_0_reference`` loop one
element at a time in numpy float32, independently of the vectorised reference.
``adversarial`` builds groups that sit on every edge the format has.
"""

from __future__ import annotations

import numpy as np
import torch


def ggml_scalar(row: np.ndarray, group_size: int) -> tuple[list[int], list[np.float16]]:
    """One row (float32, length a multiple of group_size) -> (q values, fp16 scales)."""
    qs: list[int] = []
    scales: list[np.float16] = []
    for start in range(0, len(row), group_size):
        amax, vmax = np.float32(0.0), np.float32(0.0)
        for v in row[start : start + group_size]:
            if amax < abs(v):
                amax, vmax = abs(v), v
        d = np.float32(vmax / np.float32(-8.0))
        inverse = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        scales.append(np.float16(d))
        for v in row[start : start + group_size]:
            scaled = np.float32(v * inverse)
            qs.append(min(15, int(np.float32(scaled + np.float32(8.5)))))
    return qs, scales


def adversarial(group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one group each, every row an edge case; K = group_size."""
    g = group_size
    rows = []
    rows.append(torch.zeros(g))  # all zero: d = -0.0
    neg_zero = torch.zeros(g)
    neg_zero[0] = -0.0
    rows.append(neg_zero)  # -0.0 first must not set the sign
    tie = torch.zeros(g)
    tie[3], tie[9] = 2.0, -2.0  # equal magnitudes: the first (positive) wins
    rows.append(tie)
    tie_neg = torch.zeros(g)
    tie_neg[3], tie_neg[9] = -2.0, 2.0  # the first (negative) wins
    rows.append(tie_neg)
    halves = torch.arange(g, dtype=torch.float32) % 16 - 8.0 + 0.5  # x*id + 8.5 integral
    halves[0] = -8.0  # m = -8 -> d = 1, id = 1
    rows.append(halves)
    clamp = torch.full((g,), 7.99)
    clamp[1] = -8.0  # most positive values map past 15
    rows.append(clamp)
    single = torch.zeros(g)
    single[g - 1] = 1e-3  # the max is the last element
    rows.append(single)
    tiny = torch.full((g,), 3e-8)  # subnormal in fp16 scale
    tiny[5] = -6e-8
    rows.append(tiny)
    big = torch.linspace(-60000.0, 60000.0, g)  # near the fp16 range
    rows.append(big)
    alternating = torch.tensor([(-1.0) ** i * (i % 7 + 1) for i in range(g)])
    rows.append(alternating)
    return torch.stack(rows).to(dtype)
