"""What a checkpoint on the Hugging Face Hub holds, read without its weights.

Through ``huggingface_hub`` (installed with vLLM, imported only here and only for a model
that is not at hand): config.json, or a quantization file beside it
(``quantize_config.json``, ``quant_config.json``), and the index, into the Hub cache as
vLLM fetches them; each shard's safetensors header by range request
(``HfApi.parse_safetensors_file_metadata``: the first 100 kB of the file, more only where
a header is larger); a GGUF header by range request on the file's resolve URL, at most
``MAX_GGUF_HEADER`` bytes. ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``HF_TOKEN`` and the cache are huggingface_hub's own, read from the
environment as it is imported. Every request has a timeout and the whole read a deadline:
past it the read is left to a daemon thread and the checkpoint is unknown. No weight is
ever requested.
"""

from __future__ import annotations

import inspect
import io
import re
import threading
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.memory import gguf
from vllm_xpu_memfix.memory.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    CheckpointError,
    Tensor,
    read_config_file,
    read_index,
    tensors_of,
)

# vLLM's remote GGUF form (``repo_id:quant_type``, vllm/transformers_utils/gguf_utils.py
# is_remote_gguf, 0.11 to 0.26) and a file in a repository (``org/name/file.gguf``).
_REMOTE_GGUF = re.compile(r"^([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*):([A-Za-z0-9_+-]+)$")
_GGUF_FILE = re.compile(r"^([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)/(.+\.gguf)$", re.IGNORECASE)
# Files vLLM reads a quantization config from where config.json has none (GPTQConfig and
# AWQConfig.get_config_filenames, 0.32.0).
QUANT_FILES = ("quantize_config.json", "quant_config.json")
SINGLE = "model.safetensors"
FIRST_GGUF_READ = 1024 * 1024
MAX_GGUF_HEADER = 64 * 1024 * 1024  # a 262k-token vocabulary takes about 7 MB
REQUEST_TIMEOUT = 10.0


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


def read(name: str, deadline: float) -> Checkpoint:
    """The checkpoint ``name`` names on the Hub, from its metadata, within ``deadline``
    seconds; ``HubUnavailable`` where the Hub cannot be asked or did not answer,
    ``CheckpointError`` where what it served cannot be read."""
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
        raise HubUnavailable("HF_HUB_OFFLINE is set, so the Hub is not asked")
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(_read(*reference, min(deadline, REQUEST_TIMEOUT)))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="vllm-xpu-memfix-hub", daemon=True)
    thread.start()
    thread.join(deadline)
    if not outcome:
        raise HubUnavailable(f"the Hub did not answer within {deadline:g} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    ckpt: Checkpoint = outcome[0]
    return ckpt


def _read(repo: str, filename: str | None, quant: str | None, timeout: float) -> Checkpoint:
    from huggingface_hub import HfApi

    try:
        # One request, never retried, says whether the Hub answers and lists the files.
        info = HfApi().model_info(repo, timeout=timeout)
        files = frozenset(s.rfilename for s in info.siblings or ())
        if filename or quant:
            return _gguf_checkpoint(repo, files, filename, quant, timeout)
        return _safetensors_checkpoint(repo, files, timeout)
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


def _json(repo: str, name: str, timeout: float) -> dict[str, Any]:
    """A small JSON file of the repository, through the Hub cache as vLLM fetches it."""
    from huggingface_hub import hf_hub_download

    found, problem = read_config_file(Path(hf_hub_download(repo, name, etag_timeout=timeout)))
    if problem:
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


def _safetensors_checkpoint(repo: str, files: frozenset[str], timeout: float) -> Checkpoint:
    """Each shard's header, as ``HfApi.parse_safetensors_file_metadata`` reads it: the
    shards are ``model.safetensors``, else those the index names (as vLLM loads them)."""
    from huggingface_hub import HfApi, hf_hub_download

    config = _config(repo, files, timeout)
    if SINGLE in files:
        shards: tuple[str, ...] = (SINGLE,)
    elif INDEX_NAME in files:
        index_path = Path(hf_hub_download(repo, INDEX_NAME, etag_timeout=timeout))
        index, problem = read_index(index_path.parent)
        if index is None:
            raise CheckpointError(f"{repo} on the Hub: {problem}")
        shards = index.shards
    else:
        raise HubUnavailable(f"{repo} on the Hub holds neither {SINGLE} nor {INDEX_NAME}")
    api = HfApi()
    # The timeout argument came with huggingface_hub 1.x; older ones use their default.
    takes_timeout = "timeout" in inspect.signature(api.parse_safetensors_file_metadata).parameters
    extra: dict[str, Any] = {"timeout": timeout} if takes_timeout else {}
    tensors: list[Tensor] = []
    for shard in shards:
        meta = api.parse_safetensors_file_metadata(repo, shard, **extra)
        header = {
            name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
            for name, t in meta.tensors.items()
        }
        end = max((t.data_offsets[1] for t in meta.tensors.values()), default=0)
        try:
            tensors += tensors_of(header, end)
        except ValueError as exc:
            raise CheckpointError(f"{repo} on the Hub, {shard}: {exc}") from None
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
    repo: str, files: frozenset[str], filename: str | None, quant: str | None, timeout: float
) -> Checkpoint:
    names = [filename] if filename else _gguf_files(files, quant or "")
    if not names or (filename and filename not in files):
        what = filename or f"a .gguf file of type {quant}"
        raise CheckpointError(f"{repo} on the Hub has no {what}")
    tensors: list[Tensor] = []
    config: dict[str, Any] = {}
    for name in names:
        found, own = _gguf_header(repo, name, timeout)
        tensors += [Tensor(n, kind, shape, nbytes) for n, kind, shape, nbytes in found]
        config = config or own
    if not tensors:
        raise CheckpointError(f"{repo} on the Hub: its GGUF headers name no tensors")
    return Checkpoint(None, tuple(map(Path, names)), tuple(tensors), config)


def _gguf_header(
    repo: str, filename: str, timeout: float
) -> tuple[list[tuple[str, str, tuple[int, ...], int]], dict[str, Any]]:
    """One GGUF file's header, by range requests of growing size up to the cap."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo, filename)
    length = FIRST_GGUF_READ
    while True:
        headers = {**build_hf_headers(), "Range": f"bytes=0-{length - 1}"}
        response = get_session().get(url, headers=headers, timeout=timeout)
        hf_raise_for_status(response)
        total = _range_total(response)
        if response.status_code != 206 or total is None or len(response.content) > length:
            raise HubUnavailable(f"{repo}/{filename}: the Hub did not answer a range request")
        try:
            return gguf.parse(io.BytesIO(response.content), total)
        except gguf.GgufTruncated:
            if length >= min(total, MAX_GGUF_HEADER):
                raise CheckpointError(
                    f"{repo}/{filename}: its GGUF header is longer than {MAX_GGUF_HEADER:,} bytes"
                    if total > MAX_GGUF_HEADER
                    else f"{repo}/{filename}: the file ends inside its GGUF header"
                ) from None
            length = min(length * 4, MAX_GGUF_HEADER)
        except gguf.GgufError as exc:
            raise CheckpointError(f"{repo}/{filename}: {exc}") from None


def _range_total(response: Any) -> int | None:
    """The file's size from ``Content-Range: bytes 0-N/TOTAL``."""
    match = re.fullmatch(r"bytes \d+-\d+/(\d+)", response.headers.get("Content-Range", ""))
    return int(match.group(1)) if match else None
