"""Symmetric int4 (GGML Q4_0 round-to-nearest) in plain torch: the reference.

Written from the format llm-scaler's ``sym_int4`` describes, following GGML's
``quantize_row_q4_0_reference`` step by step, with the rounding of the compiled
library Intel's images call (``quantize_q4_0_to_qweight_and_scale`` in
``vllm_int4_for_multi_arc.so``):

- groups of ``group_size`` values along the input dimension K;
- ``m``: the group's first element of largest magnitude, with its sign
  (a strict ``<`` scan, so the earliest of equal magnitudes wins);
- ``d = m / -8`` and ``id = 1 / d`` (0 when d is 0), both fp32;
- ``q = min(15, trunc(fma(x, id, 8.5)))``: the multiply-add fused, rounded to
  fp32 once. Intel's library does this: its GCC 13.3 build contracts GGML's
  ``x * id + 8.5f`` into ``vfmadd132ss`` followed by ``vcvttss2si`` (read in the
  disassembly of the build on llm-scaler ``branch-v1.0``,
  ``vllm/patches/vllm_int4_for_multi_arc.so``). Rounding the product first, as
  GGML's C reads, differs wherever the exact product lies just below a tie;
  ``tests/data/q4_0_golden`` holds the library's own output on such values;
- the scale is stored as fp16 (round to nearest even); dequantised value
  ``(q - 8) * d``;
- packed GPTQ-style: 8 values per int32 along K, value j at bits 4j;
  ``qweight`` is ``[N, Kp/8]`` int32 and ``scales`` ``[N, Kp/group_size]`` fp16,
  where Kp is K zero-padded up to a multiple of the group size.

Edge cases, as decided here:

- an all-zero group: m = +0, d = -0.0 (stored 0x8000), every q = 8;
- exact ties: ``x * id + 8.5`` landing on an integer rounds the value up (q is
  truncated, and ``x * id + 8.5 >= 0.5``);
- m negative: d is positive and the most negative value maps to q = 0; the
  largest positive values of equal magnitude would give 16 and clamp to 15;
- a finite maximum beyond 8 x 65504 (fp32 input only): the fp16 scale
  overflows to inf, as GGML's ``FP32_TO_FP16`` does;
- a group whose maximum is so small that ``1 / d`` overflows fp32 (``|m|`` below
  about 2.35e-38): every ``fma`` is inf or NaN, which the library's
  ``vcvttss2si`` turns into 0x80000000 and its ``(int8_t)`` cast into 0, so every
  q = 0 (the scale is -0.0 or a subnormal's fp16 zero);
- inf or NaN anywhere in the weight: ``ValueError``. GGML's result is
  undefined there (a NaN is never the maximum, then ``(int8_t)NaN``), and a
  checkpoint holding one is broken; nothing is returned;
- K not a multiple of the group: zero-padded, as llm-scaler does.
"""

from __future__ import annotations

import torch

PACK = 8  # four-bit values per int32


def check_group_size(group_size: int) -> None:
    if group_size < PACK or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= {PACK}, got {group_size}")


def check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight dtype must be float16, bfloat16 or float32, got {weight.dtype}")


def nonfinite_error(where: str) -> ValueError:
    return ValueError(f"weight holds inf or NaN in {where}; not quantized")


def check_scales(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """Both tensors of one quantized weight, for ``group_size``; raises on a mismatch."""
    check_group_size(group_size)
    n, words = qweight.shape
    expected = (n, words * PACK // group_size)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match qweight {tuple(qweight.shape)} "
            f"with group_size {group_size}: expected {expected}"
        )


def padded_k(k: int, group_size: int) -> int:
    return -(-k // group_size) * group_size


def fused_scale_and_shift(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``fma(x, inverse, 8.5)`` in fp32, with one rounding.

    The product of two fp32 values is exact in fp64 (48 significant bits). Where
    ``|x * inverse| >= 1/4`` the sum with 8.5 needs at most 53 bits, so it is exact
    too and the cast to fp32 is the only rounding. Below 1/4 the sum lies more than
    1/4 from any integer, where a second rounding cannot change the truncation.
    """
    return (x.double() * inverse.double() + 8.5).float()


def groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``weight`` as fp32 groups ``[N, Kp/G, G]`` (zero-padded), and each group's
    ``d`` ``[N, Kp/G, 1]``."""
    check_weight(weight)
    check_group_size(group_size)
    x = weight.to(torch.float32)
    if not torch.isfinite(x).all():
        raise nonfinite_error(f"{int((~torch.isfinite(x)).sum())} element(s)")
    n, k = x.shape
    kp = padded_k(k, group_size)
    x = torch.nn.functional.pad(x, (0, kp - k)).view(n, kp // group_size, group_size)
    magnitude = x.abs()
    amax = magnitude.amax(dim=-1, keepdim=True)
    first = (magnitude == amax).int().argmax(dim=-1, keepdim=True)  # first index at the max
    m = torch.where(amax > 0, x.gather(-1, first), torch.zeros_like(amax))
    return x, m / -8.0


def inverse_of(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


def pack(scaled: torch.Tensor) -> torch.Tensor:
    """``x * id + 8.5`` per value ``[N, Kp/G, G]`` -> packed words ``[N, Kp/8]``: truncated,
    capped at 15, inf/NaN as 0."""
    n = scaled.shape[0]
    q = torch.where(torch.isfinite(scaled), torch.clamp(scaled.trunc(), max=15), 0)
    shifts = torch.arange(PACK, dtype=torch.int32, device=scaled.device) * 4
    q = q.to(torch.int32).view(n, -1, PACK) << shifts
    qweight = q[..., 0]
    for j in range(1, PACK):
        qweight = qweight | q[..., j]
    return qweight.contiguous()


def quantize(weight: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    x, d = groups(weight, group_size)
    qweight = pack(fused_scale_and_shift(x, inverse_of(d)))
    return qweight, d.squeeze(-1).to(torch.float16)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    check_scales(qweight, scales, group_size)
    n, words = qweight.shape
    kp = words * PACK
    shifts = torch.arange(PACK, dtype=torch.int32, device=qweight.device) * 4
    q = (qweight.unsqueeze(-1) >> shifts) & 0xF
    values = (q.view(n, kp // group_size, group_size) - 8).to(torch.float32)
    return (values * scales.to(torch.float32).unsqueeze(-1)).view(n, kp).to(dtype)
