"""Which accelerator this process has: XPU first, then CUDA (the device test bed)."""

from __future__ import annotations

from typing import Any


def accelerator_backend(torch: Any) -> tuple[str, Any] | None:
    """``("xpu", torch.xpu)`` or ``("cuda", torch.cuda)`` when it has a device, else None."""
    for kind in ("xpu", "cuda"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available():
            return kind, backend
    return None
