"""What a GGUF file holds, from its header only: the tensors (name, ggml type, shape, bytes)
and the model's sizes as a config.json would name them.

The layout is GGUF's (llama.cpp ``docs/gguf.md``, versions 2 and 3, little-endian): the
magic ``GGUF``, the version, the tensor and metadata counts, the metadata key/value pairs,
then one entry per tensor (name, dimensions, ggml type, offset into the aligned data
section). Bytes per block of each ggml type: ggml's ``type_traits`` (``ggml/src/ggml.c``).
A header that breaks the layout, names an unknown type or points past the file is refused
with one line: a size read from it would be wrong.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vllm_xpu_memfix.core import files

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_COUNT = 10_000_000  # tensors, metadata pairs, array items: beyond this, not a model
# Reads of the whole header, every array item's included: a 256k vocabulary with its
# merges is about 1.2M (a length, then the text passed over); this bounds the time.
MAX_READS = 4_000_000
MAX_STRING = 64 * 1024 * 1024
MAX_NESTING = 4
DEFAULT_ALIGNMENT = 32
# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# general.file_type: llama.cpp's ``enum llama_ftype`` (``include/llama.h``), the type
# most of the weights were quantized to, as llama.cpp's file names give it.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE",
}  # fmt: skip
# Metadata value types: fixed-size ones as struct formats; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# GGUF metadata (after "<arch>.") -> config.json key
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "expert_count": "num_experts",
}


class GgufError(ValueError):
    """A GGUF header doctor cannot read; the message says why, in one line."""


class GgufTruncated(GgufError):
    """The bytes end inside the header: a range read takes more, a whole file is refused."""


@dataclass(frozen=True)
class Array:
    """A metadata array, its items passed over unread (only the vocabulary's length is
    used): never a list of millions of values in memory."""

    kind: int
    length: int


class _Reader:
    def __init__(self, stream: BinaryIO, size: int) -> None:
        self.stream = stream
        self.size = size
        self.offset = 0
        self.reads = 0

    def spend(self) -> None:
        self.reads += 1
        if self.reads > MAX_READS:
            raise GgufError(f"the header takes more than {MAX_READS:,} reads")

    def skip(self, size: int) -> None:
        self.spend()
        if self.offset + size > self.size:
            raise GgufError(f"the header ends inside a field at byte {self.offset}")
        self.stream.seek(size, 1)
        self.offset += size

    def take(self, size: int) -> bytes:
        self.spend()
        data = self.stream.read(size)
        if len(data) != size:
            raise GgufTruncated(f"the header ends inside a field at byte {self.offset}")
        self.offset += size
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        value = int(self.scalar("<Q"))
        if value > MAX_COUNT:
            raise GgufError(f"{what} {value:,} is more than a model holds")
        return value

    def string(self) -> str:
        size = int(self.scalar("<Q"))
        if size > MAX_STRING:
            raise GgufError(f"a string of {size:,} bytes at byte {self.offset}")
        return self.take(size).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY and depth < MAX_NESTING:
            item = int(self.scalar("<I"))
            length = self.count("an array of")
            if item in _SCALARS:
                self.skip(length * struct.calcsize(_SCALARS[item]))
            elif item == STRING:
                for _ in range(length):
                    size = int(self.scalar("<Q"))
                    if size > MAX_STRING:
                        raise GgufError(f"a string of {size:,} bytes at byte {self.offset}")
                    self.skip(size)
            else:
                for _ in range(length):
                    self.value(item, depth + 1)
            return Array(item, length)
        if kind == ARRAY:
            raise GgufError(f"arrays nested deeper than {MAX_NESTING} at byte {self.offset}")
        raise GgufError(f"metadata value type {kind} is not GGUF's")


def _tensor(reader: _Reader) -> tuple[str, str, tuple[int, ...], int, int]:
    name = reader.string()
    dims = int(reader.scalar("<I"))
    if dims > 8:
        raise GgufError(f"tensor {name[:80]!r} has {dims} dimensions")
    shape = tuple(int(reader.scalar("<Q")) for _ in range(dims))
    kind = int(reader.scalar("<I"))
    offset = int(reader.scalar("<Q"))
    if kind not in GGML_TYPES:
        raise GgufError(f"tensor {name[:80]!r} has ggml type {kind}, which doctor cannot size")
    type_name, block, block_bytes = GGML_TYPES[kind]
    elements = 1
    for size in shape:
        elements *= size
    if elements % block:
        raise GgufError(
            f"tensor {name[:80]!r}: {elements} elements are not whole {type_name} blocks"
        )
    return name, type_name, tuple(reversed(shape)), elements // block * block_bytes, offset


def _config(metadata: dict[str, Any]) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    quant: dict[str, Any] = {"quant_method": "gguf"}
    file_type = metadata.get("general.file_type")
    if type(file_type) is int and file_type in FILE_TYPES:
        quant["file_type"] = FILE_TYPES[file_type]
    config: dict[str, Any] = {"quantization_config": quant}
    if isinstance(arch, str):
        config["model_type"] = arch
        for key, name in CONFIG_KEYS.items():
            value = metadata.get(f"{arch}.{key}")
            if type(value) is int and value > 0:
                config[name] = value
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, Array) and tokens.kind == STRING and tokens.length:
        config["vocab_size"] = tokens.length
    return config


def read(path: Path) -> tuple[list[tuple[str, str, tuple[int, ...], int]], dict[str, Any]]:
    """The tensors (name, ggml type, shape, bytes) and the config of a GGUF file."""
    try:
        fd = files.open_regular(path)  # a FIFO would block a plain open
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "rb") as stream:
            return parse(stream, size)
    except OSError as exc:
        raise GgufError(f"cannot read it ({exc.strerror or exc})") from exc


def parse(
    stream: BinaryIO, size: int
) -> tuple[list[tuple[str, str, tuple[int, ...], int]], dict[str, Any]]:
    """The header at the start of ``stream``, of a GGUF file of ``size`` bytes: a file on
    disk, or the first bytes of one on the Hub (``GgufTruncated`` where they end too soon)."""
    reader = _Reader(stream, size)
    if reader.take(4) != MAGIC:
        raise GgufError("not a GGUF file (no GGUF magic)")
    version = int(reader.scalar("<I"))
    if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
        raise GgufError("a big-endian GGUF file; doctor reads little-endian ones only")
    if version not in VERSIONS:
        raise GgufError(f"GGUF version {version}; doctor reads versions 2 and 3")
    tensors, pairs = reader.count("a tensor count of"), reader.count("a metadata count of")
    metadata = {}
    for _ in range(pairs):
        key = reader.string()
        metadata[key] = reader.value(int(reader.scalar("<I")))
    entries = [_tensor(reader) for _ in range(tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0:
        raise GgufError(f"general.alignment {alignment!r} is not a positive integer")
    data = -(-reader.offset // alignment) * alignment
    for name, _, _, nbytes, offset in entries:
        if data + offset + nbytes > size:
            raise GgufError(f"tensor {name[:80]!r} ends past the end of the file")
    found = [(name, kind, shape, nbytes) for name, kind, shape, nbytes, _ in entries]
    return found, _config(metadata)
