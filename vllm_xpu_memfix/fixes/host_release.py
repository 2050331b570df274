"""Host release: after weights are loaded and processed, give host memory back to the OS.

Problem
    Host RAM stays high after vLLM has loaded and processed the weights (vllm
    #50269; static FP8 did not help, so it is not only quantization).
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
    ``release_host_memory`` as in docs/upstream/patches/0002); the CPU backend's vocabulary
    copies and the per-layer trims of Intel's ``sym_int4`` are outside that patch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix import config
from vllm_xpu_memfix.config import Settings
from vllm_xpu_memfix.log import get_logger
from vllm_xpu_memfix.overrides import with_platform_overrides
from vllm_xpu_memfix.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.units import STAGING_BYTES_PER_PARAM, MiB

if TYPE_CHECKING:  # imported where used: registration must stay cheap
    from vllm_xpu_memfix.memory.vocab_copies import VocabRelease

logger = get_logger("host_release")

FIX = config.HOST_RELEASE
SYM_INT4 = "vllm.model_executor.layers.quantization.sym_int4"
# Set on a model once released, so a second release (after the load lock did it) is skipped.
RELEASED = "_vllm_xpu_memfix_host_released"
REMOVE_WHEN = RemoveWhen(
    "BaseModelLoader.load_model gives freed host memory back (upstream patch 0002)",
    "vllm.model_executor.model_loader.base_loader",
    ("malloc_trim", "release_host_memory"),
)


def _rss_anon() -> int:
    from vllm_xpu_memfix.memory.snapshot import take_self

    return take_self(pss=False).rss_anon or 0


def drop_page_cache(directory: Path) -> int:
    """``POSIX_FADV_DONTNEED`` on every safetensors shard; returns the bytes advised."""
    advised = 0
    for shard in sorted(directory.glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return advised


def _vocab_part(vocab: VocabRelease) -> str:
    if vocab.released:
        return f"unused vocab copies released {len(vocab.released)} ({vocab.nbytes / MiB:,.0f} MiB)"
    return f"no unused vocab copies: {vocab.nothing_packed}"


@dataclass(frozen=True)
class LoadedModel:
    """A model right after loading, with what the release needs to know about its rank."""

    model: Any
    vllm_config: Any
    on_device: bool
    rank: Any


def release_loaded_model(loaded: LoadedModel, settings: Settings) -> str | None:
    """Do the release for one rank's model; returns the log line, or None when this model
    was released already (the load lock does it inside its section, before the next rank
    starts loading)."""
    from vllm_xpu_memfix.memory import allocator, audit
    from vllm_xpu_memfix.memory.vocab_copies import VocabRelease, release_unused_vocab_copies

    model = loaded.model
    if getattr(model, RELEASED, False):
        return None
    started = time.perf_counter()
    before = _rss_anon()
    if loaded.on_device:
        for leftover in audit.find_host_tensors(model)[:5]:
            logger.info("vllm-xpu-memfix: host tensor still held after loading: %s", leftover)
    released = audit.release_matching(model, settings.release_attrs)
    attr_bytes = sum(t.nbytes for t in released)
    vocab = VocabRelease()
    if settings.release_vocab_copies:
        vocab = release_unused_vocab_copies(model, loaded.vllm_config)
        for kept in vocab.kept:
            logger.info("vllm-xpu-memfix: vocab copy kept: %s", kept)
    freed = allocator.release_free_memory()
    after = _rss_anon()
    setattr(model, RELEASED, True)
    parts = [
        f"RssAnon {before / MiB:,.0f} -> {after / MiB:,.0f} MiB ({(after - before) / MiB:+,.0f})",
        f"attributes released {len(released)} ({attr_bytes / MiB:,.0f} MiB)",
        *([_vocab_part(vocab)] if vocab.released or vocab.nothing_packed else []),
        f"{freed.allocator} release {'done' if freed.released else 'unavailable'}",
        f"gc {freed.gc_s:.2f} s, trim {freed.trim_s * 1e3:.0f} ms",
    ]
    model_config = getattr(loaded.vllm_config, "model_config", None)
    model_dir = Path(str(getattr(model_config, "model", "")))
    if settings.drop_page_cache and model_dir.is_dir():
        parts.append(f"page cache advised off {drop_page_cache(model_dir) / MiB:,.0f} MiB")
    parts.append(f"total {time.perf_counter() - started:.2f} s")
    return f"vllm-xpu-memfix: rank {loaded.rank} host release: " + "; ".join(parts)


def release_after_load(instance: Any, settings: Settings) -> str | None:
    """The release for one worker, from the worker object."""
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
