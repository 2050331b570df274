"""The values doctor takes for ``-q/--quantization`` and ``--dtype``, in its own flags and in
a pasted serve line: the one list of each.

vLLM's own lists come from the installed vLLM's source, read with :mod:`ast` (importing
them would start torch): ``QuantizationMethods`` in
``vllm/model_executor/layers/quantization/__init__.py`` and ``ModelDType`` in
``vllm/config/model.py`` (both ``Literal`` types in vLLM 0.32). To them doctor adds the
on-the-fly formats of Intel's images that it models (``startup.sizing.ON_THE_FLY_QUANT``:
``sym_int4`` and kin, which upstream vLLM lacks). Without a vLLM here to read, the dtypes
are those doctor sizes (``memory.checkpoint.TORCH_DTYPES`` and ``auto``), and a
quantization name is taken unchecked, which the report says.
"""

from __future__ import annotations

import functools

from vllm_xpu_memfix.cli import compat
from vllm_xpu_memfix.memory.checkpoint import TORCH_DTYPES
from vllm_xpu_memfix.startup.sizing import ON_THE_FLY_QUANT

QUANTIZATION_SOURCE = ("vllm.model_executor.layers.quantization", "QuantizationMethods")
DTYPE_SOURCE = ("vllm.config.model", "ModelDType")


@functools.cache
def _vllm_literal(module: str, name: str) -> tuple[str, ...] | None:
    root = compat.installed_vllm_root()
    return None if root is None else compat.literal_strings(root, module, name)


def quantization_names() -> tuple[str, ...] | None:
    """Every name ``-q`` takes; None where the installed vLLM's list could not be read."""
    names = _vllm_literal(*QUANTIZATION_SOURCE)
    if names is None:
        return None
    return (*names, *sorted(set(ON_THE_FLY_QUANT) - set(names)))


def dtype_names() -> tuple[str, ...]:
    """Every name ``--dtype`` takes."""
    return _vllm_literal(*DTYPE_SOURCE) or ("auto", *TORCH_DTYPES)


QUANTIZATION_NOT_CHECKED = (
    "no vLLM installed here to read its quantization methods from: -q {name!r} is taken unchecked"
)
