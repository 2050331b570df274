"""Symmetric int4 (GGML Q4_0) on the device: Triton kernels following the reference's rule.

One program quantizes a tile of ``BLOCK_N`` rows x one group. ``x * id + 8.5`` is one
explicit ``tl.fma``, rounded once as Intel's compiled library does (see
``q4_0_reference``); the launch keeps ``enable_fp_fusion=False`` so that no other
operation is contracted behind our back. A group holding
an inf or a NaN gets a NaN scale (m sums x * 0 of the group), so the caller finds
non-finite input in the small scales tensor alone (an infinite scale is legitimate:
a finite fp32 maximum beyond 8 x 65504 overflows the fp16 scale, in GGML too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_xpu_memfix.kernels.q4_0_reference import (
    PACK,
    check_group_size,
    check_scales,
    check_weight,
    nonfinite_error,
    padded_k,
)

# Tile sizes chosen on the H200 (docs/data/q4_0-h200.json): rows x groups per program. A
# variant looping over groups with pipelined loads was slower in every configuration.
BLOCK_N = 8
GROUPS = 2
NUM_WARPS = 2


@triton.jit
def _q4_0_rows(x, ROWS: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr):
    """``x``: fp32 ``[ROWS, GROUP]``, one group per row -> (scales, packed ``[ROWS, WORDS]``)."""
    # GGML's scan: the first element of largest magnitude sets m. The sum adds x * 0
    # of every other element, so an inf or NaN anywhere makes m NaN.
    index = tl.arange(0, GROUP)[None, :]
    first = tl.argmax(tl.abs(x), axis=1, tie_break_left=True)
    m = tl.sum(tl.where(index == first[:, None], x, x * 0.0), axis=1)
    m = tl.where(tl.abs(m) == float("inf"), float("nan"), m)
    m = tl.where(m == 0, 0.0, m)  # an all-zero group: +0, GGML's initial value
    d = m * -0.125  # = m / -8 exactly: both are the correctly rounded m/8
    one = tl.full((ROWS,), 1.0, tl.float32)
    inverse = tl.where(d != 0, tl.math.div_rn(one, d), 0.0)  # IEEE, as the reference
    q = tl.fma(x, inverse[:, None], 8.5)
    # inf/NaN (1/d overflowed in a group of tiny values) becomes 0, as x86's
    # conversion and the library's int8 cast make it.
    q = tl.where(tl.abs(q) < float("inf"), q, 0.0)
    q = tl.minimum(q.to(tl.int32), 15)  # float -> int truncates toward zero
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    packed = tl.sum(tl.reshape(q, (ROWS, WORDS, 8)) << shifts, axis=2)
    return d, packed


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    k,
    stride_x,
    words_per_row,
    groups_per_row,
    GROUP: tl.constexpr,
    WORDS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A tile of BLOCK_N rows x GROUPS groups, viewed as BLOCK_N * GROUPS group-rows.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_group = tl.program_id(1) * GROUPS
    cols = first_group * GROUP + tl.arange(0, GROUPS * GROUP)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < k)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = tl.reshape(x.to(tl.float32), (BLOCK_N * GROUPS, GROUP))
    d, packed = _q4_0_rows(x, BLOCK_N * GROUPS, GROUP, WORDS)

    group_ids = first_group + tl.arange(0, GROUPS)
    tl.store(
        s_ptr + rows[:, None] * groups_per_row + group_ids[None, :],
        tl.reshape(d.to(tl.float16), (BLOCK_N, GROUPS)),
        mask=row_ok[:, None] & (group_ids < groups_per_row)[None, :],
    )
    word_cols = first_group * WORDS + tl.arange(0, GROUPS * WORDS)
    tl.store(
        q_ptr + rows[:, None] * words_per_row + word_cols[None, :],
        tl.reshape(packed, (BLOCK_N, GROUPS * WORDS)),
        mask=row_ok[:, None] & (word_cols < words_per_row)[None, :],
    )


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    words_per_row,
    groups_per_row,
    GROUP: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    row_ok = rows < n_rows
    word_cols = group * WORDS + tl.arange(0, WORDS)
    packed = tl.load(
        q_ptr + rows[:, None] * words_per_row + word_cols[None, :], mask=row_ok[:, None], other=0
    )
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    q = (packed[:, :, None] >> shifts) & 0xF
    q = tl.reshape(q, (BLOCK_N, GROUP))
    scale = tl.load(s_ptr + rows * groups_per_row + group, mask=row_ok, other=0.0)
    values = (q - 8).to(tl.float32) * scale.to(tl.float32)[:, None]
    cols = group * GROUP + tl.arange(0, GROUP)
    out = out_ptr + rows[:, None] * (words_per_row * 8) + cols[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch(
    weight: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    block_n: int = BLOCK_N,
    groups: int = GROUPS,
    num_warps: int = NUM_WARPS,
) -> None:
    """Run the quantize kernel into preallocated outputs (no checks, no sync)."""
    n, k = weight.shape
    groups_per_row = scales.shape[1]
    grid = (triton.cdiv(n, block_n), triton.cdiv(groups_per_row, groups))
    _quantize_kernel[grid](
        weight, qweight, scales, n, k, weight.stride(0), qweight.shape[1], groups_per_row,
        GROUP=group_size, WORDS=group_size // PACK, GROUPS=groups, BLOCK_N=block_n,
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip


def quantize(
    weight: torch.Tensor, group_size: int = 128, **tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    check_weight(weight)
    check_group_size(group_size)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    kp = padded_k(k, group_size)
    qweight = torch.empty((n, kp // PACK), dtype=torch.int32, device=weight.device)
    scales = torch.empty((n, kp // group_size), dtype=torch.float16, device=weight.device)
    launch(weight, qweight, scales, group_size, **tiles)
    flagged = torch.isnan(scales)
    if bool(flagged.any()):
        raise nonfinite_error(f"{int(flagged.sum())} group(s)")
    return qweight, scales


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.float32,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    check_scales(qweight, scales, group_size)
    n, words = qweight.shape
    qweight, scales = qweight.contiguous(), scales.contiguous()
    out = torch.empty((n, words * PACK), dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(n, block_n), words * PACK // group_size)
    _dequantize_kernel[grid](
        qweight, scales, out, n, words, words * PACK // group_size,
        GROUP=group_size, WORDS=group_size // PACK, BLOCK_N=block_n,
    )  # fmt: skip
    return out
