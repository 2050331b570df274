"""Device kernels of the plugin; import nothing else of the package, and are used by
``intel``, the fixes and benchmarks. Public API:

- ``quantize_q4_0(weight, group_size=128) -> (qweight, scales)``
- ``dequantize_q4_0(qweight, scales, group_size=128) -> tensor``

Symmetric int4 in GGML's Q4_0 round-to-nearest, with the fused rounding of Intel's
compiled library, packed as llm-scaler's ``sym_int4`` stores it (see
``q4_0_reference`` for the format and its edge cases). Tensors on the CPU go to the
torch reference; tensors on a CUDA or XPU device go to the Triton kernels. Both
reproduce the library's outputs recorded in tests/data/q4_0_golden (the reference in
CI, the Triton kernel on an H200; not yet run on XPU). Triton is optional: without it a
device tensor raises :class:`KernelUnavailable`, with the reason.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["KernelUnavailable", "dequantize_q4_0", "quantize_q4_0", "triton_unavailable"]


class KernelUnavailable(RuntimeError):
    """The device kernel cannot run here (no Triton, or a device Triton does not drive)."""


@functools.cache
def triton_unavailable() -> str | None:
    """Why the Triton kernels cannot be used, or None when they can."""
    try:
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a Triton build broken for this torch
        return f"Triton is not importable ({type(exc).__name__}: {exc})"
    return None


def _backend(device: torch.device) -> ModuleType:
    if device.type == "cpu":
        from vllm_xpu_memfix.kernels import q4_0_reference

        return q4_0_reference
    if device.type not in ("cuda", "xpu"):
        raise KernelUnavailable(f"no Q4_0 kernel for device type {device.type!r}")
    if (reason := triton_unavailable()) is not None:
        raise KernelUnavailable(reason)
    from vllm_xpu_memfix.kernels import q4_0_triton

    return q4_0_triton


def quantize_q4_0(weight: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float16/bfloat16/float32 -> (``[N, Kp/8]`` int32, ``[N, Kp/group_size]`` fp16).

    Kp is K zero-padded to a multiple of ``group_size`` (a power of two >= 8).
    Raises ``ValueError`` on a bad shape, dtype or group size and on inf/NaN input.
    """
    return _backend(weight.device).quantize(weight, group_size)


def dequantize_q4_0(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """``(q - 8) * scale`` as float32 ``[N, Kp]``; slice ``[:, :K]`` for the original width."""
    return _backend(qweight.device).dequantize(qweight, scales, group_size)
