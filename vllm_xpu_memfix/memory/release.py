"""The host release of one rank's model after loading: what host_release does at the end
of ``load_model`` and the load lock inside its section, before the next rank loads.

Gives back what loading left on the host: attributes the settings name, the CPU
backend's unused vocabulary copies, the allocator's free memory (gc, then a trim), and
where asked the page cache of the checkpoint's shards. Imports torch only when called.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.units import MiB

if TYPE_CHECKING:
    from vllm_xpu_memfix.memory.vocab_copies import VocabRelease

logger = get_logger("host_release")

# Set on a model once released, so a second release (after the load lock did it) is skipped.
RELEASED = "_vllm_xpu_memfix_host_released"


def _rss_anon() -> int:
    from vllm_xpu_memfix.memory.snapshot import take_self

    return take_self(pss=False).rss_anon or 0


def drop_page_cache(directory: Path) -> int:
    """``POSIX_FADV_DONTNEED`` on every safetensors shard; returns the bytes advised."""
    advised = 0
    for shard in sorted(directory.glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return advised


def _vocab_part(vocab: VocabRelease) -> str:
    if vocab.released:
        return f"unused vocab copies released {len(vocab.released)} ({vocab.nbytes / MiB:,.0f} MiB)"
    return f"no unused vocab copies: {vocab.nothing_packed}"


@dataclass(frozen=True)
class LoadedModel:
    """A model right after loading, with what the release needs to know about its rank."""

    model: Any
    vllm_config: Any
    on_device: bool
    rank: Any


def release_loaded_model(loaded: LoadedModel, settings: Settings) -> str | None:
    """Do the release for one rank's model; returns the log line, or None when this model
    was released already (the load lock does it inside its section, before the next rank
    starts loading)."""
    from vllm_xpu_memfix.memory import allocator, audit
    from vllm_xpu_memfix.memory.vocab_copies import VocabRelease, release_unused_vocab_copies

    model = loaded.model
    if getattr(model, RELEASED, False):
        return None
    started = time.perf_counter()
    before = _rss_anon()
    if loaded.on_device:
        for leftover in audit.find_host_tensors(model)[:5]:
            logger.info("vllm-xpu-memfix: host tensor still held after loading: %s", leftover)
    released = audit.release_matching(model, settings.release_attrs)
    attr_bytes = sum(t.nbytes for t in released)
    vocab = VocabRelease()
    if settings.release_vocab_copies:
        vocab = release_unused_vocab_copies(model, loaded.vllm_config)
        for kept in vocab.kept:
            logger.info("vllm-xpu-memfix: vocab copy kept: %s", kept)
    freed = allocator.release_free_memory()
    after = _rss_anon()
    setattr(model, RELEASED, True)
    parts = [
        f"RssAnon {before / MiB:,.0f} -> {after / MiB:,.0f} MiB ({(after - before) / MiB:+,.0f})",
        f"attributes released {len(released)} ({attr_bytes / MiB:,.0f} MiB)",
        *([_vocab_part(vocab)] if vocab.released or vocab.nothing_packed else []),
        f"{freed.allocator} release {'done' if freed.released else 'unavailable'}",
        f"gc {freed.gc_s:.2f} s, trim {freed.trim_s * 1e3:.0f} ms",
    ]
    model_config = getattr(loaded.vllm_config, "model_config", None)
    model_dir = Path(str(getattr(model_config, "model", "")))
    if settings.drop_page_cache and model_dir.is_dir():
        parts.append(f"page cache advised off {drop_page_cache(model_dir) / MiB:,.0f} MiB")
    parts.append(f"total {time.perf_counter() - started:.2f} s")
    return f"vllm-xpu-memfix: rank {loaded.rank} host release: " + "; ".join(parts)
