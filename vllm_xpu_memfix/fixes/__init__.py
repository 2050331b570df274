"""The fixes, one module each. Each module opens with its record:
Problem / Mechanism / Targets / Switch / Upstream."""

from __future__ import annotations

from types import ModuleType

from vllm_xpu_memfix.config import FIXES, Settings
from vllm_xpu_memfix.fixes import (
    device_quant,
    driver_env,
    host_release,
    kv_headroom,
    ledger,
    warmup_lock,
)
from vllm_xpu_memfix.patching import Patch

# Patches install in this order; on a shared target the later one is outermost, so the
# ledger, last, observes what the other fixes did.
MODULES: dict[str, ModuleType] = {
    module.KEY: module
    for module in (driver_env, warmup_lock, device_quant, host_release, kv_headroom, ledger)
}

assert set(MODULES) == {fix.key for fix in FIXES}, "config.FIXES and fixes.MODULES disagree"


def patches_for(settings: Settings) -> list[Patch]:
    """The patches of every fix the user has not switched off."""
    return [p for key, module in MODULES.items() if settings.requested(key) for p in module.PATCHES]


def activate(settings: Settings) -> None:
    """Per-process start of every requested fix that keeps state (e.g. the ledger)."""
    for key, module in MODULES.items():
        if settings.requested(key) and hasattr(module, "activate"):
            module.activate(settings)


def all_patches() -> list[Patch]:
    return [p for module in MODULES.values() for p in module.PATCHES]
