"""Find a Hugging Face model id in the local Hugging Face cache, never on the network.

``vllm serve Qwen/Qwen3-8B`` downloads into the cache that ``huggingface_hub`` keeps
(``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), laid out as
``models--Qwen--Qwen3-8B/snapshots/<commit>/`` with ``refs/main`` naming the commit.
``huggingface_hub`` comes with vLLM, not with the plugin: it is imported only here, when
an id is looked up, and its absence is said in one line.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

# What huggingface_hub's validate_repo_id accepts: "name" or "org/name".
_REPO_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")


class HubCacheError(LookupError):
    """The id is not in the cache, or the cache cannot be searched; one line saying so."""


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    snapshot: Path
    cache: Path

    @property
    def label(self) -> str:
        return f"{self.repo_id} (Hugging Face cache, snapshot {self.snapshot.name[:12]})"


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text and not text.startswith(".")


def find_cached(repo_id: str) -> CachedModel:
    """The snapshot ``refs/main`` names in the local cache, with as much as is downloaded.
    Read from the cache's layout, as ``snapshot_download(local_files_only=True)`` reads
    it, without importing huggingface_hub's Hub client (a tenth of a second)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        raise HubCacheError(
            f"{repo_id} is not a local directory, and huggingface_hub (installed with vLLM) "
            "is not importable here to look it up in the Hugging Face cache"
        ) from None
    if not looks_like_repo_id(repo_id):
        raise HubCacheError(f"{repo_id} is neither a directory nor a Hugging Face id")
    cache = Path(constants.HF_HUB_CACHE)
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        commit = (folder / "refs" / "main").read_text(encoding="utf-8").strip()
        snapshot = folder / "snapshots" / commit
        if commit and "/" not in commit and snapshot.is_dir():
            return CachedModel(repo_id, snapshot, cache)
    raise HubCacheError(
        f"{repo_id} is not a local directory and is not in the Hugging Face cache ({cache})"
    )
