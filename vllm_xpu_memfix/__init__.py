"""vllm-xpu-memfix: keeps vLLM start-up on Intel GPUs inside host and device memory.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in
every process it starts. It must stay cheap.

The one boundary in this package: everything :func:`register` reaches at import
time (``config``, ``registration``, ``patching``, ``log``, ``process``, ``units``, ``fixes``, and
``driver``, whose sysfs and dpkg reads the driver guard makes at registration)
imports neither torch, vLLM nor psutil. The other fix support (``host_lock``,
``memory``, ``kernels``) is imported inside the wrappers, when a fix acts; the
user tools (``cli``) only by the console script. A test holds the boundary.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core import config, registration
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patcher, log_when_configured
from vllm_xpu_memfix.core.process import current_role, start_identity, starts_the_instance

__version__ = "0.1.0"

PATCHER = Patcher()
_registered = False


def register() -> None:
    """Entry point for ``vllm.general_plugins``. Idempotent.

    A bad variable turns off the fixes that read it, with one ERROR record each, in the
    process that starts vLLM (``core.registration``); it raises
    :class:`numbers.ConfigError`, which stops vLLM's start-up, only under
    ``VLLM_XPU_MEMFIX_PREFLIGHT=refuse``.
    """
    global _registered
    if _registered:
        return
    settings, refused = registration.settings_at_start()
    registration.announce_to_vllm()
    _registered = True
    role = current_role()
    # The role's note (an exception's text) would make the line long: a record of its own.
    where = f"pid={os.getpid()} {dataclasses.replace(role, note=None).describe()}"
    if role.note:
        log_when_configured(get_logger(), logging.INFO, f"vllm-xpu-memfix: role: {role.note}")
    # Said once per start-up: the engine and workers read the same values.
    level = logging.ERROR if starts_the_instance() else logging.DEBUG
    for line in refused:
        log_when_configured(get_logger(), level, f"vllm-xpu-memfix: {line}")
    if not settings.enabled:
        log_when_configured(
            get_logger(),
            logging.INFO,
            f"vllm-xpu-memfix {__version__} disabled by {config.MASTER.name}=0 ({where})",
        )
        return
    start_identity()  # before vLLM starts the engine and workers, which inherit it
    fixes.install_requested(PATCHER, settings)
    enabled = [f.key for f in config.FIXES if settings.requested(f)]
    disabled = [f.key for f in config.FIXES if not settings.requested(f)]
    log_when_configured(
        get_logger(),
        logging.INFO,
        f"vllm-xpu-memfix {__version__} registered ({where}): "
        f"fixes on: {', '.join(enabled) or 'none'}; off: {', '.join(disabled) or 'none'}",
    )
