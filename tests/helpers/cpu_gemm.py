"""What the installed vLLM CPU build does with an unquantized GEMM weight on this CPU.

vLLM's ``dispatch_cpu_unquantized_gemm`` (model_executor/layers/utils.py, 0.32) gives a
layer a ``cpu_linear`` closure over a prepacked copy: a oneDNN handler (free variable
``handler``) or an SGL packed tensor (``packed_weight``). Where oneDNN cannot build a
matmul for the dtype on this CPU (bf16 without AVX-512, or with oneDNN limited by
``ONEDNN_MAX_CPU_ISA=AVX2``) it logs "Failed to create oneDNN linear" and falls back to
``F.linear`` on the weight, with no copy. The tests ask vLLM itself, on a plain layer,
instead of assuming what one machine did; the free-variable names are an oracle
independent of the plugin's own ``holds_packed_copy``.
"""

from __future__ import annotations

import functools
import os

import torch

PACKED_COPY_NAMES = {"handler", "packed_weight"}


@functools.cache
def vllm_prepacks(dtype: torch.dtype) -> bool:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(256, 128, dtype=dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return bool(PACKED_COPY_NAMES & set(layer.cpu_linear.__code__.co_freevars))


def cpu_features() -> str:
    """The CPU facts that decide prepacking, for skip reasons and messages."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (
        f"AVX-512 BF16 {'yes' if torch.cpu._is_avx512_bf16_supported() else 'no'}, "
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
        + (f", ONEDNN_MAX_CPU_ISA={limit}" if limit else "")
    )
