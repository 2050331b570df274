"""Find host tensors a loaded model still holds, and drop the ones that are staging leftovers.

A model whose weights live on an accelerator should hold no large host tensors
except those it uses on purpose (CPU-offloaded parameters, which are registered).
Plain module attributes holding host tensors (one level of list/tuple/dict
included) are what weight conversion leaves behind (tenstorrent vllm #161;
vllm #36537). Registered parameters and buffers are reported, never released.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_xpu_memfix.core.units import MiB


@dataclass(frozen=True)
class HostTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    registered: bool

    def __str__(self) -> str:
        kind = "registered" if self.registered else "attribute"
        return f"{self.name} {list(self.shape)} {self.dtype} {self.nbytes / MiB:,.1f} MiB ({kind})"


def _describe(name: str, tensor: Any, registered: bool) -> HostTensor:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return HostTensor(name, tuple(tensor.shape), dtype, int(tensor.nbytes), registered)


def _is_host_tensor(value: Any) -> bool:
    device = getattr(value, "device", None)
    return (
        getattr(device, "type", None) == "cpu"
        and hasattr(value, "nbytes")
        and hasattr(value, "shape")
    )


def _attribute_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    """Plain attributes holding tensors, one container level deep; not params or buffers."""
    skip = {"_parameters", "_buffers", "_modules"}
    skip |= set(getattr(module, "_parameters", {})) | set(getattr(module, "_buffers", {}))
    for attr, value in vars(module).items():
        if attr in skip:
            continue
        if _is_host_tensor(value):
            yield attr, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if _is_host_tensor(item):
                    yield f"{attr}[{i}]", item
        elif isinstance(value, dict):
            for key, item in value.items():
                if _is_host_tensor(item):
                    yield f"{attr}[{key!r}]", item


def find_host_tensors(model: Any, min_bytes: int = MiB) -> list[HostTensor]:
    """Host tensors of at least ``min_bytes``, largest first."""
    found: list[HostTensor] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dotted = f"{prefix}." if prefix else ""
        owned = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
        owned += [(n, t, True) for n, t in module.named_buffers(recurse=False)]
        owned += [(n, t, False) for n, t in _attribute_tensors(module)]
        for name, tensor, registered in owned:
            if tensor is None or not _is_host_tensor(tensor) or tensor.nbytes < min_bytes:
                continue
            key = tensor.data_ptr() if hasattr(tensor, "data_ptr") else id(tensor)
            if key in seen:
                continue
            seen.add(key)
            found.append(_describe(dotted + name, tensor, registered))
    return sorted(found, key=lambda t: -t.nbytes)


def release_matching(model: Any, patterns: Sequence[str], min_bytes: int = MiB) -> list[HostTensor]:
    """Delete plain host-tensor attributes whose name matches a pattern (``fnmatch``).

    Returns what was released. Registered parameters and buffers never match.
    """
    released = []
    for prefix, module in model.named_modules():
        dotted = f"{prefix}." if prefix else ""
        for attr, value in list(_attribute_tensors(module)):
            base = attr.split("[", 1)[0]
            if "[" in attr or value.nbytes < min_bytes:
                continue
            if any(
                fnmatch.fnmatchcase(base, p) or fnmatch.fnmatchcase(dotted + base, p)
                for p in patterns
            ):
                released.append(_describe(dotted + attr, value, registered=False))
                delattr(module, base)
    return released
