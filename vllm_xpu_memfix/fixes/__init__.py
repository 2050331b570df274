"""The fixes, one module each, all of one shape. A fix imports only ``core``,
``vllm_code``, ``intel``, ``memory`` and ``kernels``, never another fix; ``register()``
and the CLI use them.

Each module opens with its record (Problem / Mechanism / Targets / Switch / Upstream /
Remove when) and defines:

``FIX``
    its row in ``config`` (key, switch variable, summary, what ``auto`` means);
``REMOVE_WHEN``
    the upstream change that makes it redundant, which ``check`` evaluates;
``patches(settings)``
    its patches, with the settings closed over by the wrappers; building them has no
    side effect, so ``check`` and the tests can list them;
``install(patcher, settings)``
    installs those patches and does any work the fix needs at registration.

Nothing is kept in module globals: whatever state a fix needs lives in the closures
that ``install`` creates. :func:`uninstall` reverts a fix's patches.

To add a fix: copy a module, add its ``Fix`` row to ``config.FIXES`` and the module to
``MODULES`` below.
"""

from __future__ import annotations

from types import ModuleType

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.patching import Patch, Patcher
from vllm_xpu_memfix.fixes import (
    device_quant,
    driver_env,
    host_release,
    kv_headroom,
    ledger,
    load_lock,
    preflight,
    warmup_lock,
)
from vllm_xpu_memfix.vllm_code.overrides import with_platform_overrides

# Installed in this order; on a shared target the later one is outermost, so the
# ledger, last, observes what the other fixes did.
MODULES: tuple[ModuleType, ...] = (
    driver_env,
    warmup_lock,
    load_lock,
    device_quant,
    host_release,
    kv_headroom,
    ledger,
    preflight,
)


def module_of(fix: config.Fix) -> ModuleType:
    return next(module for module in MODULES if module.FIX is fix)


def install_requested(patcher: Patcher, settings: Settings) -> None:
    """Install every fix the user has not switched off."""
    for module in MODULES:
        if settings.requested(module.FIX):
            module.install(patcher, settings)


def uninstall(module: ModuleType, patcher: Patcher) -> None:
    patcher.revert_all(fix=module.FIX.key)


def patches_of(module: ModuleType, settings: Settings) -> tuple[Patch, ...]:
    """What ``module.install`` installs: its patches, and for each patched ``Worker``
    method the platform workers' own overrides of it (``overrides``)."""
    return with_platform_overrides(module.patches(settings))


def all_patches(settings: Settings | None = None) -> list[Patch]:
    """Every fix's patches as installed, built with ``settings`` (default: the defaults)."""
    settings = settings or config.load({})
    return [patch for module in MODULES for patch in patches_of(module, settings)]
