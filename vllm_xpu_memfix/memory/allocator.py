"""Which malloc this process uses, and asking it to give free memory back to the OS.

glibc keeps freed chunks in per-thread arenas; after loading and quantizing
weights that can be gigabytes (SpecForge PR #491: 258 -> 68 GB after
``gc.collect()`` + ``malloc_trim(0)``). tcmalloc and jemalloc keep their own
caches and have their own release calls.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_xpu_memfix.core import files

GLIBC, TCMALLOC, JEMALLOC = "glibc", "tcmalloc", "jemalloc"
# jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena.
_JEMALLOC_PURGE_ALL = b"arena.4096.purge"


def detect(maps_text: str) -> str:
    """The allocator from ``/proc/self/maps``: a preloaded tcmalloc or jemalloc wins over glibc."""
    libraries = {Path(line.split()[-1]).name for line in maps_text.splitlines() if "/" in line}
    if any(name.startswith("libtcmalloc") for name in libraries):
        return TCMALLOC
    if any(name.startswith("libjemalloc") for name in libraries):
        return JEMALLOC
    return GLIBC


def current() -> str:
    try:
        return detect(files.read_text("/proc/self/maps", files.LIST_CAP))
    except OSError:
        return GLIBC


def _release_glibc() -> bool:
    libc = ctypes.CDLL(None)
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def _release_tcmalloc() -> bool:
    release = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
    if release is None:
        return False
    release()
    return True


def _release_jemalloc() -> bool:
    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is None:
        return False
    mallctl.argtypes = [
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    return mallctl(_JEMALLOC_PURGE_ALL, None, None, None, 0) == 0


_RELEASE = {GLIBC: _release_glibc, TCMALLOC: _release_tcmalloc, JEMALLOC: _release_jemalloc}


@dataclass(frozen=True)
class Release:
    allocator: str
    released: bool
    gc_s: float
    empty_cache_s: float
    trim_s: float


def _empty_accelerator_cache() -> None:
    from vllm_xpu_memfix.memory.accelerator import accelerator_backend

    torch = sys.modules.get("torch")
    found = accelerator_backend(torch) if torch is not None else None
    if found is not None:
        found[1].empty_cache()


def trim() -> bool:
    """Only the allocator's release call: cheap (10 to 20 ms), for use between layers."""
    return _RELEASE[current()]()


def release_free_memory() -> Release:
    """``gc.collect()``, the accelerator's ``empty_cache()``, then the allocator's own release."""
    t0 = time.perf_counter()
    gc.collect()
    t1 = time.perf_counter()
    _empty_accelerator_cache()
    t2 = time.perf_counter()
    allocator = current()
    released = _RELEASE[allocator]()
    return Release(allocator, released, t1 - t0, t2 - t1, time.perf_counter() - t2)
