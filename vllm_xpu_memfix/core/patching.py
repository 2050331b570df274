"""Guarded, reversible patches applied when their target module is imported.

A :class:`Patch` names its target as ``"package.module:Attr.path"`` and carries a
``wrapt``-style wrapper ``wrapper(wrapped, instance, args, kwargs)``. The
:class:`Patcher` registers a post-import hook for the module, so vLLM modules
are never imported early; a module that is already imported is patched at once.

A target that is missing (vLLM version drift, or a module that only Intel's
images ship) skips that patch with one WARNING naming the symbol and the vLLM
version (DEBUG for an ``optional`` one). A patch whose module is not in the installed
vLLM at all, whose post-import hook can therefore never run, says so once at DEBUG when
it is installed. Nothing here ever raises into vLLM.
"""

from __future__ import annotations

import functools
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from vllm_xpu_memfix.core.log import get_logger

logger = get_logger("patching")

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Patch:
    """``wrapper`` around ``target``; a ``once`` patch removes itself after its first call.

    ``params`` names the target's leading parameters (after ``self``) that the wrapper
    reads; ``vllm-xpu-memfix check`` reports a target whose parameters differ. An
    ``optional`` target is one that only some layouts of its module define: its absence
    is logged at DEBUG, not as a WARNING. A ``once`` patch with ``counts`` passes calls
    through untouched until ``counts()`` is true (the ledger's "ready" skips the
    warm-up's own calls of ``execute_model``). An ``own_only`` patch of a method is
    applied only where the class defines that method itself, never on an inherited one
    (``overrides``: a platform worker's own version of a ``Worker`` method). Optional
    patches of one fix that share a ``group`` are one hook at the place each release
    line has it (``build_and_serve`` moved module in vLLM 0.29): ``check --strict`` wants
    one of them present, not each.
    """

    fix: str
    target: str
    wrapper: Wrapper
    once: bool = False
    params: tuple[str, ...] = ()
    optional: bool = False
    counts: Callable[[], bool] | None = None
    own_only: bool = False
    group: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.fix, self.target)

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr_path(self) -> str:
        return self.target.partition(":")[2]


@dataclass(frozen=True)
class RemoveWhen:
    """The upstream change that makes a fix redundant, in a form ``check`` evaluates.

    The change has landed when the source of ``module`` (a vLLM module, or Intel's
    ``sym_int4``) contains any of ``markers``. An empty ``module`` means the change
    belongs outside vLLM (e.g. in Intel's driver), where the fix's ``auto`` mode
    decides at every start instead.
    """

    change: str
    module: str = ""
    markers: tuple[str, ...] = ()

    def evaluate(self, source_of: Callable[[str], str | None]) -> str:
        """One line for ``check``, given a reader of a module's source (None: no module)."""
        if not self.module:
            return "outside vLLM; auto decides at every start"
        source = source_of(self.module)
        if source is None:
            return f"{self.module} absent"
        found = [marker for marker in self.markers if marker in source]
        return f"landed ({found[0]!r} in {self.module})" if found else "not yet upstream"


class State(str, Enum):
    WAITING = "waiting for import"
    APPLIED = "applied"
    SKIPPED = "skipped"
    REVERTED = "reverted"


@functools.cache
def _patch_wrapper() -> Any:
    """The wrapper class, made on first use: wrapt (and the asyncio it imports) is a
    tenth of a second that doctor and the other commands, which patch nothing, skip."""
    import wrapt

    class _PatchWrapper(wrapt.FunctionWrapper):
        """Marks a wrapper as ours and remembers which patch made it."""

        def __init__(self, wrapped: Any, wrapper: Wrapper, key: tuple[str, str]) -> None:
            super().__init__(wrapped, wrapper)
            self._self_patch_key = key

    return _PatchWrapper


def __getattr__(name: str) -> Any:
    if name == "_PatchWrapper":
        return _patch_wrapper()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _wrapped_by(obj: Any, key: tuple[str, str]) -> bool:
    """Whether ``obj`` or anything it wraps is the wrapper of patch ``key``."""
    seen = 0
    while isinstance(obj, _patch_wrapper()) and seen < 64:
        if obj._self_patch_key == key:
            return True
        obj, seen = obj.__wrapped__, seen + 1
    return False


@dataclass
class _Record:
    patch: Patch
    state: State = State.WAITING
    reason: str = ""
    parent: Any = None
    original: Any = None
    inherited: bool = False


def module_absent(name: str) -> bool:
    """Whether module ``name`` is certainly not there to import: its top-level package is
    imported and no directory of it holds ``name``. Found without importing anything;
    False wherever that cannot be told (the package not imported yet, a module that is
    not files on disk)."""
    if name in sys.modules:
        return False
    top, *parts = name.split(".")
    paths = getattr(sys.modules.get(top), "__path__", None)
    found = top
    for part in parts:
        if paths is None:
            return False
        found = f"{found}.{part}"
        loaded = sys.modules.get(found)
        if loaded is not None:
            paths = getattr(loaded, "__path__", None)
            continue
        spec = importlib.machinery.PathFinder.find_spec(found, list(paths))
        if spec is None:
            return True
        paths = spec.submodule_search_locations
    return False


def vllm_version() -> str:
    vllm = sys.modules.get("vllm")
    return str(getattr(vllm, "__version__", "unknown"))


class Patcher:
    """Owns a set of patches: installs, applies, reverts and reports them."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, str], _Record] = {}

    def install(self, patch: Patch) -> None:
        """Apply ``patch`` now if its module is loaded, else when it is first imported.

        Patches of different fixes on one target stack; the one installed last
        is outermost.
        """
        if patch.key in self._records:
            return
        record = self._records[patch.key] = _Record(patch)
        if module_absent(patch.module):
            # The hook stays registered, should another finder supply the module.
            record.reason = f"module {patch.module} is not in vLLM {vllm_version()}"
            logger.debug(
                "vllm-xpu-memfix: fix %s: %s will not be patched: %s",
                patch.fix,
                patch.target,
                record.reason,
            )
        import wrapt

        wrapt.register_post_import_hook(lambda _module: self._apply(patch.key), patch.module)

    def install_all(self, patches: tuple[Patch, ...]) -> None:
        for patch in patches:
            self.install(patch)

    def _apply(self, key: tuple[str, str]) -> None:
        record = self._records.get(key)
        if record is None or record.state is not State.WAITING:
            return
        target = record.patch.target
        import wrapt

        try:
            parent, attribute, original = wrapt.resolve_path(
                record.patch.module, record.patch.attr_path
            )
        except (AttributeError, ImportError) as exc:
            record.state, record.reason = State.SKIPPED, f"{target} not found ({exc})"
            log = logger.debug if record.patch.optional else logger.warning
            log(
                "vllm-xpu-memfix: fix %s skipped: %s is missing in vLLM %s",
                record.patch.fix,
                target,
                vllm_version(),
            )
            return
        if record.patch.own_only and attribute not in vars(parent):
            record.state, record.reason = State.SKIPPED, f"{target} is inherited, not overridden"
            logger.debug("vllm-xpu-memfix: fix %s: %s", record.patch.fix, record.reason)
            return
        if _wrapped_by(original, key):
            record.state, record.reason = State.SKIPPED, f"{target} is already wrapped by this fix"
            return
        record.inherited = isinstance(parent, type) and attribute not in vars(parent)
        wrapper = self._once(record.patch) if record.patch.once else record.patch.wrapper
        wrapt.apply_patch(parent, attribute, _patch_wrapper()(original, wrapper, key))
        record.parent, record.original = parent, original
        record.state, record.reason = State.APPLIED, ""
        logger.debug("vllm-xpu-memfix: fix %s applied to %s", record.patch.fix, target)

    def _once(self, patch: Patch) -> Wrapper:
        """The wrapper runs on the first call only, whether or not it can be reverted after.

        Revert refuses while a foreign wrapper sits outside ours; the flag keeps the patch
        inert then, so a once-hook never fires on every call.
        """
        fired = False

        def run_once(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            nonlocal fired
            if fired or (patch.counts is not None and not patch.counts()):
                return wrapped(*args, **kwargs)
            fired = True
            try:
                return patch.wrapper(wrapped, instance, args, kwargs)
            finally:
                self.revert(patch.key)

        return run_once

    def revert(self, key: tuple[str, str]) -> None:
        """Put the original back, if this patch's wrapper is still the outermost one.

        A patch still waiting for its module's import is cancelled instead.
        """
        record = self._records.get(key)
        if record is not None and record.state is State.WAITING:
            # Its module is not imported yet: the post-import hook stays registered with
            # wrapt, so mark the patch done for it to find.
            record.state, record.reason = State.REVERTED, "cancelled before its module was imported"
            return
        if record is None or record.state is not State.APPLIED:
            return
        attribute = record.patch.attr_path.rpartition(".")[2]
        current = vars(record.parent).get(attribute)
        if not (isinstance(current, _patch_wrapper()) and current._self_patch_key == key):
            record.reason = "not reverted: wrapped again by another patch"
            return
        if record.inherited:
            delattr(record.parent, attribute)
        else:
            setattr(record.parent, attribute, record.original)
        record.state = State.REVERTED

    def revert_all(self, fix: str | None = None) -> None:
        """Revert every patch, or those of ``fix``, newest first."""
        for key in reversed(list(self._records)):
            if fix is None or key[0] == fix:
                self.revert(key)

    def state(self, key: tuple[str, str]) -> tuple[State, str]:
        record = self._records[key]
        return record.state, record.reason

    def states(self) -> dict[tuple[str, str], tuple[State, str]]:
        return {k: (r.state, r.reason) for k, r in self._records.items()}


_AFTER_CONFIGURE = Patcher()
_CONFIGURE_KEY = ("plugin", "vllm.logger:configure_logging")
_PENDING: list[tuple[logging.Logger, int, str]] = []


def _log_pending(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    pending = list(_PENDING)
    _PENDING.clear()
    for logger_, level, message in pending:
        logger_.log(level, message)
    return result


def log_when_configured(logger_: logging.Logger, level: int, message: str) -> None:
    """Log now where a handler takes the record, else right after vLLM configures logging.

    The API server loads plugins while it builds its argument parser, before
    ``vllm.logger.configure_logging`` runs: a record logged then is lost below WARNING
    and printed without vLLM's prefix above it.
    """
    hook = _AFTER_CONFIGURE.states().get(_CONFIGURE_KEY, (State.APPLIED, ""))[0]
    if logger_.hasHandlers() or "vllm.logger" not in sys.modules or hook is not State.APPLIED:
        # configured, plain logging, or vLLM's hook already ran; shown at the caller's line
        logger_.log(level, message, stacklevel=2)
        return
    _PENDING.append((logger_, level, message))
    _AFTER_CONFIGURE.install(Patch(*_CONFIGURE_KEY, _log_pending, once=True))
    if _AFTER_CONFIGURE.state(_CONFIGURE_KEY)[0] is not State.APPLIED:  # no such function
        _log_pending(lambda: None, None, (), {})
