"""Host release: after weights are loaded and processed, give host memory back to the OS.

Problem
    Host RAM stays above what vLLM needs after it has loaded and processed the
    weights. (vllm #50269 reports high host RAM after loading on XPU, but Intel's
    answer there is the driver's host copy of device memory: ``driver_env``.)
    On-the-fly ``sym_int4`` stages every layer on the host (bf16 -> fp32 ->
    int4) in every rank at once; glibc keeps the freed chunks in its arenas;
    module attributes can keep host tensors alive (tenstorrent vllm #161, vllm
    #36537); checkpoint pages stay in the page cache, charged to the
    container. vLLM up to 0.34 never calls ``malloc_trim``. On vLLM's CPU
    backend, prepacking leaves two vocab x hidden matrices that are never
    read (memory/vocab_copies.py).
Mechanism
    Right after ``Worker.load_model`` (weights loaded and processed, KV cache
    not yet sized): report host tensors the model still holds on a device
    worker; delete plain attributes matching ``VLLM_XPU_MEMFIX_RELEASE_ATTRS``
    (registered parameters and buffers never); on the CPU backend, drop the
    unused vocabulary copies (the embedding's packed GEMM copy, an untied
    lm_head's unpacked weight, where nothing can read it); ``gc.collect()``, the
    accelerator's ``empty_cache()`` and the allocator's release call (glibc
    ``malloc_trim``, tcmalloc ``MallocExtension_ReleaseFreeMemory``, jemalloc
    ``arena.<all>.purge``); optionally ``posix_fadvise(DONTNEED)`` on the
    checkpoint's shards. With Intel's ``sym_int4``, also trims after every
    ``VLLM_XPU_MEMFIX_RELEASE_EVERY_MIB`` of per-layer staging (a Linear layer's
    weight, an MoE side's experts), so retention cannot build up across layers.
    No built-in attribute patterns: the staging of llm-scaler's ``sym_int4`` and
    of vLLM's ``device_loading_context`` is deleted by their own code in the
    versions read; the audit reports anything left for the user to match.
Targets
    ``vllm.v1.worker.gpu_worker:Worker.load_model`` (XPUWorker and CPUWorker
    inherit it);
    ``vllm.model_executor.layers.quantization.sym_int4:_quantize_linear_int4_inplace``
    and
    ``vllm.model_executor.layers.quantization.sym_int4:_quantize_moe_int4_side_inplace``
    (Intel's images only; module globals called per Linear layer and per MoE side).
Switch
    ``VLLM_XPU_MEMFIX_HOST_RELEASE`` (auto = on); ``_RELEASE_ATTRS``,
    ``_RELEASE_EVERY_MIB``, ``_DROP_PAGE_CACHE``, ``_RELEASE_VOCAB_COPIES``.
Upstream
    ``malloc_trim`` after ``process_weights_after_loading`` in
    ``BaseModelLoader.load_model``, and ``remove_weight`` chosen per layer
    kind in ``UnquantizedEmbeddingMethod``; see docs/upstream/host-release.md.
Remove when
    ``base_loader`` gives freed host memory back itself (it mentions ``malloc_trim``, or
    ``trim_host_heap`` as in docs/upstream/patches/0002); the CPU backend's vocabulary
    copies and the per-layer trims of Intel's ``sym_int4`` are outside that patch.
"""

from __future__ import annotations

from typing import Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.startup.staging import STAGING_BYTES_PER_PARAM
from vllm_xpu_memfix.vllm_code.overrides import with_platform_overrides

logger = get_logger("host_release")

FIX = config.HOST_RELEASE
SYM_INT4 = "vllm.model_executor.layers.quantization.sym_int4"
REMOVE_WHEN = RemoveWhen(
    "BaseModelLoader.load_model gives freed host memory back (upstream patch 0002)",
    "vllm.model_executor.model_loader.base_loader",
    ("malloc_trim", "trim_host_heap"),
)


def release_after_load(instance: Any, settings: Settings) -> str | None:
    """The release for one worker, from the worker object."""
    from vllm_xpu_memfix.memory.release import LoadedModel, release_loaded_model

    return release_loaded_model(
        LoadedModel(
            model=instance.model_runner.get_model(),
            vllm_config=getattr(instance, "vllm_config", None),
            on_device=getattr(getattr(instance, "device", None), "type", "cpu") != "cpu",
            rank=getattr(instance, "rank", "?"),
        ),
        settings,
    )


def _after_load_model(settings: Settings) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            line = release_after_load(instance, settings)
            if line is not None:
                logger.info("%s", line)
        except Exception:
            logger.exception("vllm-xpu-memfix: host release failed; vLLM continues")
        return result

    return wrapper


def _staged_params(args: Any, kwargs: Any, side: bool) -> int:
    """Parameters about to be staged: a Linear layer's weight, or one MoE side's experts."""
    layer = args[0] if args else kwargs.get("layer")
    if side:
        which = args[1] if len(args) > 1 else kwargs.get("which", "")
        weight = getattr(layer, f"{which}_weight", None)
    else:
        weight = getattr(layer, "weight", None)
    return int(weight.numel()) if weight is not None else 0


def _trim_after_staging(settings: Settings) -> tuple[Any, Any]:
    """Wrappers for a Linear layer and an MoE side that trim after every
    ``release_every_mib`` of staging, counted across both in one closure."""
    staged_since_trim = 0.0

    def counted(side: bool) -> Any:
        def wrapper(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
            nonlocal staged_since_trim
            params = _staged_params(args, kwargs, side)
            result = wrapped(*args, **kwargs)
            if settings.release_every_mib:
                staged_since_trim += params * STAGING_BYTES_PER_PARAM
                if staged_since_trim >= settings.release_every_mib * MiB:
                    from vllm_xpu_memfix.memory import allocator

                    allocator.trim()  # the staging died with its references; no gc needed
                    staged_since_trim = 0.0
            return result

        return wrapper

    return counted(side=False), counted(side=True)


def patches(settings: Settings) -> tuple[Patch, ...]:
    after_layer, after_side = _trim_after_staging(settings)
    return (
        Patch(FIX.key, "vllm.v1.worker.gpu_worker:Worker.load_model", _after_load_model(settings)),
        Patch(FIX.key, f"{SYM_INT4}:_quantize_linear_int4_inplace", after_layer, params=("layer",)),
        Patch(
            FIX.key,
            f"{SYM_INT4}:_quantize_moe_int4_side_inplace",
            after_side,
            params=("layer", "which"),
        ),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(with_platform_overrides(patches(settings)))
