"""Start-up ledger: where each worker's host memory went, phase by phase.

Problem
    Users of vLLM on Intel GPUs see host RAM fill up during start-up
    (llm-scaler #703, vllm #50269) and cannot tell which of several causes did
    it: a driver-pinned host mirror of device memory that no process owns,
    weight staging, allocator retention, page cache or live references.
Mechanism
    From the moment vLLM builds the worker object, takes a snapshot of kernel
    memory figures (``memory.snapshot``) at each start-up phase: process start,
    weights loaded, weights processed, KV cache sized (with vLLM's byte
    figure), KV cache allocated, warm-up done and ready (the first batch); the
    vLLM process tree's PSS is added at the first and last. At ready each
    worker logs a table and one attribution line naming the likely cause.
    ``VLLM_XPU_MEMFIX_LEDGER_DIR`` also writes every phase as JSON lines. The
    "ready" hook removes itself after the first batch, so nothing stays on the
    per-step path.
Targets
    ``base_loader:process_weights_after_loading`` (module global, called by
    ``BaseModelLoader.load_model``); ``gpu_worker:Worker.__init__``, ``.load_model``,
    ``.determine_available_memory``, ``.initialize_from_config``,
    ``.compile_or_warm_up_model``, ``.execute_model`` (XPUWorker inherits all);
    ``cpu_worker:CPUWorker.determine_available_memory`` and
    ``.compile_or_warm_up_model``, which the CPU worker overrides.
Switch
    ``VLLM_XPU_MEMFIX_LEDGER`` (auto = on); ``VLLM_XPU_MEMFIX_LEDGER_DIR``.
Upstream
    None yet. vLLM logs device figures per rank ("Model loading took", "Available
    KV cache memory") but no host figures.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.config import Settings
from vllm_xpu_memfix.log import get_logger
from vllm_xpu_memfix.patching import Patch
from vllm_xpu_memfix.process import current_role

if TYPE_CHECKING:
    from vllm_xpu_memfix.memory.ledger import Ledger

logger = get_logger("ledger")

KEY = "ledger"
_active = False
_jsonl_dir: Path | None = None
_ledger: Ledger | None = None


def activate(settings: Settings) -> None:
    """Arm this process's ledger.

    A worker records "process start" when vLLM builds the worker object, so
    ``register()`` stays cheap (it imports nothing of the ledger); other
    processes record it here, and only when their JSON lines are wanted.
    """
    global _active, _jsonl_dir
    _active, _jsonl_dir = True, settings.ledger_dir
    if current_role().role != "worker" and settings.ledger_dir is not None:
        _record("process start")


def current() -> Ledger | None:
    global _ledger
    if _ledger is None and _active:
        from vllm_xpu_memfix.memory.ledger import Ledger

        _ledger = Ledger(str(current_role()), _jsonl_dir)
    return _ledger


def _note_rank(instance: Any) -> None:
    ledger = current()
    if ledger is not None and ledger.rank is None:
        rank = getattr(instance, "rank", None)
        if isinstance(rank, int):
            ledger.rank = rank


def _record(phase: str, instance: Any = None, **extra: Any) -> None:
    try:
        ledger = current()
        if ledger is None:
            return
        _note_rank(instance)
        ledger.record(phase, **extra)
        if ledger.write_error:
            logger.warning("vllm-xpu-memfix: ledger: %s; JSON lines disabled", ledger.write_error)
            ledger.write_error, ledger.jsonl_path = None, None
    except Exception:
        # The ledger only observes; it must never break vLLM's start-up.
        logger.exception("vllm-xpu-memfix: ledger could not record phase %r", phase)


def _after_worker_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)  # builds no model; sets the rank
    _record("process start", instance)
    return result


def _around_weight_processing(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
    _record("weights loaded")
    result = wrapped(*args, **kwargs)
    _record("weights processed")
    return result


def _after_load_model(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    _note_rank(instance)
    start = time.perf_counter()
    result = wrapped(*args, **kwargs)
    rank = getattr(instance, "rank", "?")
    logger.info(
        "vllm-xpu-memfix: rank %s load_model took %.2f s", rank, time.perf_counter() - start
    )
    # Loaders that bypass base_loader still get the phase, at the end of load_model.
    _record("weights processed", instance)
    return result


def _after_kv_sizing(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    available = wrapped(*args, **kwargs)
    _record("KV cache sized", instance, kv_cache_bytes=available)
    return available


def _after(phase: str) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        _record(phase, instance)
        return result

    return wrapper


def _at_first_batch(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    _record("ready", instance)
    _report()
    return wrapped(*args, **kwargs)


def _report() -> None:
    ledger = current()
    if ledger is None or not ledger.entries:
        return
    try:
        title = f"vllm-xpu-memfix: host-memory ledger, rank {ledger.rank} ({ledger.role}), MiB"
        logger.info("%s\n%s", title, ledger.table())
        logger.info("vllm-xpu-memfix: rank %s %s", ledger.rank, ledger.summary_line())
    except Exception:
        logger.exception("vllm-xpu-memfix: ledger report failed")


_GPU = "vllm.v1.worker.gpu_worker:Worker"
_CPU = "vllm.v1.worker.cpu_worker:CPUWorker"
PATCHES = (
    Patch(
        KEY,
        "vllm.model_executor.model_loader.base_loader:process_weights_after_loading",
        _around_weight_processing,
    ),
    Patch(KEY, f"{_GPU}.__init__", _after_worker_init),
    Patch(KEY, f"{_GPU}.load_model", _after_load_model),
    Patch(KEY, f"{_GPU}.determine_available_memory", _after_kv_sizing),
    Patch(KEY, f"{_CPU}.determine_available_memory", _after_kv_sizing),
    Patch(KEY, f"{_GPU}.initialize_from_config", _after("KV cache allocated")),
    Patch(KEY, f"{_GPU}.compile_or_warm_up_model", _after("warm-up done")),
    Patch(KEY, f"{_CPU}.compile_or_warm_up_model", _after("warm-up done")),
    Patch(KEY, f"{_GPU}.execute_model", _at_first_batch, once=True),
)
