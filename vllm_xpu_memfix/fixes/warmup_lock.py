"""Warm-up lock: one rank at a time JIT-compiles the per-process Triton warm-ups.

Problem
    Every TP rank of a host starts vLLM's Qwen Triton warm-up in the same
    second (llm-scaler #703); Triton and LLVM compilation cost host RAM in each
    process, and several vLLM instances on one box add up.
Mechanism
    Wraps the process-local JIT warm-ups that
    ``vllm.model_executor.warmup.kernel_warmup.kernel_warmup`` calls, by their
    names in that module, in a host-wide counting semaphore of file locks
    (``host_lock``). A rank that waits finds the kernels already compiled when
    the ranks share a Triton cache (eager mode). Nothing that runs a collective
    is ever wrapped: a rank blocked on a host lock while its peers wait in an
    all-reduce would deadlock. ``ALLOWED`` is that explicit list; each name is
    called in ``kernel_warmup`` before its ``if process_local_only: return``.
    Whatever fails on the plugin's side (an unusable lock directory, an entry in it
    that is not a regular file, anything else) is logged in one line and the warm-up
    runs unlocked; the warm-up's own exceptions pass through unchanged.
Targets
    ``vllm.model_executor.warmup.kernel_warmup:qwen_triton_warmup``,
    ``vllm.model_executor.warmup.kernel_warmup:qwen_vl_triton_warmup``,
    ``vllm.model_executor.warmup.kernel_warmup:mamba_triton_warmup`` (module
    attributes, imported from their own modules).
Switch
    ``VLLM_XPU_MEMFIX_WARMUP_LOCK`` (auto: on, except where the rank compiles into
    its own Triton cache, i.e. vLLM's compiled mode: measured, waiting then saves
    nothing and costs start-up time); ``VLLM_XPU_MEMFIX_WARMUP_SLOTS``,
    ``_WARMUP_TIMEOUT_S``, ``_WARMUP_SCOPE`` (host | instance), ``_LOCK_DIR``.
Upstream
    A small change to ``kernel_warmup``: hold a node-local lock around the
    process-local JIT section; see docs/upstream/warmup-lock.md.
Remove when
    ``kernel_warmup`` takes a node-local file lock itself (it mentions ``FileLock``
    or ``flock``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix import config
from vllm_xpu_memfix.config import Mode, Settings
from vllm_xpu_memfix.log import get_logger
from vllm_xpu_memfix.patching import Patch, Patcher, RemoveWhen

if TYPE_CHECKING:  # imported where used: registration must stay cheap
    from vllm_xpu_memfix.host_lock import Holding, HostSemaphore

logger = get_logger("warmup_lock")

FIX = config.WARMUP_LOCK
_RANK_DIR = re.compile(r"[/\\]rank_\d+_\d+[/\\]")
MODULE = "vllm.model_executor.warmup.kernel_warmup"
# Process-local JIT warm-ups only: no collective runs inside any of them.
ALLOWED = ("qwen_triton_warmup", "qwen_vl_triton_warmup", "mamba_triton_warmup")
REMOVE_WHEN = RemoveWhen(
    "kernel_warmup holds a node-local lock around its process-local JIT section",
    MODULE,
    ("FileLock", "flock"),
)


def semaphore(settings: Settings) -> HostSemaphore:
    from vllm_xpu_memfix.host_lock import HostSemaphore, scoped_name

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
            # Measured on an H200 (docs/warmup-lock.md): with per-rank caches every rank
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


def _serialised(name: str, settings: Settings) -> Any:
    def wrapper(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        taken = _take_slot(name, settings)
        if taken is None:
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _give_back(name, taken)

    return wrapper


def patches(settings: Settings) -> tuple[Patch, ...]:
    return tuple(
        Patch(FIX.key, f"{MODULE}:{name}", _serialised(name, settings)) for name in ALLOWED
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(patches(settings))
