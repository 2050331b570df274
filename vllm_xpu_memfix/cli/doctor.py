"""``vllm-xpu-memfix doctor``: will this serve command fit in host memory, and if not, why.

Reads only files: /proc, the cgroup, sysfs, dpkg's status, library names and
the checkpoint's safetensors headers. It never loads the model or starts the
driver, so it runs in seconds. The figures are estimates; the ledger of a real
start is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_xpu_memfix import config, driver
from vllm_xpu_memfix.config import Settings
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, CheckpointError, read_checkpoint
from vllm_xpu_memfix.memory.snapshot import ProcReader
from vllm_xpu_memfix.units import STAGING_BYTES_PER_PARAM, GiB

# Host RAM of the vLLM processes themselves, per rank: vllm #50269's maintainers
# call ~15 GB normal on 4x B60 and ~10 GB on one CUDA GPU.
BASELINE_PER_RANK = 3.5 * GiB
# Quantization methods that convert 16-bit weights while loading, through the host.
ON_THE_FLY_QUANT = {"sym_int4", "fp8", "int4", "woq_int4"}
# sym_int4 staging per parameter of the layer in flight: the host bf16 copy (2),
# its fp32 upcast (4), packed int4 (0.5) and fp16 scales per 128 (2/128).
# Device bytes per parameter of a sym_int4 linear weight: 4 bits plus an fp16 scale per 128.
SYM_INT4_BYTES_PER_PARAM = 0.5 + 2 / 128
AT_RISK_SHARE = 0.85


@dataclass(frozen=True)
class ServeArgs:
    model: Path | None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.92
    quantization: str | None = None
    dtype: str | None = None
    device_memory_gib: float | None = None


@dataclass
class Report:
    host: dict[str, Any]
    gpus: dict[str, Any]
    environment: dict[str, str]
    plugin: dict[str, str]
    model: dict[str, Any] | None
    per_rank: dict[str, float]
    total: dict[str, float]
    verdict: str
    main_cause: str
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def _device_bytes(gpus: list[driver.Gpu], override_gib: float | None) -> tuple[int | None, str]:
    if override_gib is not None:
        return int(override_gib * GiB), "--device-memory-gib"
    sizes = [g.vram_bytes for g in gpus if g.vram_bytes]
    if sizes:
        return min(sizes), "sysfs physical_vram_size_bytes"
    known = [
        driver.KNOWN_PRODUCTS[g.device_id][1] for g in gpus if g.device_id in driver.KNOWN_PRODUCTS
    ]
    if known:
        return min(known) * GiB, "product table (assumed)"
    return None, "unknown: pass --device-memory-gib"


def _staging(
    ckpt: Checkpoint | None, args: ServeArgs, environ: Mapping[str, str]
) -> tuple[float, str]:
    """Host bytes per rank for weight conversion during loading, with the reason."""
    quant = (args.quantization or "").lower()
    if ckpt is None or quant not in ON_THE_FLY_QUANT or ckpt.dtype not in ("BF16", "F16", "F32"):
        return 0.0, "no on-the-fly quantization"
    tp = args.tensor_parallel_size
    linear = [t for t in ckpt.tensors if t.is_linear_weight]
    largest = max((t.nbytes / (2 if t.dtype in ("BF16", "F16") else 4) for t in linear), default=0)
    per_layer = largest / tp * STAGING_BYTES_PER_PARAM
    if environ.get("VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT") == "1":
        return (
            ckpt.total_bytes / tp + per_layer,
            "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT=1 holds the whole shard",
        )
    return per_layer, "one layer in flight (more if the allocator keeps freed staging)"


def diagnose(settings: Settings, args: ServeArgs, environ: Mapping[str, str]) -> Report:
    reader = ProcReader(settings.sysroot)
    snap = reader.take("self", pss=False)
    gpus = driver.intel_gpus(settings.sysroot)
    visible = driver.visible_gpus(gpus, environ)
    runtime = driver.compute_runtime(settings.sysroot)
    decision = driver_env.decide(settings, environ)
    tp = args.tensor_parallel_size
    used = visible[:tp] if visible else []
    device_bytes, device_source = _device_bytes(used or gpus, args.device_memory_gib)

    ckpt = read_checkpoint(args.model) if args.model else None
    notes: list[str] = []
    if len(visible) < tp and gpus:
        notes.append(
            f"--tensor-parallel-size {tp} but only {len(visible)} Intel GPU(s) are visible"
        )

    # Driver mirror: host pinned per device allocation, i.e. about what each rank
    # allocates on its device (weights + KV cache up to the utilisation).
    defer_backing_off = (
        environ.get("EnableDeferBacking") == "0" and environ.get("NEOReadDebugKeys") == "1"
    )
    bmg = sum(g.is_battlemage for g in visible)
    runtime_affected = runtime is None or runtime.affected
    mirror_possible = bmg >= 2 and runtime_affected
    mirror_active = mirror_possible and not decision.apply and not defer_backing_off
    device_use = (device_bytes or 0) * args.gpu_memory_utilization
    staging, staging_why = _staging(ckpt, args, environ)
    per_rank = {
        "device_use": device_use,
        "driver_mirror": device_use if mirror_active else 0.0,
        "quantization_staging": staging,
        "process_baseline": float(BASELINE_PER_RANK),
    }
    need = tp * (per_rank["driver_mirror"] + staging + per_rank["process_baseline"])
    page_cache = float(ckpt.total_bytes) if ckpt else 0.0
    available = float(snap.mem_available or 0)
    swap_free = float(snap.swap_free or 0)
    room = available
    total = {
        "host_need": need,
        "page_cache": page_cache,
        "mem_available": available,
        "swap_free": swap_free,
    }
    if snap.cgroup_max is not None:
        cg_room = float(snap.cgroup_max - (snap.cgroup_current or 0))
        total["cgroup_room"] = cg_room
        # The checkpoint's page cache is charged to the container's cgroup.
        room = min(room, cg_room - page_cache)

    causes = {
        "driver mirror": tp * per_rank["driver_mirror"],
        "quantization staging": tp * staging,
        "process baseline": tp * per_rank["process_baseline"],
    }
    main_cause = max(causes, key=lambda k: causes[k])
    if need > room:
        verdict = "will run out of memory"
    elif need > AT_RISK_SHARE * room:
        verdict = "at risk"
    else:
        verdict = "fits"

    changes = []
    if mirror_active:
        saved = f"removes the driver mirror (-{_gib(causes['driver mirror'])})"
        if decision.user_set:
            changes.append(
                f"unset {' '.join(decision.user_set)}: the plugin then sets NEOReadDebugKeys=1 "
                f"EnableDeferBacking=0, which {saved}"
            )
        else:
            changes.append(
                "let the plugin set NEOReadDebugKeys=1 EnableDeferBacking=0 "
                f"({driver_env.SWITCH}=auto or on), which {saved}"
            )
        others = need - causes["driver mirror"]
        if device_bytes and room > others:
            fit_util = (AT_RISK_SHARE * room - others) / (tp * device_bytes)
            if 0 < fit_util < args.gpu_memory_utilization:
                changes.append(
                    f"or keep the mirror and lower --gpu-memory-utilization to {fit_util:.2f}"
                )
    if environ.get("VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT") == "1" and staging:
        changes.append(
            "unset VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT: it keeps each rank's 16-bit shard on the host"
        )
    if staging and verdict != "fits":
        changes.append(
            "serve a checkpoint quantized ahead of time: no weights are converted on the host"
        )
    if snap.cgroup_max is not None and page_cache and verdict != "fits":
        changes.append(
            "raise the container's memory limit: the checkpoint's page cache is charged to it"
        )
    if verdict != "fits" and not changes:
        changes.append("add host RAM, or serve on fewer GPUs per host")

    model_info = None
    if ckpt is not None:
        weight_bytes = float(ckpt.total_bytes)
        if (args.quantization or "").lower() == "sym_int4":
            linear = sum(
                t.nbytes / 2
                for t in ckpt.tensors
                if t.is_linear_weight and t.dtype in ("BF16", "F16")
            )
            weight_bytes = weight_bytes - 2 * linear + linear * SYM_INT4_BYTES_PER_PARAM
        model_info = {
            "directory": str(ckpt.directory),
            "shards": len(ckpt.shards),
            "checkpoint_bytes": ckpt.total_bytes,
            "checkpoint_dtype": ckpt.dtype,
            "device_weight_bytes_per_rank": weight_bytes / tp,
            "staging": staging_why,
        }
        if device_bytes and weight_bytes / tp > device_use:
            notes.append("the weights alone exceed the device memory at this utilisation")

    host = {
        "mem_total": snap.mem_total, "mem_available": snap.mem_available,
        "swap_total": snap.swap_total, "swap_free": snap.swap_free,
        "cgroup_current": snap.cgroup_current, "cgroup_max": snap.cgroup_max,
    }  # fmt: skip
    gpu_info = {
        "intel_gpus": [f"{g.card} {g.pci_slot} 0x{g.device_id:04x} {g.product}" for g in gpus],
        "visible": len(visible),
        "visible_battlemage": bmg,
        "device_memory_bytes": device_bytes,
        "device_memory_source": device_source,
        "compute_runtime": f"{runtime.version} ({runtime.source})" if runtime else "not found",
        "runtime_in_mirror_range": runtime_affected,
        "level_zero_loader": driver.level_zero_loader(settings.sysroot) or "not found",
        "driver_guard": f"{'applies' if decision.apply else 'does not apply'}: {decision.reason}",
    }
    names = ("NEOReadDebugKeys", "EnableDeferBacking", "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR",
             "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT")  # fmt: skip
    environment = {k: environ[k] for k in names if k in environ}
    plugin = {key: mode.value for key, mode in settings.modes.items()}
    plugin["enabled"] = str(settings.enabled)
    return Report(host, gpu_info, environment, plugin, model_info, per_rank, total, verdict,
                  main_cause, changes, notes)  # fmt: skip


def _gib(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value / GiB:,.1f} GiB" if abs(value) >= GiB else f"{value / 2**20:,.0f} MiB"


def render(report: Report, args: ServeArgs) -> str:
    h, g = report.host, report.gpus
    limit = "none" if h["cgroup_max"] is None else _gib(h["cgroup_max"])
    lines = [
        "Host",
        f"  RAM {_gib(h['mem_total'])}, available {_gib(h['mem_available'])}, "
        f"swap {_gib(h['swap_total'])} ({_gib(h['swap_free'])} free), cgroup limit {limit}",
        "GPUs",
        *(f"  {gpu}" for gpu in g["intel_gpus"] or ["no Intel GPU found in sysfs"]),
        f"  visible: {g['visible']} ({g['visible_battlemage']} Battlemage); device memory "
        f"{_gib(g['device_memory_bytes'])} ({g['device_memory_source']})",
        f"  compute-runtime {g['compute_runtime']}; Level Zero loader {g['level_zero_loader']}",
        f"  driver guard {g['driver_guard']}",
        "Environment",
        *(f"  {k}={v}" for k, v in report.environment.items()),
        *([] if report.environment else ["  (none of the relevant variables is set)"]),
        "Plugin switches",
        "  " + ", ".join(f"{k}={v}" for k, v in report.plugin.items()),
    ]
    if report.model:
        m = report.model
        lines += [
            "Model",
            f"  {m['directory']}: {m['shards']} shard(s), {_gib(m['checkpoint_bytes'])} "
            f"{m['checkpoint_dtype']}; weights on each device "
            f"{_gib(m['device_weight_bytes_per_rank'])}",
        ]
    r = report.per_rank
    lines += [
        f"Per rank (TP {args.tensor_parallel_size}, "
        f"--gpu-memory-utilization {args.gpu_memory_utilization})",
        f"  device memory in use   {_gib(r['device_use'])}",
        f"  host: driver mirror    {_gib(r['driver_mirror'])}",
        f"  host: quant. staging   {_gib(r['quantization_staging'])}",
        f"  host: process baseline {_gib(r['process_baseline'])}",
        "Host total",
        f"  need {_gib(report.total['host_need'])} + checkpoint page cache "
        f"{_gib(report.total['page_cache'])} (reclaimable), "
        f"against {_gib(report.total['mem_available'])} available",
        f"Verdict: {report.verdict.upper()} (largest part: {report.main_cause})",
        *(f"  - {change}" for change in report.changes),
        *(f"  note: {note}" for note in report.notes),
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    serve = ServeArgs(
        model=Path(args.model) if args.model else None,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        dtype=args.dtype,
        device_memory_gib=args.device_memory_gib,
    )
    try:
        report = diagnose(config.load(), serve, os.environ)
    except CheckpointError as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else render(report, serve))
    return 0
