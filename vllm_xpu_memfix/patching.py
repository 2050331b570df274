"""Guarded, reversible patches applied when their target module is imported.

A :class:`Patch` names its target as ``"package.module:Attr.path"`` and carries a
``wrapt``-style wrapper ``wrapper(wrapped, instance, args, kwargs)``. The
:class:`Patcher` registers a post-import hook for the module, so vLLM modules
are never imported early; a module that is already imported is patched at once.

A target that is missing (vLLM version drift, or a module that only Intel's
images ship) skips that patch with one WARNING naming the symbol and the vLLM
version. Nothing here ever raises into vLLM.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import wrapt

from vllm_xpu_memfix.log import get_logger

logger = get_logger("patching")

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Patch:
    fix: str
    target: str
    wrapper: Wrapper

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr_path(self) -> str:
        return self.target.partition(":")[2]


class State(str, Enum):
    WAITING = "waiting for import"
    APPLIED = "applied"
    SKIPPED = "skipped"
    REVERTED = "reverted"


class _PatchWrapper(wrapt.FunctionWrapper):
    """Marks a wrapper as ours, so a target is never wrapped twice."""


@dataclass
class _Record:
    patch: Patch
    state: State = State.WAITING
    reason: str = ""
    parent: Any = None
    original: Any = None
    inherited: bool = False


def vllm_version() -> str:
    vllm = sys.modules.get("vllm")
    return str(getattr(vllm, "__version__", "unknown"))


class Patcher:
    """Owns a set of patches: installs, applies, reverts and reports them."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def install(self, patch: Patch) -> None:
        """Apply ``patch`` now if its module is loaded, else when it is first imported."""
        if patch.target in self._records:
            return
        self._records[patch.target] = _Record(patch)
        wrapt.register_post_import_hook(lambda _module: self._apply(patch.target), patch.module)

    def _apply(self, target: str) -> None:
        record = self._records.get(target)
        if record is None or record.state is not State.WAITING:
            return
        try:
            parent, attribute, original = wrapt.resolve_path(
                record.patch.module, record.patch.attr_path
            )
        except (AttributeError, ImportError) as exc:
            record.state, record.reason = State.SKIPPED, f"{target} not found ({exc})"
            logger.warning(
                "vllm-xpu-memfix: fix %s skipped: %s is missing in vLLM %s",
                record.patch.fix,
                target,
                vllm_version(),
            )
            return
        if isinstance(original, _PatchWrapper):
            record.state, record.reason = State.SKIPPED, f"{target} is already wrapped"
            return
        record.inherited = isinstance(parent, type) and attribute not in vars(parent)
        wrapt.apply_patch(parent, attribute, _PatchWrapper(original, record.patch.wrapper))
        record.parent, record.original = parent, original
        record.state = State.APPLIED
        logger.debug("vllm-xpu-memfix: fix %s applied to %s", record.patch.fix, target)

    def revert(self, target: str) -> None:
        record = self._records.get(target)
        if record is None or record.state is not State.APPLIED:
            return
        attribute = record.patch.attr_path.rpartition(".")[2]
        if record.inherited:
            delattr(record.parent, attribute)
        else:
            setattr(record.parent, attribute, record.original)
        record.state = State.REVERTED

    def revert_all(self) -> None:
        for target in list(self._records):
            self.revert(target)

    def state(self, target: str) -> tuple[State, str]:
        record = self._records[target]
        return record.state, record.reason

    def states(self) -> dict[str, tuple[str, State, str]]:
        return {t: (r.patch.fix, r.state, r.reason) for t, r in self._records.items()}
