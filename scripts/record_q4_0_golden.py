"""Record golden Q4_0 data from a build of Intel's compiled library: inputs and its outputs.

Usage (no build is ever committed; fetch each from llm-scaler's history yourself)::

    git -C LLM_SCALER_MIRROR show branch-v1.0:vllm/patches/vllm_int4_for_multi_arc.so > v1.so
    .venv/bin/python scripts/record_q4_0_golden.py --library v1.so --name branch-v1.0 \\
        --source "intel/llm-scaler branch-v1.0 (84f37710), vllm/patches/vllm_int4_for_multi_arc.so"

    git -C LLM_SCALER_MIRROR show bdfa16f:artifacts/vllm_int4_for_multi_arc.so > pr334.so
    .venv/bin/python scripts/record_q4_0_golden.py --library pr334.so --name pr334-6arg \\
        --arguments 6 --groups 32 64 128 --source "intel/llm-scaler bdfa16f ..."

Two builds are known, with the same name and symbol and different argument lists:

- five arguments, ``quantize_q4_0_to_qweight_and_scale(const float *src, int32 *qweight
  [N, K/8], uint16 *scales [N, K/64], int N, int K)``, the group fixed at 64 (the build on
  ``branch-v1.0``);
- six, the group as the last argument, ``(..., int N, int K, int block)``, as the 0.21
  images' ``sym_int4`` module and llm-scaler's ``vllm-0.21.0-b2`` ESIMD tests call it.

Both OR each nibble into its word, so the outputs start zeroed, as Intel's modules allocate
them. The layouts of ``qweight`` and ``scales`` are the script's assumption for each call;
read a new build's disassembly or probe it before recording (tests/data/q4_0_golden/README.md
says what was read for each).

The branch-v1.0 build needs glibc 2.38 for one symbol, ``__isoc23_strtol`` (C23 ``strtol``,
used by its GGUF loader, not by the quantizer). On an older glibc this script loads a
temporary copy whose GLIBC_2.38 version need is marked weak, after a one-line shim that
forwards the symbol to ``strtol`` (built with ``cc``). The quantizer's code is not touched;
the original file's SHA-256 is what the provenance records.

Writes ``tests/data/q4_0_golden/<name>-g<group>.safetensors`` per group: for each case
``<case>.weight`` (the input in its own dtype, unpadded), ``<case>.qweight`` and
``<case>.scales`` (the library's outputs on the input zero-padded to the group, as
llm-scaler's 0.21 module pads K), with the provenance (source, SHA-256, compiler from the
ELF's ``.comment``, function, call, group, date) in the file's metadata. The inputs depend
only on the group, so files of two builds at one group hold the same inputs.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import platform
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_xpu_memfix.kernels.q4_0_probe import near_tie_probe
from vllm_xpu_memfix.kernels.q4_0_reference import padded_k

FIXED_GROUP = 64  # the five-argument build's group
SYMBOL = "quantize_q4_0_to_qweight_and_scale"
FUNCTION = {
    5: f"{SYMBOL}(const float *src, int32_t *qweight, uint16_t *scales, int N, int K)",
    6: f"{SYMBOL}(const float *src, int32_t *qweight, uint16_t *scales, int N, int K, int block)",
}
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "q4_0_golden"
SHIM_SOURCE = "#include <stdlib.h>\nlong __isoc23_strtol(const char *s, char **e, int b)" \
    " { return strtol(s, e, b); }\n"  # fmt: skip
VER_FLG_WEAK = 0x2


def _sections(data: bytes | bytearray) -> list[tuple[str, tuple[int, ...]]]:
    """The ELF64's section headers, in order, each with its name."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(count)]
    names = headers[names_index][4]
    return [(bytes(data[names + h[0] : data.index(0, names + h[0])]).decode(), h) for h in headers]


def compiler(data: bytes) -> str:
    """The ELF's ``.comment`` strings (the compiler that built it), or ``unknown``."""
    for name, header in _sections(data):
        if name == ".comment":
            raw = data[header[4] : header[4] + header[5]]
            return "; ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    return "unknown"


def _weak_glibc_238(data: bytearray) -> int:
    """Mark the GLIBC_2.38 entries of the ELF's version needs weak; returns how many."""
    sections = _sections(data)

    def string(table: tuple[int, ...], offset: int) -> str:
        start = table[4] + offset
        return data[start : data.index(0, start)].decode()

    marked = 0
    for name, section in sections:
        if name != ".gnu.version_r":
            continue
        strings, need = sections[section[6]][1], section[4]
        while True:
            _, aux_count, _, aux, next_need = struct.unpack_from("<HHIII", data, need)
            entry = need + aux
            for _ in range(aux_count):
                _, flags, _, name_at, next_aux = struct.unpack_from("<IHHII", data, entry)
                if string(strings, name_at) == "GLIBC_2.38":
                    struct.pack_into("<H", data, entry + 4, flags | VER_FLG_WEAK)
                    marked += 1
                entry += next_aux
            if not next_need:
                break
            need += next_need
    return marked


def load(library: Path, scratch: Path) -> tuple[ctypes.CDLL, str]:
    """The library, loaded as it is where the host's glibc allows, else through the shim."""
    try:
        return ctypes.CDLL(str(library)), "loaded as shipped"
    except OSError as exc:
        if "GLIBC_2.38" not in str(exc):
            raise
    shim_c, shim = scratch / "shim.c", scratch / "libisoc23shim.so"
    shim_c.write_text(SHIM_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(shim_c)], check=True)
    data = bytearray(library.read_bytes())
    if _weak_glibc_238(data) == 0:
        raise RuntimeError(f"{library}: no GLIBC_2.38 need to relax")
    copy = scratch / library.name
    copy.write_bytes(bytes(data))
    ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    how = (
        f"glibc {platform.libc_ver()[1]} lacks GLIBC_2.38: loaded a copy with that version "
        f"need marked weak (sha256 {hashlib.sha256(data).hexdigest()}) after a shim "
        "forwarding __isoc23_strtol to strtol"
    )
    return ctypes.CDLL(str(copy)), how


def library_quantize(
    lib: ctypes.CDLL, weight: torch.Tensor, group: int, arguments: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call as llm-scaler's modules make it: fp32, K zero-padded to the group, outputs
    zeroed; the group passed as the sixth argument where the build takes one."""
    function = getattr(lib, SYMBOL)
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * (arguments - 3)
    function.restype = ctypes.c_size_t
    n, k = weight.shape
    src = torch.nn.functional.pad(weight.float(), (0, padded_k(k, group) - k)).contiguous()
    qweight = torch.zeros((n, src.shape[1] // 8), dtype=torch.int32)
    scales = torch.zeros((n, src.shape[1] // group), dtype=torch.float16)
    extra = (group,) if arguments == 6 else ()
    function(src.data_ptr(), qweight.data_ptr(), scales.data_ptr(), n, src.shape[1], *extra)
    return qweight, scales


def edge_groups(g: int) -> torch.Tensor:
    """One group of ``g`` values per row, each on an edge the format has."""
    rows = []

    def group(*values: tuple[int, float], fill: float = 0.0) -> None:
        row = torch.full((g,), fill)
        for index, value in values:
            row[index] = value
        rows.append(row)

    group()  # all zero
    group((0, -0.0), fill=-0.0)  # all negative zero
    group((0, -2.0), (1, 1.0), (2, 0.5), fill=0.1)  # negative maximum
    group((0, -2.0), (1, 2.0), (2, 1.0))  # +m of a negative maximum clamps at 15
    group((3, 2.0), (9, -2.0))  # equal magnitudes, positive first
    group((3, -2.0), (9, 2.0))  # equal magnitudes, negative first
    group((1, 3.0), (2, -3.0), (3, 3.0), (g * 5 // 8, -3.0))  # several equal, not first
    group((g - 1, 1e-3))  # the maximum last
    rows.append(torch.arange(g, dtype=torch.float32) % 16 - 7.5)  # exact ties: x*id+8.5 integral
    rows[-1][0] = -8.0
    group((0, 7.99), (1, -8.0), fill=7.99)  # everything else clamps
    group((0, 3e-8), (5, -6e-8), fill=3e-8)  # the scale is an fp16 subnormal
    rows.append(torch.linspace(-60000.0, 60000.0, g))  # near the fp16 range
    group((0, 1e6), (1, -5e5))  # the scale overflows fp16
    group((0, 5e-38), (1, -2e-38), (2, 1e-39))  # d subnormal, 1/d finite
    group((0, 2.3e-38), (1, -1e-38), (2, 4e-39))  # 1/d overflows: every q = 0
    group((0, 1e-40), (1, -5e-41))  # subnormal maximum
    rows.append(torch.tensor([(-1.0) ** i * (i % 7 + 1) for i in range(g)]))
    return torch.stack(rows)


def cases(group: int) -> dict[str, torch.Tensor]:
    """The inputs at ``group``; the random ones are the same at every group."""
    generator = torch.Generator().manual_seed(20261204)

    def randn(n: int, k: int) -> torch.Tensor:
        scale = 10.0 ** torch.empty(n, 1).uniform_(-3, 0, generator=generator)
        return torch.randn(n, k, generator=generator) * scale

    found = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        found[f"random_{name}"] = randn(32, 512).to(dtype)
        found[f"near_ties_{name}"] = near_tie_probe(group, dtype)
    found["padded_k200_bf16"] = randn(24, 200).to(torch.bfloat16)
    found["padded_k328_fp16"] = randn(8, 328).to(torch.float16)
    found["edges_fp32"] = edge_groups(group)
    found["edges_bf16"] = edge_groups(group).to(torch.bfloat16)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", type=Path, required=True, help="vllm_int4_for_multi_arc.so")
    parser.add_argument("--source", required=True, help="where the build came from (commits)")
    parser.add_argument("--name", required=True, help="the build's label in the file names")
    parser.add_argument("--arguments", type=int, choices=(5, 6), default=5, help="its arity")
    parser.add_argument("--groups", type=int, nargs="+", default=[FIXED_GROUP])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not args.library.is_file():
        print(f"record: {args.library} is not a file", file=sys.stderr)
        return 2
    if args.arguments == 5 and args.groups != [FIXED_GROUP]:
        print(f"record: a five-argument build quantizes at group {FIXED_GROUP} only, "
              f"not {args.groups}", file=sys.stderr)  # fmt: skip
        return 2
    data = args.library.read_bytes()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        lib, how = load(args.library, Path(scratch))
        for group in args.groups:
            tensors = {}
            for case, weight in cases(group).items():
                qweight, scales = library_quantize(lib, weight, group, args.arguments)
                tensors |= {f"{case}.weight": weight, f"{case}.qweight": qweight}
                tensors[f"{case}.scales"] = scales
            passed = f", {group}" if args.arguments == 6 else ""
            provenance = {
                "library": args.source,
                "library_sha256": hashlib.sha256(data).hexdigest(),
                "compiler": compiler(data),
                "function": FUNCTION[args.arguments],
                "call": f"{SYMBOL}(src fp32 [N, Kp], qweight int32 zeros [N, Kp/8], "
                f"scales fp16 zeros [N, Kp/{group}], N, Kp{passed}); "
                f"Kp = K zero-padded to {group}",
                "group_size": str(group),
                "loading": how,
                "recorded": datetime.date.today().isoformat(),
                "host": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "recorded_by": "scripts/record_q4_0_golden.py",
            }
            target = args.out / f"{args.name}-g{group}.safetensors"
            save_file(tensors, str(target), metadata={"provenance": json.dumps(provenance)})
            print(f"record: {len(tensors) // 3} cases -> {target}")
    print(json.dumps(provenance, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
