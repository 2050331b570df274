"""device_quant on a whole 27B-like layer stack at TP 4 shapes, through the sym_int4 replay.

Runs on a CUDA machine with the bundle of benchmarks/device/README.md and the replay
module placed where Intel's images have it
(``vllm/model_executor/layers/quantization/sym_int4.py``, from
tests/plugins/sym_int4_replay). Layout 0.21 (the host round trip): every Linear layer
and MoE side goes through ``_quantize_linear_int4_inplace`` /
``_quantize_moe_int4_side_inplace`` as vLLM's ``process_weights_after_loading`` calls
them, once with the module's own host path and once with device_quant installed.

Arms (each in a fresh process, so host and device peaks are its own):

- ``streaming``: BF16 already on the device, as the 0.21 streaming load leaves it;
- ``legacy``: BF16 buffered on the host (``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT=1``) and moved
  to the device one layer at a time, as vLLM's ``device_loading_context`` does around
  ``process_weights_after_loading``.

Per arm, medians over ``--rounds`` passes over a freshly built stack: wall time of the
whole stack (the device path's one self-check and Triton compile fall in its first pass),
the host RSS high-water mark above the pass's start (VmHWM, reset through
``/proc/self/clear_refs``), and the largest device transient of one step (torch's peak
during the step above what was allocated before it: for the legacy load that includes
the layer's BF16 moved in). Every parameter each step
leaves (dtype, shape, strides, bytes) and its plain attributes are hashed per layer; the
device path must match the host path in every layer.

Stood in: the module's C library (``ggml_quantize_tensor`` runs the Q4_0 torch reference
on the host's cores, where the real library uses one thread per call) and vllm-xpu-kernels'
``transpose_onednn_woq_format`` (the replay's function of that name); the replay's
``.to(device)`` targets CUDA where Intel's targets XPU.

    python benchmarks/device_quant_stack.py --out DIR [--layers 64] [--moe-layers 2]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qwen27b_tp4 import ATTENTION, GDN, MLP

MODULE = "vllm.model_executor.layers.quantization.sym_int4"
LOADS = ("streaming", "legacy")
PATHS = ("host", "device")
# Qwen3-30B-A3B-like MoE layer at TP 4: 128 experts, hidden 2048, intermediate 768 / 4 =
# 192, which the module pads to 256 (w13 [E, 2I, H], w2 [E, H, I]).
MOE = (128, 2048, 192)


def stack(layers: int) -> list[tuple[str, int, int]]:
    shapes = []
    for index in range(layers):
        mixer = ATTENTION if index % 4 == 3 else GDN
        shapes += [(f"{index}.{name}", n, k) for name, n, k in (*mixer, *MLP)]
    return shapes


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def digest(layer: Any) -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {}
    for name, tensor in sorted(layer.named_parameters()):
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
        meta = [str(tensor.dtype), list(tensor.shape), list(tensor.stride())]
        found[name] = [*meta, hashlib.sha256(data.tobytes()).hexdigest()]
    for name in ("weight", "w13_weight", "w2_weight"):
        if hasattr(layer, name):
            found[f"attr {name}"] = repr(getattr(layer, name))
    for name, value in sorted(vars(layer).items()):
        if name.startswith("_int4") or name == "_already_called_process_weights_after_loading":
            found[f"attr {name}"] = value
    return found


def build(load: str, layers: int, moe_layers: int) -> list[tuple[str, Any]]:
    """The stack's layers with seeded BF16 weights, on the device or (legacy) the host."""
    import torch

    device = torch.device("cuda", 0)
    home = torch.device("cpu") if load == "legacy" else device
    generator = torch.Generator(device=device)

    def weight(seed: int, *shape: int) -> Any:
        generator.manual_seed(seed)
        data = torch.randn(*shape, generator=generator, device=device) * 0.02
        return torch.nn.Parameter(data.to(torch.bfloat16).to(home), requires_grad=False)

    built = []
    for index, (name, n, k) in enumerate(stack(layers)):
        layer = torch.nn.Module()
        layer.weight = weight(index, n, k)
        built.append((name, layer))
    experts, hidden, intermediate = MOE
    for index in range(moe_layers):
        layer = torch.nn.Module()
        layer.w13_weight = weight(10_000 + 2 * index, experts, 2 * intermediate, hidden)
        layer.w2_weight = weight(10_001 + 2 * index, experts, hidden, intermediate)
        built.append((f"moe {index}", layer))
    return built


def quantize_stack(module: Any, built: list[tuple[str, Any]]) -> dict[str, float]:
    """One pass over the stack, as process_weights_after_loading makes it."""
    import torch

    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.synchronize()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss_start = vm_kib("VmRSS")
    transient = 0
    started = time.perf_counter()
    for _, layer in built:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for param in layer.parameters():  # device_loading_context, for the legacy load
            param.data = param.data.to(device)
        if hasattr(layer, "w13_weight"):
            for side in ("w13", "w2"):
                module._quantize_moe_int4_side_inplace(layer, side)
        else:
            module._quantize_linear_int4_inplace(layer)
        transient = max(transient, torch.cuda.max_memory_allocated() - before)
    torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - started,
        "host_peak_mib": (vm_kib("VmHWM") - rss_start) / 1024,
        "device_transient_mib": transient / 2**20,
    }


def run_arm(load: str, path: str, layers: int, moe_layers: int, rounds: int) -> dict[str, Any]:
    """``rounds`` passes over a freshly built stack; digests of the last one."""
    module = importlib.import_module(MODULE)
    assert module.LAYOUT == "0.21", "set SYM_INT4_REPLAY_LAYOUT=0.21"
    if path == "device":
        from vllm_xpu_memfix.core import config
        from vllm_xpu_memfix.core.patching import Patcher
        from vllm_xpu_memfix.fixes import device_quant

        device_quant.install(Patcher(), config.load({}))
    passes = []
    for _ in range(rounds):
        built = build(load, layers, moe_layers)
        bf16_bytes = sum(t.numel() * 2 for _, m in built for t in m.parameters())
        passes.append(quantize_stack(module, built))
    medians = {key: statistics.median(p[key] for p in passes) for key in passes[0]}
    return {
        "load": load,
        "path": path,
        **medians,
        "passes": passes,
        "bf16_gib": bf16_bytes / 2**30,
        "digests": {name: digest(layer) for name, layer in built},
    }


def compare(host: dict[str, Any], device: dict[str, Any]) -> list[str]:
    differ = []
    for name, expected in host["digests"].items():
        if device["digests"].get(name) != expected:
            differ.append(name)
    return differ


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| load | path | wall s | host peak above start MiB | largest device transient MiB |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['load']} | {r['path']} | {r['seconds']:.2f} | {r['host_peak_mib']:,.0f} | "
            f"{r['device_transient_mib']:,.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="passes per arm; medians reported")
    parser.add_argument(
        "--reuse", action="store_true", help="take arms already in --out instead of running them"
    )
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # "<load> <path>", in a child
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        load, path = args.arm.split()
        result = run_arm(load, path, args.layers, args.moe_layers, args.rounds)
        (args.out / f"arm-{load}-{path}.json").write_text(json.dumps(result))
        return
    env = {**os.environ, "SYM_INT4_REPLAY_LAYOUT": "0.21"}
    results, summary = [], {}
    for load in LOADS:
        for path in PATHS:
            command = [sys.executable, __file__, "--out", str(args.out), "--arm", f"{load} {path}"]
            command += ["--layers", str(args.layers), "--moe-layers", str(args.moe_layers)]
            command += ["--rounds", str(args.rounds)]
            arm = args.out / f"arm-{load}-{path}.json"
            if not (args.reuse and arm.exists()):
                subprocess.run(command, env=env, check=True)
            results.append(json.loads(arm.read_text()))
            print(f"{load} {path}: {results[-1]['seconds']:.2f} s", flush=True)
        host, device = results[-2], results[-1]
        differ = compare(host, device)
        summary[load] = {
            "layers": len(host["digests"]),
            "identical": len(host["digests"]) - len(differ),
            "differ": differ,
            "speed_up": host["seconds"] / device["seconds"],
        }
    for r in results:
        r.pop("digests")
    report = {"arms": results, "exactness": summary, "torch": __import__("torch").__version__}
    (args.out / "device_quant_stack.json").write_text(json.dumps(report, indent=1))
    print(table(results))
    for load, s in summary.items():
        print(
            f"{load}: {s['identical']} of {s['layers']} layers identical; "
            f"device path {s['speed_up']:.1f}x faster"
        )


if __name__ == "__main__":
    main()
