"""The host quantize step: a build of Intel's Q4_0 library against the torch stand-in.

``benchmarks/q4_0_device.py`` times the host path of llm-scaler's ``sym_int4`` with the
torch reference standing in for Intel's C library (no build of it runs on the GPU
machine), and its speed-ups are against that stand-in. This runs both on the same host
thread, per 27B-like TP-4 layer, so the stand-in's cost can be read against the library's:
the step each times is the same (bf16 -> fp32 upcast, K padded to 128, quantize into zeroed
outputs). Needs a six-argument build (``quantize_q4_0_to_qweight_and_scale(..., N, K,
block)``; provenance of the one used: tests/data/q4_0_golden/README.md), never committed.

    python benchmarks/q4_0_host_library.py --library vllm_int4_for_multi_arc.so [--repeats 3]

Writes ``benchmarks/results/q4_0-host-library-<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen27b_tp4 import LAYERS

from vllm_xpu_memfix.kernels import q4_0_reference as reference

GROUP = 128
RESULTS = Path(__file__).resolve().parent / "results"


def library_step(function, weight: torch.Tensor) -> None:
    src = weight.float().contiguous()
    n, k = src.shape
    qweight = torch.zeros((n, k // 8), dtype=torch.int32)
    scales = torch.zeros((n, k // GROUP), dtype=torch.float16)
    function(src.data_ptr(), qweight.data_ptr(), scales.data_ptr(), n, k, GROUP)


def stand_in_step(weight: torch.Tensor) -> None:
    reference.quantize(weight.float(), GROUP)


def median_seconds(step, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times), times


def ms(median: float, each: list[float]) -> str:
    return f"{median * 1e3:,.0f} ({', '.join(f'{t * 1e3:,.0f}' for t in each)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.library.is_file():
        print(f"q4_0_host_library: {args.library} is not a file", file=sys.stderr)
        return 2
    function = ctypes.CDLL(str(args.library)).quantize_q4_0_to_qweight_and_scale
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    function.restype = ctypes.c_size_t
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in LAYERS:
        weight = (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
        lib_s, lib_all = median_seconds(lambda w=weight: library_step(function, w), args.repeats)
        ref_s, ref_all = median_seconds(lambda w=weight: stand_in_step(w), args.repeats)
        rows.append(
            f"| {name} | {n} x {k} | {ms(lib_s, lib_all)} | {ms(ref_s, ref_all)} "
            f"| {ref_s / lib_s:.1f}x |"
        )
        print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]
    digest = hashlib.sha256(args.library.read_bytes()).hexdigest()
    today = datetime.date.today().isoformat()
    lines = [
        f"# The host quantize step: Intel's library against the torch stand-in, {today}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, one torch thread; "
        f"torch {torch.__version__}. Library: SHA-256 `{digest}` (provenance: "
        "tests/data/q4_0_golden/README.md). Step timed in both: the layer's bf16 upcast to "
        f"fp32, then quantized at group {GROUP} into zeroed outputs; medians of "
        f"{args.repeats} (each run in brackets), in ms. Load average (1 min) "
        f"{load_before:.1f} before and {load_after:.1f} after: the host is shared, so the "
        "timings are noisy.",
        "",
        f"`python benchmarks/q4_0_host_library.py --library LIB --repeats {args.repeats}`",
        "",
        "| layer (27B-like, TP 4) | N x K | library ms | torch stand-in ms | stand-in / library |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    target = RESULTS / f"q4_0-host-library-{today}.md"
    target.write_text("\n".join(lines))
    print(f"q4_0_host_library: -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
