"""Start-up ledger: what each start-up phase of a worker cost.

Problem
    Users of vLLM on Intel GPUs see host RAM fill up during start-up
    (llm-scaler #703, vllm #50269) and cannot tell which phase did it.
Mechanism
    Wraps the worker's start-up methods and logs, per rank, the wall time of
    each phase.
Targets
    ``vllm.v1.worker.gpu_worker:Worker.load_model`` (inherited by XPUWorker and
    CPUWorker).
Switch
    ``VLLM_XPU_MEMFIX_LEDGER`` (auto = on).
Upstream
    None yet; vLLM logs "Model loading took" per rank, without host figures.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_xpu_memfix.log import get_logger
from vllm_xpu_memfix.patching import Patch

logger = get_logger("ledger")

KEY = "ledger"


def _timed_load_model(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    start = time.perf_counter()
    result = wrapped(*args, **kwargs)
    logger.info(
        "vllm-xpu-memfix: rank %s load_model took %.2f s",
        getattr(instance, "rank", "?"),
        time.perf_counter() - start,
    )
    return result


PATCHES = (Patch(KEY, "vllm.v1.worker.gpu_worker:Worker.load_model", _timed_load_model),)
