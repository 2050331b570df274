"""Platform workers that override the ``Worker`` methods the fixes patch.

The fixes patch ``vllm.v1.worker.gpu_worker:Worker``; upstream ``XPUWorker`` (0.26 to
0.34) inherits every method they patch. A platform's own worker class may not:
Intel's 0.14-based patch gave ``XPUWorker`` its own ``determine_available_memory``
without ``super()`` (llm-scaler ``vllm/patches/vllm_for_multi_arc.patch``, tag
``vllm-0.14.0-b8.3.2``), and vLLM's ``CPUWorker`` overrides
``determine_available_memory`` and ``compile_or_warm_up_model``. A patch on
``Worker`` never sees such an override. So each ``Worker`` method patch also wraps
the method where a platform worker defines it itself, and both wrappers share a guard:
an override that calls ``super()`` reaches the fix once, in the outermost call.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from vllm_xpu_memfix.core.patching import Patch, Wrapper

WORKER = "vllm.v1.worker.gpu_worker:Worker"
# The platform worker classes of upstream vLLM that subclass Worker (module:class).
PLATFORM_WORKERS = (
    "vllm.v1.worker.xpu_worker:XPUWorker",
    "vllm.v1.worker.cpu_worker:CPUWorker",
)
INHERITS = "inherits"
CALLS_SUPER = "overrides, calls super()"
WITHOUT_SUPER = "overrides without super()"
ABSENT = "absent"


def _worker_method(target: str) -> str | None:
    prefix = WORKER + "."
    return target[len(prefix) :] if target.startswith(prefix) else None


def _acts_once(wrapper: Wrapper) -> Wrapper:
    """``wrapper`` for the outermost of nested calls in one thread; inner calls (an
    override's ``super()``) pass straight through."""
    active = threading.local()

    def outermost(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if getattr(active, "inside", False):
            return wrapped(*args, **kwargs)
        active.inside = True
        try:
            return wrapper(wrapped, instance, args, kwargs)
        finally:
            active.inside = False

    return outermost


def with_platform_overrides(patches: tuple[Patch, ...]) -> tuple[Patch, ...]:
    """``patches``, plus a patch of each ``Worker`` method on every platform worker that
    defines that method itself (applied only there: ``own_only``), sharing a guard."""
    explicit = {patch.key for patch in patches}
    extended: list[Patch] = []
    derived: list[Patch] = []
    for patch in patches:
        method = _worker_method(patch.target)
        if method is None:
            extended.append(patch)
            continue
        guarded = dataclasses.replace(patch, wrapper=_acts_once(patch.wrapper))
        extended.append(guarded)
        for worker in PLATFORM_WORKERS:
            target = f"{worker}.{method}"
            if (patch.fix, target) not in explicit:
                derived.append(
                    dataclasses.replace(guarded, target=target, optional=True, own_only=True)
                )
    return (*extended, *derived)


def _defined_methods(source: str, cls: str) -> dict[str, bool] | None:
    """The methods ``cls`` defines in ``source``, each with whether it calls ``super()``;
    None when the class is not there."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                item.name: any(
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id == "super"
                    for call in ast.walk(item)
                )
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return None


def scan(methods: list[str], source_of: Callable[[str], str | None]) -> list[tuple[str, str, str]]:
    """``(worker, method, kind)`` for every platform worker and patched ``Worker`` method,
    read from source (``source_of(module)`` is None where the module is absent)."""
    rows = []
    for worker in PLATFORM_WORKERS:
        module, _, cls = worker.partition(":")
        source = source_of(module)
        defined = None if source is None else _defined_methods(source, cls)
        for method in methods:
            if defined is None:
                kind = ABSENT
            elif method not in defined:
                kind = INHERITS
            else:
                kind = CALLS_SUPER if defined[method] else WITHOUT_SUPER
            rows.append((worker, method, kind))
    return rows


def patched_worker_methods(patches: list[Patch]) -> list[str]:
    found: dict[str, None] = {}
    for patch in patches:
        method = _worker_method(patch.target)
        if method is not None:
            found.setdefault(method)
    return list(found)
