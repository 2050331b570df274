"""vllm-xpu-memfix: keeps vLLM start-up on Intel GPUs inside host and device memory.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in
every process it starts. It must stay cheap.

The one boundary in this package: everything :func:`register` reaches at import
time (``config``, ``patching``, ``log``, ``process``, ``units``, ``fixes``, and
``driver``, whose sysfs and dpkg reads the driver guard makes at registration)
imports neither torch, vLLM nor psutil. The other fix support (``host_lock``,
``memory``, ``kernels``) is imported inside the wrappers, when a fix acts; the
user tools (``cli``) only by the console script. A test holds the boundary.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patch, Patcher
from vllm_xpu_memfix.core.process import current_role

__version__ = "0.1.0"

PATCHER = Patcher()
_registered = False


def register() -> None:
    """Entry point for ``vllm.general_plugins``. Idempotent.

    Raises :class:`numbers.ConfigError` on an invalid switch value, which stops
    vLLM's start-up with a message naming the variable.
    """
    global _registered
    if _registered:
        return
    settings = config.load()
    config.announce_to_vllm()
    _registered = True
    where = f"pid={os.getpid()} {current_role().describe()}"
    if not settings.enabled:
        _log_once_configured(
            f"vllm-xpu-memfix {__version__} disabled by {config.MASTER.name}=0 ({where})"
        )
        return
    fixes.install_requested(PATCHER, settings)
    enabled = [f.key for f in config.FIXES if settings.requested(f)]
    disabled = [f.key for f in config.FIXES if not settings.requested(f)]
    _log_once_configured(
        f"vllm-xpu-memfix {__version__} registered ({where}): "
        f"fixes on: {', '.join(enabled) or 'none'}; off: {', '.join(disabled) or 'none'}"
    )


def _log_once_configured(line: str) -> None:
    """Log ``line`` now, or right after vLLM configures logging if it has not yet.

    The API server loads plugins while it builds its argument parser, before
    ``vllm.logger.configure_logging`` runs; an INFO line logged then is lost.
    """
    if "vllm.logger" not in sys.modules or logging.getLogger("vllm").handlers:
        get_logger().info(line)
        return

    def log_after(
        wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = wrapped(*args, **kwargs)
        get_logger().info(line)
        return result

    PATCHER.install(Patch("plugin", "vllm.logger:configure_logging", log_after, once=True))
