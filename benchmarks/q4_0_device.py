"""On-device Q4_0 quantizer: bit-exactness against the torch reference, and speed.

Runs on a CUDA machine (see benchmarks/device/README.md for the bundle; only torch,
Triton and this repository are needed here).

- Golden: the kernel against the outputs of two builds of Intel's compiled Q4_0 library
  recorded in tests/data/q4_0_golden (branch-v1.0's five-argument build at group 64; the
  six-argument build of llm-scaler PR #334 at groups 32, 64 and 128; bf16/fp16/fp32,
  near-ties, padding, edges), and against the reference on the near-tie probe at 128.
- Exactness: random shapes (odd N, K that needs padding), float16/bfloat16/float32,
  group sizes 32/64/128, and the adversarial groups of tests/q4_0_cases.py. The
  kernel runs on the GPU, the reference on the CPU; packed words and the fp16
  scale bits must be equal, and so must the two dequantisers' outputs.
- Speed: the kernel's bytes moved per second (bf16 read + int4 and scales written),
  for the best of a sweep of tile shapes, against a device-to-device copy measured
  in the same run; and the whole ``quantize`` call (allocation, kernel, the inf/NaN
  check with its sync) per layer
  against a stand-in of the host path llm-scaler's sym_int4 takes (copy to host, upcast to
  fp32, quantize there, copy back) in which the torch reference, not Intel's C library,
  quantizes, on all host threads and on one. The reference computes its fused step in
  float64, so that stand-in is slower than the library would be: the speed-ups are
  against it, not against Intel's library.

    python benchmarks/q4_0_device.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from q4_0_cases import adversarial, golden_files, load_golden
from qwen27b_tp4 import LAYERS

from vllm_xpu_memfix.kernels import q4_0_reference as reference
from vllm_xpu_memfix.kernels import q4_0_triton as kernel
from vllm_xpu_memfix.kernels.q4_0_probe import near_tie_probe

SHAPES = ((1, 128), (7, 300), (33, 1000), (129, 4100), (1000, 5120), (257, 4352), (3, 17408))
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCKS = (4, 8, 16, 32, 64)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a.cpu(), b.cpu())


def exactness(**tiles: int) -> dict:
    cases = mismatches = elements = 0
    failures = []
    generator = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for group in (32, 64, 128):
            inputs = [("adversarial", adversarial(group, dtype))]
            for n, k in SHAPES:
                scale = float(torch.empty(1).log_normal_(generator=generator)) * 0.05
                inputs.append((f"randn {n}x{k}", (torch.randn(n, k, generator=generator) * scale)))
                ties = torch.randint(-16, 17, (n, k), generator=generator) / 2.0
                inputs.append((f"halves {n}x{k}", ties))
            for name, weight in inputs:
                weight = weight.to(dtype)
                q_ref, s_ref = reference.quantize(weight, group)
                q_dev, s_dev = kernel.quantize(weight.cuda(), group, **tiles)
                deq_ref = reference.dequantize(q_ref, s_ref, group)
                deq_dev = kernel.dequantize(q_ref.cuda(), s_ref.cuda(), group)
                ok = same(q_ref, q_dev) and same(s_ref, s_dev) and same(deq_ref, deq_dev)
                cases += 1
                elements += weight.numel()
                if not ok:
                    mismatches += 1
                    words = int((q_ref != q_dev.cpu()).sum())
                    failures.append(f"{name} {dtype} g{group}: {words} packed words differ")
    refused = 0
    for bad in (float("nan"), float("inf"), float("-inf")):
        weight = torch.randn(8, 256, device="cuda")
        weight[3, 200] = bad
        try:
            kernel.quantize(weight, 128, **tiles)
        except ValueError:
            refused += 1
    return {
        "tiles": tiles,
        "cases": cases,
        "elements": elements,
        "non_finite_refused": refused,
        "mismatching_cases": mismatches,
        "failures": failures[:20],
    }


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return int((a.cpu() != b.cpu()).sum())


def golden(**tiles: int) -> dict:
    """Words and scale bits that differ between the kernel and each recorded build of
    Intel's library, per recording (build and group) and case."""
    recordings = {}
    for path in golden_files():
        cases, provenance = load_golden(path)
        group = int(provenance["group_size"])
        rows = {}
        for name, case in sorted(cases.items()):
            qweight, scales = kernel.quantize(case["weight"].cuda(), group, **tiles)
            rows[name] = {
                "words": case["qweight"].numel(),
                "words_differ": differing(qweight, case["qweight"]),
                "scales_differ": differing(scales, case["scales"]),
            }
        identical = [
            name for name, row in rows.items() if not row["words_differ"] + row["scales_differ"]
        ]
        recordings[path.stem] = {
            "library": provenance["library"],
            "library_sha256": provenance["library_sha256"],
            "group_size": group,
            "cases": rows,
            "identical_cases": len(identical),
        }
    probes = {}
    for dtype in DTYPES:
        probe = near_tie_probe(128, dtype)
        expected, _ = reference.quantize(probe, 128)
        qweight, _ = kernel.quantize(probe.cuda(), 128, **tiles)
        probes[str(dtype)] = {
            "words": expected.numel(),
            "words_differ": differing(qweight, expected),
        }
    return {
        "tiles": tiles,
        "recordings": recordings,
        "near_tie_probe_g128_vs_reference": probes,
    }


def cuda_time(fn, *args, repeats: int = 20, **kwargs) -> float:
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn, *args, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def host_path(weight: torch.Tensor) -> None:
    qweight, scales = reference.quantize(weight.cpu().float(), 128)
    qweight.to(weight.device), scales.to(weight.device)


def copy_bandwidth(size: int = 2 * 1024**3, graph: bool = False, launches: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of ``size`` bytes;
    ``graph``: replayed from a CUDA graph, as the kernel is timed."""
    source = torch.empty(size, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    if not graph:
        return 2 * size / cuda_time(target.copy_, source)
    copies = torch.cuda.CUDAGraph()
    with torch.cuda.graph(copies):
        for _ in range(launches):
            target.copy_(source)
    return 2 * size * launches / cuda_time(copies.replay)


TILES = [
    {"block_n": b, "groups": g, "num_warps": w}
    for b in (4, 8, 16, 32)
    for g in (1, 2, 4, 8)
    for w in (2, 4, 8)
]


def kernel_seconds(weight: torch.Tensor, tiles: dict, launches: int = 20) -> float:
    """The kernel alone, into preallocated outputs: what the bandwidth figure is about.
    Replayed from a CUDA graph, so Python's launch cost is not in the figure."""
    n, k = weight.shape
    qweight = torch.empty((n, k // 8), dtype=torch.int32, device=weight.device)
    scales = torch.empty((n, k // 128), dtype=torch.float16, device=weight.device)
    kernel.launch(weight, qweight, scales, 128, **tiles)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            kernel.launch(weight, qweight, scales, 128, **tiles)
    return cuda_time(graph.replay) / launches


def speed() -> dict:
    copy_bw = copy_bandwidth()
    threads = torch.get_num_threads()
    weights = {
        name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for name, n, k in LAYERS
    }
    sweep = []
    for tiles in TILES:
        per_layer = {name: kernel_seconds(w, tiles) for name, w in weights.items()}
        sweep.append({**tiles, "total_s": sum(per_layer.values()), "per_layer": per_layer})
    best = min(sweep, key=lambda row: row["total_s"])
    tiles = {key: best[key] for key in ("block_n", "groups", "num_warps")}
    rows = []
    for name, n, k in LAYERS:
        weight = weights[name]
        moved = n * k * 2 + n * k // 2 + n * (k // 128) * 2
        kernel_s = best["per_layer"][name]
        same_size_copy = copy_bandwidth(n * k * 2, graph=True)
        call_s = cuda_time(kernel.quantize, weight, 128, **tiles)
        host_all = wall_time(host_path, weight)
        torch.set_num_threads(1)
        host_one = wall_time(host_path, weight)
        torch.set_num_threads(threads)
        rows.append(
            {
                "layer": name,
                "n": n,
                "k": k,
                "bytes_moved": moved,
                "kernel_s": kernel_s,
                "bandwidth": moved / kernel_s,
                "fraction_of_copy": moved / kernel_s / copy_bw,
                "same_size_copy_bandwidth": same_size_copy,
                "fraction_of_same_size_copy": moved / kernel_s / same_size_copy,
                "quantize_call_s": call_s,
                "host_s_all_threads": host_all,
                "host_s_one_thread": host_one,
                "speedup_all_threads": host_all / call_s,
                "speedup_one_thread": host_one / call_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    sweep.sort(key=lambda row: row["total_s"])
    return {
        "copy_bandwidth": copy_bw,
        "host_threads": threads,
        "tiles": tiles,
        "layers": rows,
        "sweep_top": sweep[:8],
        "sweep_worst": sweep[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--golden-only", action="store_true", help="skip exactness and speed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    started = time.perf_counter()
    tiles = {"block_n": kernel.BLOCK_N, "groups": kernel.GROUPS, "num_warps": kernel.NUM_WARPS}
    against_library = golden(**tiles)
    print(json.dumps(against_library), flush=True)
    if args.golden_only:
        (args.out / "q4_0_golden.json").write_text(json.dumps(against_library, indent=1))
        return
    exact = [exactness(block_n=kernel.BLOCK_N, groups=kernel.GROUPS, num_warps=kernel.NUM_WARPS)]
    print(json.dumps(exact[0]), flush=True)
    fast = speed()
    if fast["tiles"] != exact[0]["tiles"]:
        exact.append(exactness(**fast["tiles"]))
        print(json.dumps(exact[-1]), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "golden": against_library,
        "exactness": exact,
        "speed": fast,
        "seconds": time.perf_counter() - started,
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    (args.out / "q4_0_device.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
