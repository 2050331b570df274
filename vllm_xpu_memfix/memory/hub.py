"""What a checkpoint on the Hugging Face Hub holds, read without its weights.

Through ``huggingface_hub`` (installed with vLLM, imported only here and only for a model
that is not at hand): config.json, or a quantization file beside it
(``quantize_config.json``, ``quant_config.json``), and the index, into the Hub cache as
vLLM fetches them, each refused past its cap (``MAX_CONFIG``, ``MAX_INDEX``) by its size
before it is downloaded, and taken out of the cache again where it proves larger; each
shard's safetensors header by range request (the first 100 kB of the file, as
``HfApi.parse_safetensors_file_metadata`` asks, more only where a header is larger) and
checked against the file's size as a local file is; a GGUF header by range request on the
file's resolve URL, at most ``MAX_GGUF_HEADER`` bytes. Each range request is streamed and
stopped at the bytes asked for (``hub_ranges``), so a server that ignores Range costs
those bytes, and the report says so. ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``HF_TOKEN`` and the cache are huggingface_hub's own, read from the
environment as it is imported. Every request has a timeout and the whole read a deadline:
past it the read is left to a daemon thread and the checkpoint is unknown. No weight is
ever requested.
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.memory import gguf, hub_ranges, hub_reach
from vllm_xpu_memfix.memory.checkpoint import (
    INDEX_NAME,
    MAX_CONFIG,
    MAX_INDEX,
    Checkpoint,
    CheckpointError,
    Tensor,
    header_length,
    header_tensors,
    read_config_file,
    read_index,
)

# vLLM's remote GGUF form (``repo_id:quant_type``, vllm/transformers_utils/gguf_utils.py
# is_remote_gguf, 0.11 to 0.26) and a file in a repository (``org/name/file.gguf``).
_REMOTE_GGUF = re.compile(r"^([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*):([A-Za-z0-9_+-]+)$")
_GGUF_FILE = re.compile(r"^([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)/(.+\.gguf)$", re.IGNORECASE)
# Files vLLM reads a quantization config from where config.json has none (GPTQConfig and
# AWQConfig.get_config_filenames, 0.32.0).
QUANT_FILES = ("quantize_config.json", "quant_config.json")
SINGLE = "model.safetensors"
FIRST_SAFETENSORS_READ = 100_001  # huggingface_hub's bytes=0-100000
FIRST_GGUF_READ = 1024 * 1024
MAX_GGUF_HEADER = 64 * 1024 * 1024  # a 262k-token vocabulary takes about 7 MB
REQUEST_TIMEOUT = 10.0
MAX_INFO = 16 * 1024 * 1024  # the model's info: its file list, a few hundred bytes a file


class HubUnavailable(LookupError):
    """The Hub could not say what the checkpoint holds; one line saying why."""


class LibraryMissing(HubUnavailable):
    """huggingface_hub is not importable, so neither the cache nor the Hub can be asked."""


def is_gguf(name: str) -> bool:
    """A GGUF file by its name: a ``.gguf`` path, or vLLM's ``repo_id:quant_type``."""
    return name.lower().endswith(".gguf") or bool(_REMOTE_GGUF.match(name))


def hub_reference(name: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, GGUF file, GGUF quant type) of a model named on the Hub, else None."""
    from vllm_xpu_memfix.memory.hub_cache import looks_like_repo_id

    remote = _REMOTE_GGUF.match(name)
    if remote:
        return remote.group(1), None, remote.group(2)
    in_repo = _GGUF_FILE.match(name)
    if in_repo and ".." not in name.split("/"):
        return in_repo.group(1), in_repo.group(2), None
    if looks_like_repo_id(name) and not name.lower().endswith(".gguf"):
        return name, None, None
    return None


def read(name: str, deadline: float, notes: list[str] | None = None) -> Checkpoint:
    """The checkpoint ``name`` names on the Hub, from its metadata, within ``deadline``
    seconds; ``HubUnavailable`` where the Hub cannot be asked or did not answer,
    ``CheckpointError`` where what it served cannot be read. ``notes`` gets what the
    report should say of how it was read (a server that ignored Range)."""
    reference = hub_reference(name)
    if reference is None:
        raise HubUnavailable(f"{name} is not a Hugging Face id")
    try:
        from huggingface_hub import constants
    except ImportError:
        raise LibraryMissing(
            "huggingface_hub (installed with vLLM) is not importable here to ask the Hub"
        ) from None
    if constants.HF_HUB_OFFLINE:
        raise HubUnavailable(hub_reach.offline_reason())
    if deadline <= 0:
        raise HubUnavailable("not asked: the deadline had passed")
    outcome: list[Any] = []
    said: list[str] = []

    def run() -> None:
        try:
            outcome.append(_read(*reference, min(deadline, REQUEST_TIMEOUT), said))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="vllm-xpu-memfix-hub", daemon=True)
    thread.start()
    thread.join(deadline)
    if not outcome:
        raise HubUnavailable(f"the Hub did not answer within {deadline:.3g} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    ckpt: Checkpoint = outcome[0]
    if notes is not None:
        notes += dict.fromkeys(said)
    return ckpt


def _read(
    repo: str, filename: str | None, quant: str | None, timeout: float, notes: list[str]
) -> Checkpoint:
    from huggingface_hub import constants

    try:
        # One request, never retried, says whether the Hub answers and lists the files
        # (the route of HfApi.model_info, whose module is not imported for it).
        info = hub_ranges.json_answer(f"{constants.ENDPOINT}/api/models/{repo}", MAX_INFO, timeout)
        siblings = info.get("siblings") if isinstance(info, dict) else None
        files = frozenset(
            s["rfilename"]
            for s in siblings or ()
            if isinstance(s, dict) and isinstance(s.get("rfilename"), str)
        )
        if filename or quant:
            return _gguf_checkpoint(repo, files, filename, quant, timeout, notes)
        return _safetensors_checkpoint(repo, files, timeout, notes)
    except (CheckpointError, HubUnavailable):
        raise
    except Exception as exc:
        raise HubUnavailable(_why(repo, exc)) from None


def _why(repo: str, exc: Exception) -> str:
    """One line for a failed request, naming no host (HF_ENDPOINT may be a private one)."""
    kind = type(exc).__name__
    if kind in ("RepositoryNotFoundError", "GatedRepoError"):
        return (
            f"{repo} is not on the Hub, or is gated or private (HF_TOKEN gives access to "
            "those you may read)"
        )
    if kind in ("RevisionNotFoundError", "EntryNotFoundError", "RemoteEntryNotFoundError"):
        return f"{repo}: the Hub lacks a file doctor reads ({kind})"
    return f"the Hub could not be read for {repo} ({kind})"


def _forget(path: Path) -> None:
    """A file huggingface_hub downloaded, out of its cache again: the snapshot's link and
    the blob it names."""
    with contextlib.suppress(OSError):
        blob = path.resolve()
        path.unlink()
        blob.unlink()


def _downloaded(repo: str, name: str, cap: int, timeout: float) -> Path:
    """A small file of the repository in the Hub cache, as vLLM fetches it; refused by the
    size the Hub gives before it is downloaded where that is past ``cap``."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    size = get_hf_file_metadata(hf_hub_url(repo, name), timeout=timeout).size
    if size is not None and size > cap:
        raise CheckpointError(
            f"{repo} on the Hub: {name} is {size:,} bytes, above doctor's cap of {cap:,}; "
            "not downloaded"
        )
    return Path(hf_hub_download(repo, name, etag_timeout=timeout))


def _json(repo: str, name: str, timeout: float) -> dict[str, Any]:
    """A small JSON file of the repository (config.json, a quantization file)."""
    path = _downloaded(repo, name, MAX_CONFIG, timeout)
    found, problem = read_config_file(path)
    if problem:
        _forget(path)
        raise CheckpointError(f"{repo} on the Hub: {problem}")
    return found


def _config(repo: str, files: frozenset[str], timeout: float) -> dict[str, Any]:
    """config.json, with a quantization file's contents where it names none."""
    config = _json(repo, "config.json", timeout) if "config.json" in files else {}
    if "quantization_config" in config:
        return config
    for name in QUANT_FILES:
        quant = _json(repo, name, timeout) if name in files else {}
        if isinstance(quant.get("quant_method"), str):
            return {**config, "quantization_config": quant}
    return config


def _prefix(
    url: str, where: str, start: int, length: int, timeout: float, notes: list[str]
) -> hub_ranges.Prefix:
    got = hub_ranges.prefix(url, start, length, timeout)
    if got.range_ignored:
        notes.append(
            f"{where}: the server ignored Range (answered 200 with the whole file); doctor "
            "read the bytes the header needs and dropped the rest"
        )
    if got.total is None:
        raise HubUnavailable(f"{where}: the Hub gave no size of the file")
    return got


def _shard_tensors(repo: str, shard: str, timeout: float, notes: list[str]) -> tuple[Tensor, ...]:
    """One shard's safetensors header, checked against the file's size as on disk."""
    from huggingface_hub import hf_hub_url

    url, where = hf_hub_url(repo, shard), f"{repo} on the Hub, {shard}"
    first = _prefix(url, where, 0, FIRST_SAFETENSORS_READ, timeout, notes)
    assert first.total is not None
    length = header_length(where, first.data[:8], first.total)
    header = first.data[8 : 8 + length]
    if len(header) < length:
        header += _prefix(url, where, 8 + len(header), length - len(header), timeout, notes).data
    if len(header) < length:
        raise CheckpointError(f"{where}: the Hub's answer ends inside its safetensors header")
    return header_tensors(where, header, first.total)


def _safetensors_checkpoint(
    repo: str, files: frozenset[str], timeout: float, notes: list[str]
) -> Checkpoint:
    """Each shard's header: the shards are ``model.safetensors``, else those the index
    names (as vLLM loads them)."""
    config = _config(repo, files, timeout)
    if SINGLE in files:
        shards: tuple[str, ...] = (SINGLE,)
    elif INDEX_NAME in files:
        index_path = _downloaded(repo, INDEX_NAME, MAX_INDEX, timeout)
        index, problem = read_index(index_path.parent)
        if index is None:
            _forget(index_path)
            raise CheckpointError(f"{repo} on the Hub: {problem}")
        shards = index.shards
    else:
        raise HubUnavailable(f"{repo} on the Hub holds neither {SINGLE} nor {INDEX_NAME}")
    tensors = [t for shard in shards for t in _shard_tensors(repo, shard, timeout, notes)]
    if not tensors:
        raise CheckpointError(f"{repo} on the Hub: its safetensors headers name no tensors")
    return Checkpoint(None, tuple(map(Path, shards)), tuple(tensors), config)


def _gguf_files(files: frozenset[str], quant: str) -> list[str]:
    """The GGUF files for ``quant`` (one, or the parts of a split file)."""
    wanted = re.compile(rf"(^|[^A-Z0-9]){re.escape(quant.upper())}([^A-Z0-9_]|$)")
    return sorted(
        n
        for n in files
        if n.lower().endswith(".gguf") and "mmproj" not in n.lower() and wanted.search(n.upper())
    )


def _gguf_checkpoint(
    repo: str,
    files: frozenset[str],
    filename: str | None,
    quant: str | None,
    timeout: float,
    notes: list[str],
) -> Checkpoint:
    names = [filename] if filename else _gguf_files(files, quant or "")
    if not names or (filename and filename not in files):
        what = filename or f"a .gguf file of type {quant}"
        raise CheckpointError(f"{repo} on the Hub has no {what}")
    tensors: list[Tensor] = []
    config: dict[str, Any] = {}
    for name in names:
        found, own = _gguf_header(repo, name, timeout, notes)
        tensors += [Tensor(n, kind, shape, nbytes) for n, kind, shape, nbytes in found]
        config = config or own
    if not tensors:
        raise CheckpointError(f"{repo} on the Hub: its GGUF headers name no tensors")
    return Checkpoint(None, tuple(map(Path, names)), tuple(tensors), config)


def _gguf_header(
    repo: str, filename: str, timeout: float, notes: list[str]
) -> tuple[list[tuple[str, str, tuple[int, ...], int]], dict[str, Any]]:
    """One GGUF file's header, by range requests of growing size up to the cap."""
    from huggingface_hub import hf_hub_url

    url, where = hf_hub_url(repo, filename), f"{repo}/{filename}"
    length = FIRST_GGUF_READ
    while True:
        got = _prefix(url, where, 0, length, timeout, notes)
        assert got.total is not None
        try:
            return gguf.parse(io.BytesIO(got.data), got.total)
        except gguf.GgufTruncated:
            if length >= min(got.total, MAX_GGUF_HEADER):
                raise CheckpointError(
                    f"{where}: its GGUF header is longer than {MAX_GGUF_HEADER:,} bytes"
                    if got.total > MAX_GGUF_HEADER
                    else f"{where}: the file ends inside its GGUF header"
                ) from None
            length = min(length * 4, MAX_GGUF_HEADER)
        except gguf.GgufError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
