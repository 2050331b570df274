"""Device quant: let llm-scaler's ``sym_int4`` quantize on the device, not through the host.

Problem
    Intel's on-the-fly ``sym_int4`` quantizes every linear layer on the host:
    device bf16 -> host bf16 -> host fp32 -> a C library (GGML Q4_0) -> host
    int32 + fp16 scales -> device, in every rank at once: host staging in each
    rank, and minutes of single-threaded CPU work at start-up. Only the
    0.14-based module has a device seam
    (``_use_xpu_quant`` / ``_xpu_q4_0_quantize``), which Intel's own ESIMD
    package fills in those images; the 0.21 module always takes the host path.
Mechanism
    Recognise the installed module's layout from its structure
    (``int4_layouts``): the seam layout, one of the two 0.21 layouts, or
    unknown. Then, only after a self-check in the process (``int4_self_check``: a
    random tensor and a near-tie probe, quantized by the module's own
    ``ggml_quantize_tensor``, so by the library the installed build loads, and by
    this plugin's Triton Q4_0 kernel, must give identical words and scale bits;
    otherwise the host path stays and one line gives the count; the outcome is
    recorded for ``check``):

    * seam layout, ESIMD package absent: fill the seam with the kernel;
    * host-round-trip layout: quantize each Linear layer and each MoE side on
      the device (legacy-load weights are moved there one layer, or one expert,
      at a time), padded as the module pads, and hand the result to the module's
      ``_register_linear_int4_layouts`` and the same wiring, or store the MoE
      side under the module's names, so the layer ends as the module would
      leave it (``int4_device``); no host copy, no fp32, no C library;
    * inline-registration layout: the same steps, with the registration the
      module does inline instead of a helper (ESIMD views always, ``qweight``
      and ``scales`` as copies of the transposes) and the MoE words stored as
      int32, as that module stores them;
    * unknown layout: the host path, with one line saying why.

    A weight with inf/NaN falls back to the host path for that layer. The
    module's own opt-out, ``VLLM_INT4_DISABLE_XPU_QUANT=1``, always wins.
Targets
    ``vllm.model_executor.layers.quantization.sym_int4:_use_xpu_quant``,
    ``vllm.model_executor.layers.quantization.sym_int4:_xpu_q4_0_quantize`` (the
    seam layout) and
    ``vllm.model_executor.layers.quantization.sym_int4:_quantize_linear_int4_inplace``
    (every layout) and
    ``vllm.model_executor.layers.quantization.sym_int4:_quantize_moe_int4_side_inplace``
    (the 0.21 layouts); module globals, Intel's images only. A target the installed
    layout lacks is skipped quietly.
Switch
    ``VLLM_XPU_MEMFIX_DEVICE_QUANT`` (auto = on; the self-check always runs).
Upstream
    llm-scaler: call a device Q4_0 kernel from ``_quantize_linear_int4_inplace``
    and make it the default once it matches the C library; see
    docs/design/device-quant.md.
Remove when
    ``sym_int4`` ships a portable device quantizer of its own (it mentions ``triton``).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.host_lock import LockDirError
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.intel import int4_device, int4_layouts, int4_self_check

logger = get_logger("device_quant")

FIX = config.DEVICE_QUANT
MODULE = "vllm.model_executor.layers.quantization.sym_int4"
REMOVE_WHEN = RemoveWhen(
    "sym_int4 quantizes on the device with a portable kernel of its own", MODULE, ("triton",)
)
# The 0.14-based module's own switch for its device path (llm-scaler, vllm-0.14.0-b8.3.2).
USER_OPT_OUT = "VLLM_INT4_DISABLE_XPU_QUANT"
# Per layout key: the device steps for a Linear layer and for an MoE side.
DEVICE_STEPS = {
    int4_layouts.HOST_ROUND_TRIP.key: (int4_device.quantize_linear, int4_device.quantize_moe_side),
    int4_layouts.INLINE_REGISTRATION.key: (
        functools.partial(
            int4_device.quantize_linear, register=int4_device.register_inline_layouts
        ),
        functools.partial(int4_device.quantize_moe_side, as_bytes=False),
    ),
}


def check_device() -> Any:
    """The accelerator this process quantizes on: XPU, else CUDA, else None."""
    import torch

    from vllm_xpu_memfix.memory.accelerator import accelerator_backend

    found = accelerator_backend(torch)
    return torch.device(found[0], found[1].current_device()) if found else None


def _decide_and_log(record_dir: Path) -> tuple[bool, str]:
    """Whether to quantize on the device in this process, and why; logged once."""
    use, why = _decide(record_dir)
    if use:
        logger.info("vllm-xpu-memfix: sym_int4 quantizes on the device (Triton Q4_0): %s", why)
    else:
        logger.info("vllm-xpu-memfix: sym_int4 keeps its host path: %s", why)
    return use, why


def _decide(record_dir: Path) -> tuple[bool, str]:
    module = sys.modules.get(MODULE)
    if module is None:
        return False, f"{MODULE} is not loaded"
    if getattr(module, "_HAS_XPU_Q4_0", False):
        return False, "Intel's ESIMD Q4_0 kernel is installed and already quantizes on the device"
    if os.environ.get(USER_OPT_OUT, "0").strip().lower() in ("1", "true", "yes", "on"):
        return False, f"{USER_OPT_OUT} is set: the user chose the host path"
    from vllm_xpu_memfix.kernels import triton_unavailable

    device = check_device()
    if device is None:
        return False, "no XPU or CUDA device in this process"
    if device.type != "cpu" and (reason := triton_unavailable()) is not None:
        return False, reason
    outcome = int4_self_check.run(module, device)
    try:
        int4_self_check.write_record(record_dir, outcome.record())
    except (OSError, LockDirError) as exc:  # the record serves check; the decision stands
        logger.debug("vllm-xpu-memfix: self-check record not written: %s", exc)
    return outcome.passed, outcome.why


def patches(settings: Settings) -> tuple[Patch, ...]:
    # One decision per installed patch set.
    use_device = functools.cache(functools.partial(_decide_and_log, settings.lock_dir))

    @functools.cache
    def layout() -> int4_layouts.Recognised:
        found = int4_layouts.recognise(int4_layouts.shape_of_module(sys.modules[MODULE]))
        if found.layout is None:
            logger.info("vllm-xpu-memfix: sym_int4 layout: %s", found.summary)
        else:
            logger.info("vllm-xpu-memfix: sym_int4 layout: %s", found.layout.title)
            logger.debug("vllm-xpu-memfix: device_quant %s", found.layout.device_quant)
        return found

    def plugin_kernel() -> bool:
        # Intel's ESIMD kernel, where installed, stays in charge without a word from us.
        esimd = getattr(sys.modules.get(MODULE), "_HAS_XPU_Q4_0", False)
        return not esimd and use_device()[0]

    def _use_device(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        return True if plugin_kernel() else wrapped(*args, **kwargs)

    def _quantize_on_device(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        if not plugin_kernel():
            return wrapped(*args, **kwargs)
        from vllm_xpu_memfix.kernels import quantize_q4_0

        weight = args[0] if args else kwargs["bf16_xpu"]
        module = sys.modules[MODULE]
        return quantize_q4_0(weight.contiguous(), int(getattr(module, "QK4_GROUP_SIZE", 128)))

    @functools.cache
    def moe_side_mismatch() -> str | None:
        """Asked only once a layout with device steps is recognised."""
        found = layout()
        assert found.layout is not None
        why = found.layout.moe_side_mismatch(found.shape)
        if why is not None:
            logger.info("vllm-xpu-memfix: sym_int4 MoE layers keep the host path: %s", why)
        return why

    def steps() -> tuple[Any, Any] | None:
        """The installed layout's device steps (Linear, MoE side), if it has any."""
        found = layout().layout
        return DEVICE_STEPS.get(found.key) if found is not None else None

    def on_device_or_host(step: Any, wrapped: Any, args: Any, kwargs: Any) -> Any:
        try:
            step(sys.modules[MODULE], *args, device=check_device(), **kwargs)
        except ValueError as exc:
            logger.warning("vllm-xpu-memfix: a sym_int4 layer takes the host path: %s", exc)
            return wrapped(*args, **kwargs)
        return None

    def _layer_on_device(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        found = steps()
        if found is None or not plugin_kernel():
            return wrapped(*args, **kwargs)
        return on_device_or_host(found[0], wrapped, args, kwargs)

    def _moe_side_on_device(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        found = steps()
        if found is None or not plugin_kernel() or moe_side_mismatch() is not None:
            return wrapped(*args, **kwargs)
        return on_device_or_host(found[1], wrapped, args, kwargs)

    return (
        Patch(FIX.key, f"{MODULE}:_use_xpu_quant", _use_device, optional=True),
        Patch(
            FIX.key,
            f"{MODULE}:_xpu_q4_0_quantize",
            _quantize_on_device,
            params=("bf16_xpu",),
            optional=True,
        ),
        Patch(
            FIX.key,
            f"{MODULE}:_quantize_linear_int4_inplace",
            _layer_on_device,
            params=("layer",),
            optional=True,
        ),
        Patch(
            FIX.key,
            f"{MODULE}:_quantize_moe_int4_side_inplace",
            _moe_side_on_device,
            params=("layer", "which"),
            optional=True,
        ),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(patches(settings))
