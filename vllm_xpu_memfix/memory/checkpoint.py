"""What a safetensors checkpoint holds, read from its headers only (never the data)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    pass


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
    directory: Path
    shards: tuple[Path, ...]
    tensors: tuple[Tensor, ...]
    config: dict[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)

    @property
    def dtype(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
        return max(counts, key=lambda d: counts[d]) if counts else "unknown"


def read_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise CheckpointError(f"{path}: header length {length} is not plausible")
            header = json.loads(f.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return header


def read_checkpoint(directory: str | Path) -> Checkpoint:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    shards = tuple(sorted(directory.glob("*.safetensors")))
    if not shards:
        raise CheckpointError(f"{directory} holds no *.safetensors files")
    tensors = []
    for shard in shards:
        for name, meta in read_header(shard).items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            tensors.append(Tensor(name, meta["dtype"], tuple(meta["shape"]), end - start))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return Checkpoint(directory, shards, tuple(tensors), config)


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
