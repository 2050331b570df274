"""A Ray actor that stands in for one of vLLM's Ray workers (imported by the Ray workers).

vLLM 0.32's RayExecutorV2 starts each rank as a named actor in a fresh Ray worker
process; the worker resolves vLLM's platform (on XPU: starts the Intel driver), may
receive the driver's environment, and only then calls ``load_general_plugins()``
(v1/executor/ray_executor_v2.py, RayWorkerProc.initialize_worker). :meth:`register`
replays that order, with a stand-in shared object for the driver.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import time
from types import SimpleNamespace
from typing import Any

GUARD = ("NEOReadDebugKeys", "EnableDeferBacking")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "xpu_memfix" in record.name:
            self.lines.append(f"{record.levelname} {record.getMessage()}")


class VllmWorkerStandIn:
    def __init__(self) -> None:
        self.log = _Lines()

    def register(
        self, driver_library: str | None = None, late_env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging, init_logger

        configure_logging(LoggingConfig())  # as RayWorkerProc.__init__ does
        init_logger("vllm").addHandler(self.log)  # the plugin logs under vLLM's logger
        if driver_library:
            ctypes.CDLL(driver_library)  # as the platform probe maps Level Zero's driver
        if late_env:
            for key, value in late_env.items():
                os.environ.setdefault(key, value)  # as RayExecutorV2 applies the driver's env
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        import vllm_xpu_memfix
        from vllm_xpu_memfix.core.host_lock import scoped_name
        from vllm_xpu_memfix.core.process import current_role

        return {
            "pid": os.getpid(),
            "plugin": vllm_xpu_memfix.__file__,
            "role": current_role().role,
            "lines": list(self.log.lines),
            "env": {k: os.environ.get(k) for k in GUARD},
            "warmup_lock": scoped_name("warmup", "instance"),
        }

    def warm_up(self, go_at: float, hold_s: float) -> dict[str, Any]:
        """vLLM's real, plugin-wrapped ``qwen_triton_warmup``, started at ``go_at``."""
        import vllm.model_executor.warmup.kernel_warmup as kernel_warmup

        times: dict[str, float] = {}

        class Runner:
            max_num_tokens = 8
            is_pooling_model = False

            @property
            def device(self) -> str:  # read first: the section starts
                times["start"] = time.time()
                time.sleep(hold_s)
                return "cpu"

            @property
            def compilation_config(self) -> Any:  # read last
                times["end"] = time.time()
                return SimpleNamespace(static_forward_context={})

        text = SimpleNamespace(model_type="qwen3_5_text")
        config = SimpleNamespace(hf_text_config=text, hf_config=text, dtype=None)
        self.log.lines.clear()
        time.sleep(max(0.0, go_at - time.time()))
        kernel_warmup.qwen_triton_warmup(Runner(), config)
        return {**times, "pid": os.getpid(), "lines": list(self.log.lines)}

    def process_weights(self) -> list[str]:
        """One pass through vLLM's (ledger-wrapped) weight processing of an empty model."""
        import torch
        from vllm.model_executor.model_loader import base_loader

        model_config = SimpleNamespace(
            dtype=torch.float32, word_embeddings_untied_by_checkpoint=False, quantization=None
        )
        base_loader.process_weights_after_loading(
            torch.nn.Module(), model_config, torch.device("cpu")
        )
        return sorted(glob.glob(os.path.join(os.environ["VLLM_XPU_MEMFIX_LEDGER_DIR"], "*")))
