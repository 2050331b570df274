"""Q4_0 test material shared by the CPU tests and the device exactness run.

``ggml_scalar`` transliterates GGML's ``quantize_row_q4_0_reference`` loop one
element at a time in numpy, independently of the vectorised reference, as Intel's
compiled library runs it: ``x * id + 8.5`` fused (one rounding; ``vfmadd132ss`` in its
disassembly), and inf/NaN converted to 0 (``vcvttss2si``, then an int8 cast).
``unfused_q4_0`` is the other reading of GGML's C, the product rounded first: the
rule the golden data must tell apart.
``adversarial`` builds groups that sit on every edge the format has.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from vllm_xpu_memfix.kernels import q4_0_reference

GOLDEN = Path(__file__).parent / "data" / "q4_0_golden"  # <build>-g<group>.safetensors


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
        with np.errstate(over="ignore"):  # 1/d overflows for a group of tiny values
            inverse = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        scales.append(np.float16(d))
        for v in row[start : start + group_size]:
            with np.errstate(invalid="ignore"):
                fused = np.float32(np.float64(v) * np.float64(inverse) + 8.5)
            qs.append(min(15, int(fused)) if np.isfinite(fused) else 0)
    return qs, scales


def unfused_q4_0(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Packed words by GGML's C read literally: ``fl(fl(x * id) + 8.5)``; K zero-padded."""
    x, d = q4_0_reference.groups(weight, group_size)
    return q4_0_reference.pack(x * q4_0_reference.inverse_of(d) + 8.5)


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


def golden_files() -> list[Path]:
    """Every recording of a build of Intel's library: one file per build and group."""
    return sorted(GOLDEN.glob("*-g*.safetensors"))


def load_golden(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """One recording from Intel's library: ``{case: {weight, qweight, scales}}`` and the
    provenance (tests/data/q4_0_golden/README.md)."""
    from safetensors import safe_open

    cases: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            case, part = key.rsplit(".", 1)
            cases.setdefault(case, {})[part] = f.get_tensor(key)
        provenance = json.loads(f.metadata()["provenance"])
    return cases, provenance
