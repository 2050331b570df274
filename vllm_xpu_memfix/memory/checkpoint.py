"""What a safetensors checkpoint holds, read from its headers only (never the data).

Every header is checked against its file by the rules of the safetensors library
(0.8, ``Metadata::validate``), which vLLM loads with: a header length within the file,
a JSON object, ``__metadata__`` a map of strings, each tensor a known dtype, a shape of
non-negative integers and two data offsets whose span is exactly shape x dtype, and the
tensors covering the data section in order with no gap and no overlap. A file that
breaks a rule is refused with one line saying why: a size read from it would be wrong.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import bounded, files
from vllm_xpu_memfix.memory import config_sizes

# Bits per element of every safetensors dtype (0.8): F4 and F6 pack below a byte.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
DTYPE_BYTES = {name: bits // 8 for name, bits in DTYPE_BITS.items() if bits % 8 == 0}
# A checkpoint's torch_dtype in config.json, as a safetensors dtype.
TORCH_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "half": "F16",
    "float32": "F32",
    "float": "F32",
}
INDEX_NAME = "model.safetensors.index.json"
# safetensors' MAX_HEADER_SIZE; config.json and the index are read up to these sizes.
MAX_HEADER = 100_000_000
MAX_CONFIG = 16 * 1024 * 1024
MAX_INDEX = 100_000_000
_U64 = 2**64


class CheckpointError(ValueError):
    """A checkpoint doctor cannot read; the message is one line saying what and why."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def is_linear_weight(self) -> bool:
        """A 2-D projection weight, the kind on-the-fly weight quantization converts."""
        excluded = ("embed", "lm_head", "norm")
        return (
            len(self.shape) == 2
            and self.name.endswith(".weight")
            and not any(word in self.name for word in excluded)
        )


@dataclass(frozen=True)
class Checkpoint:
    """The tensors doctor could read, and what it could not see or refused.

    ``declared_bytes`` is the size where some weights are unseen (shards missing, or none
    at all): the index's ``total_size`` or a parameter count the user gave.
    """

    directory: Path | None
    shards: tuple[Path, ...]
    tensors: tuple[Tensor, ...]
    config: dict[str, Any]
    declared_bytes: int | None = None
    declared_from: str = ""
    unseen: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    # The dtype a bare parameter count was taken in, where no header or config names one.
    assumed_dtype: str | None = None

    @property
    def complete(self) -> bool:
        """Whether every tensor's header was read, so the sizes are the files' own."""
        return self.declared_bytes is None

    @property
    def total_bytes(self) -> int:
        if self.declared_bytes is not None:
            return self.declared_bytes
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)

    @property
    def dtype(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
        if counts:
            return max(counts, key=lambda d: counts[d])
        return config_dtype(self.config) or self.assumed_dtype or "unknown"


def _shown(text: str, limit: int = 80) -> str:
    """A name from a file, quoted, escaped and cut so that a message stays one short line."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity (Python's json takes them, safetensors not)."""
    return json.loads(raw.decode("utf-8"), parse_constant=_no_constants)


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < _U64


def _check_metadata(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return f"__metadata__ is a {type(metadata).__name__}, not an object"
    for key, value in metadata.items():
        if not isinstance(value, str):
            return f"__metadata__[{_shown(key)}] is a {type(value).__name__}, not a string"
    return None


def _tensor(name: str, entry: Any) -> tuple[Tensor, int, int]:
    """One tensor entry, checked on its own: the tensor and its data offsets."""
    where = f"tensor {_shown(name)}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise ValueError(f"{where} has no {key}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ValueError(f"{where} has an unknown dtype {_shown(str(dtype))}")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise ValueError(f"{where}: shape {_shown(str(shape))} is not a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_u64, offsets))):
        raise ValueError(f"{where}: data_offsets {_shown(str(offsets))} are not two integers >= 0")
    begin, end = offsets
    if end < begin:
        raise ValueError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise ValueError(f"{where}: {dtype} x {shape} is not a whole number of bytes")
    if end - begin != bits // 8:
        raise ValueError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
            f"but {dtype} x {shape} is {bits // 8} bytes"
        )
    return Tensor(name, dtype, tuple(shape), bits // 8), begin, end


def tensors_of(header: Any, data_bytes: int) -> tuple[Tensor, ...]:
    """The tensors of a parsed header whose file has ``data_bytes`` after the header.

    Raises ``ValueError`` with the first rule broken.
    """
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    problem = _check_metadata(header.get("__metadata__"))
    if problem:
        raise ValueError(problem)
    spans = sorted(
        (_tensor(name, entry) for name, entry in header.items() if name != "__metadata__"),
        key=lambda item: (item[1], item[2]),
    )
    covered = 0
    for tensor, begin, end in spans:
        if begin != covered:
            what = "overlap the previous tensor" if begin < covered else "leave a gap before them"
            raise ValueError(f"tensor {_shown(tensor.name)}: data_offsets [{begin}, {end}] {what}")
        covered = end
    if covered != data_bytes:
        raise ValueError(
            f"the tensors cover {covered} bytes of a data section of {data_bytes} bytes"
        )
    return tuple(tensor for tensor, _, _ in spans)


def header_length(where: str, first: bytes, size: int) -> int:
    """The header length a safetensors file's first 8 bytes give, checked against the
    file's ``size``; CheckpointError naming ``where`` (a path, or a file on the Hub)."""
    if len(first) != 8 or size < 8:
        raise CheckpointError(f"{where}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", first)
    if length > MAX_HEADER:
        raise CheckpointError(
            f"{where}: header length {length} is above safetensors' limit of {MAX_HEADER}"
        )
    if length > size - 8:
        raise CheckpointError(
            f"{where}: header length {length} points past the end of the file ({size} bytes)"
        )
    return int(length)


def header_tensors(where: str, header_bytes: bytes, size: int) -> tuple[Tensor, ...]:
    """The tensors of a safetensors header, checked against its file's ``size``."""
    try:
        header = _json(header_bytes)
    except (ValueError, RecursionError) as exc:
        reason = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else f"not JSON ({exc})"
        raise CheckpointError(f"{where}: the safetensors header is {reason}") from None
    try:
        return tensors_of(header, size - 8 - len(header_bytes))
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def read_shard(path: Path) -> tuple[Tensor, ...]:
    """The tensors of one safetensors file, its header checked against the file."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = header_length(str(path), f.read(8), size)
            header_bytes = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    return header_tensors(str(path), header_bytes, size)


def _read_json(path: Path, limit: int) -> Any:
    """A JSON file of the checkpoint (config.json, the shard index), within ``limit`` bytes
    and ``core.bounded``'s limits; ``ValueError`` saying why it was refused."""
    try:
        raw = files.read_bytes(path, limit)
    except (files.NotRegular, files.TooLarge) as exc:
        raise ValueError(exc.strerror) from None
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or exc})") from None
    try:
        return bounded.json_value(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except bounded.OutOfBounds as exc:
        raise ValueError(exc.reason) from None
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None


def read_config(directory: Path) -> tuple[dict[str, Any], str | None]:
    """config.json as a dict, or ``{}`` and why it was refused (``None`` if absent)."""
    return read_config_file(directory / "config.json")


def read_config_file(path: Path) -> tuple[dict[str, Any], str | None]:
    """A JSON object file of a checkpoint (config.json, a quantization config), or ``{}``
    and why it was refused (``None`` if absent)."""
    if not path.exists() and not path.is_symlink():
        return {}, None
    try:
        config = _read_json(path, MAX_CONFIG)
    except ValueError as exc:
        return {}, f"{path.name}: {exc}"
    if not isinstance(config, dict):
        return {}, f"{path.name}: a JSON {type(config).__name__}, not an object"
    return config, None


def config_dtype(config: dict[str, Any]) -> str | None:
    """The checkpoint dtype config.json names (``torch_dtype``, or ``dtype`` since
    transformers 5), as a safetensors dtype; the text model's for a multimodal config."""
    for section in (config, text_config(config)):
        for key in ("torch_dtype", "dtype"):
            value = section.get(key)
            if isinstance(value, str) and value.removeprefix("torch.") in TORCH_DTYPES:
                return TORCH_DTYPES[value.removeprefix("torch.")]
    return None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's section of a multimodal config, else the config itself."""
    for key in ("text_config", "llm_config", "language_config"):
        section = config.get(key)
        if isinstance(section, dict):
            return section
    return config


@dataclass(frozen=True)
class Index:
    """model.safetensors.index.json: the shard files it names and its total_size."""

    shards: tuple[str, ...]
    total_size: int | None


def read_index(directory: Path) -> tuple[Index | None, str | None]:
    """The index, or ``None`` and why it was refused (``None`` if absent)."""
    path = directory / INDEX_NAME
    if not path.exists() and not path.is_symlink():
        return None, None
    try:
        index = _read_json(path, MAX_INDEX)
    except ValueError as exc:
        return None, f"{INDEX_NAME}: {exc}"
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return None, f"{INDEX_NAME}: no weight_map object"
    for name in weight_map.values():
        if not isinstance(name, str) or name != Path(name).name or name in ("", ".."):
            return None, f"{INDEX_NAME}: {_shown(str(name))} is not a file name in the directory"
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    # Some writers store total_size as a float; only a whole, positive number is a size.
    if isinstance(total, float) and total.is_integer() and 0 < total < _U64:
        total = int(total)
    size = total if type(total) is int and 0 < total < _U64 else None
    return Index(tuple(sorted(set(weight_map.values()))), size), None


def _shard_files(directory: Path) -> tuple[list[Path], Index | None, list[str]]:
    """The shards that make up the model, the index, and what was refused on the way."""
    refused: list[str] = []
    index, problem = read_index(directory)
    if problem:
        refused.append(f"{problem}; counted every *.safetensors file instead")
    found = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if index is None:
        return found, None, refused
    named = set(index.shards)
    stray = [p.name for p in found if p.name not in named]
    if stray:
        # vLLM loads only the files the index names (filter_duplicate_safetensors_files).
        refused.append(f"not named by {INDEX_NAME}, not counted: {', '.join(map(_shown, stray))}")
    return [directory / name for name in index.shards], index, refused


class SizeUnknown(CheckpointError):
    """The files at hand do not give the weights' size (none, or shards missing)."""


def _size_unknown(name: str, why: str) -> CheckpointError:
    return SizeUnknown(
        f"{name} {why}, so the model's size is unknown; give it with --params "
        "(e.g. --params 8B) or pass a directory that holds the weights"
    )


def read_checkpoint(
    directory: str | Path, params: int | None = None, name: str | None = None
) -> Checkpoint:
    """Read every shard's header. Where weights are missing, the size comes from the
    index's total_size, else from ``params`` (a parameter count) x the config's dtype.
    ``name`` stands for the directory in messages (a Hugging Face id, for a cache)."""
    directory = Path(directory)
    name = name or str(directory)
    if directory.suffix.lower() == ".gguf" and not directory.is_dir():  # a FIFO too
        return read_gguf(directory, name)
    if not directory.is_dir():
        raise CheckpointError(f"{name} is not a directory")
    config, config_problem = read_config(directory)
    no_model = config_sizes.problem(config)
    if no_model:
        raise CheckpointError(f"{directory / 'config.json'}: {no_model}")
    refused = [config_problem] if config_problem else []
    shard_paths, index, index_refused = _shard_files(directory)
    refused += index_refused
    present = [p for p in shard_paths if p.is_file()]
    missing = [p.name for p in shard_paths if not p.is_file()]
    tensors = tuple(t for shard in present for t in read_shard(shard))
    if not shard_paths and params is None:
        raise _size_unknown(name, "holds no *.safetensors files")
    unseen: list[str] = []
    declared: int | None = None
    declared_from = ""
    assumed_dtype = None
    if missing:
        unseen.append(
            f"{len(missing)} of the {len(shard_paths)} shards {INDEX_NAME} names: "
            + ", ".join(map(_shown, missing))
        )
    if not config and not config_problem:
        unseen.append("config.json")
    if missing or not shard_paths:
        if index is not None and index.total_size is not None:
            declared, declared_from = index.total_size, f"{INDEX_NAME} total_size"
        elif params is not None:
            dtype = assumed_dtype = config_dtype(config) or "BF16"
            declared = params * DTYPE_BYTES[dtype]
            declared_from = f"{params:,} parameters x {dtype}"
        else:
            raise _size_unknown(
                name,
                f"lacks {len(missing)} of the {len(shard_paths)} shards {INDEX_NAME} names "
                f"({', '.join(map(_shown, missing))}) and the index gives no total_size",
            )
        if not shard_paths:
            unseen.append("the weights (no *.safetensors file)")
    elif not tensors:
        raise CheckpointError(f"{name}: its safetensors files hold no tensors")
    return Checkpoint(
        directory,
        tuple(present),
        tensors,
        config,
        declared,
        declared_from,
        tuple(unseen),
        tuple(refused),
        assumed_dtype,
    )


def read_gguf(path: Path, name: str) -> Checkpoint:
    """A GGUF file, from its own header: its tensors at their quantized sizes, and its
    sizes as config.json names them, with ``quant_method`` gguf."""
    from vllm_xpu_memfix.memory import gguf

    try:
        found, config = gguf.read(path)
    except gguf.GgufError as exc:
        raise CheckpointError(f"{name}: {exc}") from None
    if not found:
        raise CheckpointError(f"{name}: its GGUF header names no tensors")
    tensors = tuple(Tensor(n, kind, shape, nbytes) for n, kind, shape, nbytes in found)
    return Checkpoint(path.parent, (path,), tensors, config)


def checkpoint_from_params(params: int, dtype: str = "BF16") -> Checkpoint:
    """No files at all: the size from a parameter count the user gave."""
    return Checkpoint(
        None,
        (),
        (),
        {},
        params * DTYPE_BYTES[dtype],
        f"{params:,} parameters x {dtype}",
        ("config.json", "the weights"),
        assumed_dtype=dtype,
    )


def write_sparse_checkpoint(
    directory: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], shards: int = 1
) -> Checkpoint:
    """Write real safetensors headers whose data regions are file holes (no disk used).

    For tests and bug reports: a checkpoint of any size that ``read_checkpoint`` and
    vLLM's loaders see as real, filled with zeros.
    """
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    for index in range(shards):
        header: dict[str, Any] = {}
        offset = 0
        for name in names[index * per_shard : (index + 1) * per_shard]:
            dtype, shape = tensors[name]
            size = DTYPE_BYTES[dtype]
            for dim in shape:
                size *= dim
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        path = directory / f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        with path.open("wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)
    return read_checkpoint(directory)
