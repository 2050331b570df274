"""The CPU that vLLM's CPU platform sees, forced for a test.

vLLM's CPU build (vllm/platforms/cpu.py, 0.32.0) asks torch's probes, not the CPU:
``torch.cpu._is_avx512_bf16_supported`` stores the mamba SSM state as float32 and sets
the conv-state layout, ``_is_amx_tile_supported`` picks AMX MLA (block 128) over the
reference CPU MLA (block 16), and ``_is_avx512_supported`` picks the kernel library.
``ONEDNN_MAX_CPU_ISA`` changes none of them. Forcing the probes lets a run on one CPU
take the paths of the others, as far as vLLM's configuration goes (no kernel runs).
"""

from __future__ import annotations

import pytest

# (AVX-512, AVX-512 BF16, AMX tiles) for each CPU class the suite must pass on.
ISAS = {
    "avx2": (False, False, False),
    "avx512": (True, False, False),
    "avx512_bf16": (True, True, False),
    "amx": (True, True, True),
}


def force(env: pytest.MonkeyPatch, isa: str) -> None:
    """Make torch's probes answer as a CPU of class ``isa`` until ``env`` is undone."""
    import torch

    avx512, bf16, amx = ISAS[isa]
    env.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    env.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    env.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    # vLLM sets it on a BF16 CPU; a build of an earlier test must not carry it over.
    env.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
