"""Warm-up lock: one rank at a time JIT-compiles the per-process Triton warm-ups.

Problem
    Every TP rank of a host starts vLLM's Qwen Triton warm-up in the same
    second (llm-scaler #703); Triton and LLVM compilation cost host RAM in each
    process, and several vLLM instances on one box add up.
Mechanism
    Holds a slot of a host-wide counting semaphore of file locks (``host_lock``)
    over the whole process-local section of vLLM's ``kernel_warmup``: from its
    start (the JIT registry's compile, the Qwen/mamba/Kimi warm-ups, whatever a
    release puts there) to its ``if process_local_only: return``, where what
    follows may run collectives. The slot is given back exactly when vLLM
    evaluates that flag: the wrapper passes a stand-in whose truth test releases
    it. It does so only where the source has that shape (``warmup_section``:
    a keyword-only flag, read once, as a bare ``if ...: return``); vLLM relies on
    the same property, since elastic EP runs that section alone on new workers
    (``process_local_only=True``). Where the shape is absent (vLLM 0.26) the
    lock falls back to wrapping ``ALLOWED``, the warm-ups known to be
    process-local, one at a time. A rank that waits finds the kernels already
    compiled when the ranks share a Triton cache (eager mode). Whatever fails on
    the plugin's side (an unusable lock directory, an entry in it that is not a
    regular file, anything else) is logged in one line and the warm-up runs
    unlocked; the warm-up's own exceptions pass through unchanged.
Targets
    ``vllm.v1.worker.gpu_worker:kernel_warmup`` and
    ``vllm.distributed.elastic_ep.elastic_execute:kernel_warmup`` (the bindings
    its callers use); the fallback's
    ``vllm.model_executor.warmup.kernel_warmup:qwen_triton_warmup``,
    ``vllm.model_executor.warmup.kernel_warmup:qwen_vl_triton_warmup``,
    ``vllm.model_executor.warmup.kernel_warmup:mamba_triton_warmup`` (module
    attributes, imported from their own modules), which step aside while the
    section's slot is held. The elastic EP binding (from 0.27) and the last two
    warm-ups (0.30 to 0.33; 0.34 has no ``mamba_triton_warmup``) are optional: a
    release without them has nothing there to serialise.
Switch
    ``VLLM_XPU_MEMFIX_WARMUP_LOCK`` (auto: on, except where the rank compiles into
    its own Triton cache, i.e. vLLM's compiled mode: measured, waiting then saves
    nothing and costs start-up time); ``VLLM_XPU_MEMFIX_WARMUP_SLOTS``,
    ``_WARMUP_TIMEOUT_S``, ``_WARMUP_SCOPE`` (host | instance), ``_LOCK_DIR``.
Upstream
    A small change to ``kernel_warmup``: hold a node-local lock around the
    process-local JIT section; see docs/design/warmup-lock.md.
Remove when
    ``kernel_warmup`` takes a node-local file lock itself (it mentions ``FileLock``,
    ``flock``, or ``take_warmup_turn`` as the withdrawn patch 0004 named it; now
    docs/upstream/rfc-0004-serialized-eager-warm-ups.md).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import textwrap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.log import get_logger, listed
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.vllm_code import warmup_section

if TYPE_CHECKING:  # imported where used: registration must stay cheap
    from vllm_xpu_memfix.core.host_lock import Holding, HostSemaphore

logger = get_logger("warmup_lock")

FIX = config.WARMUP_LOCK
_RANK_DIR = re.compile(r"[/\\]rank_\d+_\d+[/\\]")
MODULE = "vllm.model_executor.warmup.kernel_warmup"
# Process-local JIT warm-ups only: no collective runs inside any of them. The fallback
# where kernel_warmup has no process_local_only section (vLLM 0.26).
ALLOWED = ("qwen_triton_warmup", "qwen_vl_triton_warmup", "mamba_triton_warmup")
# Not in every release (docs/compat.md): both came in 0.30; 0.34 dropped mamba_triton_warmup.
SOME_RELEASES = ("qwen_vl_triton_warmup", "mamba_triton_warmup")
# Where kernel_warmup is called from: the worker's warm-up, and elastic EP's new workers.
SECTION_TARGETS = (
    "vllm.v1.worker.gpu_worker:kernel_warmup",
    "vllm.distributed.elastic_ep.elastic_execute:kernel_warmup",
)
REMOVE_WHEN = RemoveWhen(
    "kernel_warmup can serialise its process-local section itself (upstream RFC 0004)",
    MODULE,
    ("FileLock", "flock", "take_warmup_turn"),
)


def semaphore(settings: Settings) -> HostSemaphore:
    from vllm_xpu_memfix.core.host_lock import HostSemaphore, scoped_name

    name = scoped_name("warmup", settings.warmup_scope)
    return HostSemaphore(settings.lock_dir, name, settings.warmup_slots)


def per_rank_triton_cache(environ: Mapping[str, str]) -> str | None:
    """The Triton cache directory if it is this rank's own, else ``None``.

    In compiled mode vLLM points ``TRITON_CACHE_DIR`` into the rank's compile
    cache (``.../rank_<rank>_<dp_rank>/triton_cache``); eager mode leaves
    Triton's shared default.
    """
    cache = environ.get("TRITON_CACHE_DIR", "")
    return cache if _RANK_DIR.search(cache) else None


def _take_slot(name: str, settings: Settings) -> tuple[HostSemaphore, Holding] | None:
    """This rank's slot, or None (logged) when the warm-up runs without one. Raises nothing:
    whatever goes wrong on the plugin's side must not reach vLLM."""
    try:
        own_cache = per_rank_triton_cache(os.environ)
        if own_cache and settings.mode(FIX) is Mode.AUTO:
            # Measured on an H200 (docs/fixes.md, warmup_lock): with per-rank caches every rank
            # compiles anyway and keeps what it compiled, so waiting saves no memory.
            logger.info(
                "vllm-xpu-memfix: warm-up lock not used for %s: this rank compiles into its own "
                "Triton cache (%s), so waiting saves no host memory (%s=on forces the lock)",
                name,
                own_cache,
                FIX.env,
            )
            return None
        lock = semaphore(settings)
        holding = lock.acquire(settings.warmup_timeout_s)
    except Exception as exc:
        logger.error("vllm-xpu-memfix: warm-up lock unusable, %s runs unlocked: %s", name, exc)
        return None
    if not holding.acquired:
        logger.warning(
            "vllm-xpu-memfix: warm-up lock: gave up after %.1f s waiting for %s; "
            "running %s without the lock (%s)",
            holding.waited_s,
            holding.waited_for,
            name,
            config.variable_for("warmup_timeout_s").name,
        )
        return None
    return lock, holding


def _give_back(name: str, taken: tuple[HostSemaphore, Holding]) -> None:
    lock, holding = taken
    try:
        lock.release(holding)
    except Exception as exc:
        logger.error("vllm-xpu-memfix: warm-up lock: releasing the slot after %s: %s", name, exc)
        return
    whom = f" for {holding.waited_for}" if holding.waited_for else ""
    logger.info(
        "vllm-xpu-memfix: warm-up lock: %s waited %.1f s%s, held %.1f s",
        name,
        holding.waited_s,
        whom,
        holding.held_s,
    )


class _SectionEnd:
    """Stands in for ``process_local_only``: vLLM evaluates it once, at the
    ``if process_local_only: return`` that ends the process-local section, and that
    evaluation gives the slot back before anything after it can run a collective."""

    def __init__(self, value: bool, at_end: Any) -> None:
        self.value = value
        self.at_end = at_end

    def __bool__(self) -> bool:
        self.at_end()
        return self.value


def patches(settings: Settings) -> tuple[Patch, ...]:
    section_held: list[bool] = []  # non-empty while this process holds the section's slot

    @functools.cache
    def section(function: Any) -> warmup_section.Section:
        try:
            source = inspect.getsource(inspect.unwrap(function))
        except (OSError, TypeError) as exc:
            found = warmup_section.Section((), f"its source cannot be read ({exc})")
        else:
            found = warmup_section.process_local_section(textwrap.dedent(source))
        if found.usable:
            logger.info(
                "vllm-xpu-memfix: warm-up lock covers kernel_warmup's process-local section "
                "(%d calls)",
                len(found.calls),
            )
            logger.debug("vllm-xpu-memfix: warm-up lock: its calls: %s", listed(found.calls, 250))
        else:
            logger.info(
                "vllm-xpu-memfix: warm-up lock covers %s only: %s",
                ", ".join(ALLOWED),
                found.why_not,
            )
        return found

    def whole_section(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        if section_held or not section(wrapped).usable:
            return wrapped(*args, **kwargs)
        name = "kernel_warmup's process-local section"
        taken = _take_slot(name, settings)
        if taken is None:
            return wrapped(*args, **kwargs)
        section_held.append(True)

        def give_back() -> None:
            if section_held:
                section_held.clear()
                _give_back(name, taken)

        flag = bool(kwargs.pop(warmup_section.FLAG, False))
        try:
            return wrapped(*args, **{warmup_section.FLAG: _SectionEnd(flag, give_back)}, **kwargs)
        finally:
            give_back()

    def one_warm_up(name: str) -> Any:
        def wrapper(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
            taken = None if section_held else _take_slot(name, settings)
            if taken is None:
                return wrapped(*args, **kwargs)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _give_back(name, taken)

        return wrapper

    return (
        *(Patch(FIX.key, target, whole_section, optional=True) for target in SECTION_TARGETS),
        *(
            Patch(FIX.key, f"{MODULE}:{name}", one_warm_up(name), optional=name in SOME_RELEASES)
            for name in ALLOWED
        ),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(patches(settings))
