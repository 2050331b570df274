"""The warm-up lock's wrapper for one fallback warm-up, as the fix installs it."""

from __future__ import annotations

from typing import Any

from vllm_xpu_memfix.fixes import warmup_lock


def one_warm_up(name: str, settings: Any) -> Any:
    """The wrapper ``warmup_lock`` puts around ``kernel_warmup.<name>``."""
    target = f"{warmup_lock.MODULE}:{name}"
    return next(p.wrapper for p in warmup_lock.patches(settings) if p.target == target)
