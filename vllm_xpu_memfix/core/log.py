"""Logging through vLLM's logger when vLLM is loaded, plain ``logging`` otherwise.

Under vLLM the logger is a child of the ``vllm`` logger, so lines carry vLLM's
format and process prefixes (``(Worker_TP1 pid=...)``).
"""

from __future__ import annotations

import logging
import sys

_FALLBACK_NAME = "vllm_xpu_memfix"


def get_logger(name: str = "") -> logging.Logger:
    suffix = f".{name}" if name else ""
    vllm_logger = sys.modules.get("vllm.logger")
    if vllm_logger is not None:
        return vllm_logger.init_logger(f"vllm.xpu_memfix{suffix}")
    logger = logging.getLogger(_FALLBACK_NAME + suffix)
    root = logging.getLogger(_FALLBACK_NAME)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    return logger
