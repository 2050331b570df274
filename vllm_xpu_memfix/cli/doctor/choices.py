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

Where doctor judges for another vLLM than the installed one (an Intel image named by
``--image`` or the host file's ``[image] name``: ``target.target``), the ``-q``
methods are that release's as recorded (``vllm_code.releases``); a release not recorded
leaves the name unchecked, said in the report, never refused.
"""

from __future__ import annotations

import functools

from vllm_xpu_memfix.cli import compat
from vllm_xpu_memfix.memory.checkpoint import TORCH_DTYPES
from vllm_xpu_memfix.startup import domain
from vllm_xpu_memfix.startup.sizing import ON_THE_FLY_QUANT
from vllm_xpu_memfix.vllm_code import releases

QUANTIZATION_SOURCE = ("vllm.model_executor.layers.quantization", "QuantizationMethods")
DTYPE_SOURCE = ("vllm.config.model", "ModelDType")


@functools.cache
def _vllm_literal(module: str, name: str) -> tuple[str, ...] | None:
    root = compat.installed_vllm_root()
    return None if root is None else compat.literal_strings(root, module, name)


def quantization_names() -> tuple[str, ...] | None:
    """Every name ``-q`` takes; None where the list of the vLLM judged for could not be read
    (not installed, or another release not recorded)."""
    other = releases.described()
    names = _vllm_literal(*QUANTIZATION_SOURCE) if other is None else None
    if other is not None:
        names = releases.quantization_methods(other)
    if names is None:
        return None
    return (*names, *sorted(set(ON_THE_FLY_QUANT) - set(names)))


def not_checked(name: str) -> str:
    """Why ``-q name`` was taken unchecked, for the report."""
    other = releases.described()
    if other is None:
        return QUANTIZATION_NOT_CHECKED.format(name=name)
    return (
        f"the image's vLLM {other} is not one doctor has recorded "
        f"({', '.join(releases.recorded())}): -q {name!r} is taken unchecked"
    )


def dtype_names() -> tuple[str, ...]:
    """Every name ``--dtype`` takes."""
    return _vllm_literal(*DTYPE_SOURCE) or ("auto", *TORCH_DTYPES)


QUANTIZATION_NOT_CHECKED = (
    "no vLLM installed here to read its quantization methods from: -q {name!r} is taken unchecked"
)


def other_vllm_notes(not_modelled: tuple[str, ...]) -> list[str]:
    """For the report, where doctor judges for another vLLM than the installed one: which,
    and the flags set that its recorded ``EngineArgs`` lacks (its parser refuses them)."""
    other = releases.described()
    if other is None:
        return []
    notes = [f"judged for the image's vLLM {other}, not the installed "
             f"{releases.installed_version() or 'none'}"]  # fmt: skip
    fields = releases.engine_fields(other)
    if fields is None:
        return [*notes, f"vLLM {other}'s flags and XPU methods are not recorded: the flags "
                "are not checked, whether XPU serves the format is assumed"]  # fmt: skip
    names = [flag.split("=")[0].split(" ")[0] for flag in not_modelled]
    lacking = [
        name
        for name in names
        if (field := domain.field_of(name)) and field not in fields | set(domain.FRONTEND)
    ]
    if lacking:
        notes.append(f"vLLM {other} has no {', '.join(lacking)}: its parser refuses the line")
    return notes
