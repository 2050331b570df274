"""``vllm-xpu-memfix doctor``: will this serve command fit in host memory, and if not, why.

Reads only files: /proc, the cgroup, sysfs, dpkg's status, library names and
the checkpoint's safetensors headers. It never loads the model or starts the
driver, so it runs in seconds. The figures are estimates; the ledger of a real
start is the measurement.

The model is a directory or a Hugging Face id, read from the local Hugging Face
cache (never the network). Whatever doctor could not see or refused is said in the
report; a checkpoint it cannot read at all exits 2 with one line saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.units import STAGING_BYTES_PER_PARAM, GiB
from vllm_xpu_memfix.fixes import driver_env, load_lock
from vllm_xpu_memfix.intel import driver, int4_self_check
from vllm_xpu_memfix.memory import hub_cache
from vllm_xpu_memfix.memory.checkpoint import (
    TORCH_DTYPES,
    Checkpoint,
    CheckpointError,
    checkpoint_from_params,
    read_checkpoint,
    text_config,
)
from vllm_xpu_memfix.memory.room import Room, host_room
from vllm_xpu_memfix.memory.snapshot import ProcReader, Snapshot

# Host RAM of the vLLM processes themselves, per rank: vllm #50269's maintainers
# call ~15 GB normal on 4x B60 and ~10 GB on one CUDA GPU.
BASELINE_PER_RANK = 3.5 * GiB
# Quantization methods that convert 16-bit weights while loading, through the host.
ON_THE_FLY_QUANT = {"sym_int4", "fp8", "int4", "woq_int4"}
# Device bytes per parameter of a sym_int4 linear weight: 4 bits plus an fp16 scale per 128.
SYM_INT4_BYTES_PER_PARAM = 0.5 + 2 / 128
AT_RISK_SHARE = 0.85
# The variables that change how much host memory a start takes, shown when set.
RELEVANT_ENV = (
    "NEOReadDebugKeys",
    "EnableDeferBacking",
    "ZE_AFFINITY_MASK",
    "ONEAPI_DEVICE_SELECTOR",
    "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT",
)


@dataclass(frozen=True)
class ServeArgs:
    model: str | None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.92
    quantization: str | None = None
    dtype: str | None = None
    device_memory_gib: float | None = None
    max_parallel_loading_workers: int | None = None
    params: int | None = None


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


OFFLOAD = "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT"
SYM_INT4 = "vllm.model_executor.layers.quantization.sym_int4"
SELF_CHECK = "device_quant self-check"
LONG_LINES = ("sym_int4", SELF_CHECK)  # rendered on lines of their own
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.\d+\.(?P<proj>\w+)\.weight$")
_SIDE = {
    "gate_proj": "w13",
    "up_proj": "w13",
    "w1": "w13",
    "w3": "w13",
    "down_proj": "w2",
    "w2": "w2",
}


def legacy_load(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether sym_int4 will buffer each rank's whole 16-bit shard on the host, and why.

    Only where the installed module reads ``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT``: the 0.14
    and 0.21 images' does; the 0.26 images' no longer does, though their Dockerfiles
    still set it (llm-scaler #672).
    """
    from vllm_xpu_memfix.cli import compat

    if environ.get(OFFLOAD) != "1":
        return False, f"{OFFLOAD} unset: one layer in flight"
    root = compat.installed_vllm_root()
    source = compat.module_source(root, SYM_INT4) if root is not None else None
    if source is None:
        return False, f"{OFFLOAD}=1, but no sym_int4 is installed here to read it"
    if OFFLOAD not in source:
        return False, f"{OFFLOAD}=1 is stale: this sym_int4 never reads it (llm-scaler #672)"
    return True, f"{OFFLOAD}=1: sym_int4's legacy load holds the whole 16-bit shard"


def _config_int(section: dict[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` that holds a positive integer."""
    for key in keys:
        value = section.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _largest_from_config(config: dict[str, Any]) -> tuple[float, str]:
    """The largest staged unit from config.json's sizes, where no tensor header was read."""
    text = text_config(config)
    hidden = _config_int(text, "hidden_size")
    if hidden is None:
        return 0.0, "no linear layer known (neither tensor headers nor config sizes)"
    linear = float(hidden * (_config_int(text, "intermediate_size") or hidden))
    experts = _config_int(text, "num_experts", "num_local_experts", "n_routed_experts")
    expert_inter = _config_int(text, "moe_intermediate_size")
    if experts and expert_inter and 2 * experts * expert_inter * hidden > linear:
        return float(2 * experts * expert_inter * hidden), "an MoE side (from config.json)"
    return linear, "a linear layer (from config.json)"


def largest_staged_params(ckpt: Checkpoint) -> tuple[float, str]:
    """Parameters of the largest unit quantized at once: a Linear weight, or one MoE side
    (all experts' gate+up, or all experts' down, of one layer)."""
    if not ckpt.tensors:
        return _largest_from_config(ckpt.config)
    linear = 0.0
    sides: dict[tuple[str, str], float] = {}
    for tensor in ckpt.tensors:
        if not tensor.is_linear_weight:
            continue
        params = tensor.nbytes / (2 if tensor.dtype in ("BF16", "F16") else 4)
        match = _EXPERT.match(tensor.name)
        which = _SIDE.get(match.group("proj")) if match else None
        if match and which:
            key = (match.group("layer"), which)
            sides[key] = sides.get(key, 0.0) + params
        else:
            linear = max(linear, params)
    largest_side = max(sides.values(), default=0.0)
    if largest_side > linear:
        return largest_side, "an MoE side"
    return linear, "a linear layer"


def _staging(
    ckpt: Checkpoint | None, args: ServeArgs, legacy: tuple[bool, str]
) -> tuple[float, str]:
    """Host bytes per rank for weight conversion during loading, with the reason."""
    quant = (args.quantization or "").lower()
    if ckpt is None or quant not in ON_THE_FLY_QUANT or ckpt.dtype not in ("BF16", "F16", "F32"):
        return 0.0, "no on-the-fly quantization"
    tp = args.tensor_parallel_size
    params, unit = largest_staged_params(ckpt)
    per_layer = params / tp * STAGING_BYTES_PER_PARAM
    holds_shard, why = legacy
    if holds_shard and quant == "sym_int4":
        return ckpt.total_bytes / tp + per_layer, why
    in_flight = f"{unit} in flight (more if the allocator keeps freed staging)"
    return per_layer, in_flight if why.startswith(f"{OFFLOAD} unset") else f"{in_flight}; {why}"


def load_slots(
    settings: Settings, args: ServeArgs, holds_shard: bool, room: Room, shard: float
) -> int | None:
    """How many ranks the load lock lets stage at once; None where it stays off. Sized
    from the room as the lock sizes it, with the shard's bytes for the staging."""
    if not settings.requested(config.LOAD_LOCK):
        return None
    if args.max_parallel_loading_workers:
        return args.max_parallel_loading_workers
    if settings.mode(config.LOAD_LOCK) is config.Mode.ON:
        return settings.load_slots or 1
    if not holds_shard:
        return None
    if settings.load_slots is not None:
        return settings.load_slots
    slots, _ = load_lock.slots_for_room(room, shard, args.tensor_parallel_size)
    return slots if slots < args.tensor_parallel_size else None


@dataclass(frozen=True)
class Measurement:
    """What the files say: this host, its GPUs and driver, and the checkpoint."""

    snap: Snapshot
    gpus: list[driver.Gpu]
    visible: list[driver.Gpu]
    runtime: driver.Runtime | None
    level_zero_loader: str | None
    guard: driver_env.Decision
    device_bytes: int | None
    device_source: str
    ckpt: Checkpoint | None
    model_label: str
    legacy: tuple[bool, str]
    room: Room
    load_slots: int | None

    @property
    def visible_battlemage(self) -> int:
        return sum(g.is_battlemage for g in self.visible)

    @property
    def runtime_affected(self) -> bool:
        return self.runtime is None or self.runtime.affected


@dataclass(frozen=True)
class Estimate:
    """Host memory the serve command needs against the room there is, and the verdict."""

    mirror_active: bool
    staging_why: str
    per_rank: dict[str, float]
    total: dict[str, float]
    room: float
    causes: dict[str, float]
    verdict: str

    @property
    def need(self) -> float:
        return self.total["host_need"]

    @property
    def main_cause(self) -> str:
        return max(self.causes, key=lambda k: self.causes[k])


def _params_dtype(args: ServeArgs) -> str:
    """The checkpoint dtype assumed for a bare parameter count: --dtype's, else BF16."""
    return TORCH_DTYPES.get((args.dtype or "").removeprefix("torch."), "BF16")


def read_model(args: ServeArgs) -> tuple[Checkpoint | None, str]:
    """The checkpoint behind ``args.model`` (a directory, else a Hugging Face id looked up
    in the local cache) or behind ``--params`` alone, and how to name it."""
    if args.model is None:
        if args.params is None:
            return None, ""
        return checkpoint_from_params(args.params, _params_dtype(args)), "--params"
    path = Path(args.model)
    if path.is_dir() or path.exists() or not hub_cache.looks_like_repo_id(args.model):
        return read_checkpoint(path, args.params), str(path)
    try:
        cached = hub_cache.find_cached(args.model)
    except hub_cache.HubCacheError as exc:
        if args.params is None:
            raise CheckpointError(
                f"{exc}; pass a local path, or the model's size with --params (e.g. --params 8B)"
            ) from None
        ckpt = checkpoint_from_params(args.params, _params_dtype(args))
        return ckpt, f"{args.model} (not in the Hugging Face cache)"
    return read_checkpoint(cached.snapshot, args.params, name=args.model), cached.label


def measure(settings: Settings, args: ServeArgs, environ: Mapping[str, str]) -> Measurement:
    """Read every file doctor needs; nothing is loaded or started."""
    snap = ProcReader(settings.sysroot).take("self", pss=False)
    room = host_room(settings.sysroot)
    gpus = driver.intel_gpus(settings.sysroot)
    visible = driver.visible_gpus(gpus, environ)
    runtime = driver.compute_runtime(settings.sysroot)
    guard = driver_env.decide(settings, environ)
    used = visible[: args.tensor_parallel_size] if visible else []
    device_bytes, device_source = _device_bytes(used or gpus, args.device_memory_gib)
    legacy = legacy_load(environ)
    ckpt, model_label = read_model(args)
    shard = ckpt.total_bytes / args.tensor_parallel_size if ckpt else 0.0
    return Measurement(
        snap=snap,
        gpus=gpus,
        visible=visible,
        runtime=runtime,
        level_zero_loader=driver.level_zero_loader(settings.sysroot),
        guard=guard,
        device_bytes=device_bytes,
        device_source=device_source,
        ckpt=ckpt,
        model_label=model_label,
        legacy=legacy,
        room=room,
        load_slots=load_slots(settings, args, legacy[0], room, shard),
    )


def _mirror_active(measured: Measurement, environ: Mapping[str, str]) -> bool:
    """Whether the driver will pin a host mirror of each rank's device allocations."""
    defer_backing_off = (
        environ.get("EnableDeferBacking") == "0" and environ.get("NEOReadDebugKeys") == "1"
    )
    mirror_possible = measured.visible_battlemage >= 2 and measured.runtime_affected
    return mirror_possible and not measured.guard.apply and not defer_backing_off


def _verdict(need: float, room: float) -> str:
    if need > room:
        return "will run out of memory"
    if need > AT_RISK_SHARE * room:
        return "at risk"
    return "fits"


def decide(measured: Measurement, args: ServeArgs, environ: Mapping[str, str]) -> Estimate:
    """Host need per rank and per cause, the room for it, and whether it fits."""
    tp = args.tensor_parallel_size
    snap, ckpt = measured.snap, measured.ckpt
    mirror_active = _mirror_active(measured, environ)
    # Driver mirror: host pinned per device allocation, i.e. about what each rank
    # allocates on its device (weights + KV cache up to the utilisation).
    device_use = (measured.device_bytes or 0) * args.gpu_memory_utilization
    staging, staging_why = _staging(ckpt, args, measured.legacy)
    # With the load lock, ranks stage a few at a time; on the device the quantized weights
    # then leave the host, so only the ranks holding a slot stage at once.
    staging_ranks = min(tp, measured.load_slots) if staging and measured.load_slots else tp
    if staging_ranks < tp:
        staging_why += f"; the load lock lets {staging_ranks} of {tp} ranks stage at once"
    per_rank = {
        "device_use": device_use,
        "driver_mirror": device_use if mirror_active else 0.0,
        "quantization_staging": staging,
        "process_baseline": float(BASELINE_PER_RANK),
    }
    need = tp * (per_rank["driver_mirror"] + per_rank["process_baseline"]) + staging_ranks * staging
    page_cache = float(ckpt.total_bytes) if ckpt else 0.0
    # The room the load lock and the ledger use: in a container, the cgroup's limit less
    # its usage where smaller than MemAvailable; 0 where it could not be read.
    room = float(measured.room.bytes or 0)
    total = {
        "host_need": need,
        "page_cache": page_cache,
        "mem_available": float(snap.mem_available or 0),
        "room": room,
        "swap_free": float(snap.swap_free or 0),
    }
    if measured.room.cgroup.room is not None:
        total["cgroup_room"] = float(measured.room.cgroup.room)
    causes = {
        "driver mirror": tp * per_rank["driver_mirror"],
        "quantization staging": staging_ranks * staging,
        "process baseline": tp * per_rank["process_baseline"],
    }
    return Estimate(mirror_active, staging_why, per_rank, total, room, causes, _verdict(need, room))


def _mirror_changes(measured: Measurement, estimate: Estimate, args: ServeArgs) -> list[str]:
    """How to be rid of the driver mirror, or to make room for it."""
    mirror = estimate.causes["driver mirror"]
    saved = f"removes the driver mirror (-{_gib(mirror)})"
    if measured.guard.user_set:
        changes = [
            f"unset {' '.join(measured.guard.user_set)}: the plugin then sets "
            f"NEOReadDebugKeys=1 EnableDeferBacking=0, which {saved}"
        ]
    else:
        changes = [
            "let the plugin set NEOReadDebugKeys=1 EnableDeferBacking=0 "
            f"({driver_env.FIX.env}=auto or on), which {saved}"
        ]
    others = estimate.need - mirror
    device_bytes, room = measured.device_bytes, estimate.room
    if device_bytes and room > others:
        fit_util = (AT_RISK_SHARE * room - others) / (args.tensor_parallel_size * device_bytes)
        if 0 < fit_util < args.gpu_memory_utilization:
            changes.append(
                f"or keep the mirror and lower --gpu-memory-utilization to {fit_util:.2f}"
            )
    return changes


def advise(
    measured: Measurement, estimate: Estimate, args: ServeArgs, environ: Mapping[str, str]
) -> list[str]:
    """The changes to the serve command or the host that would make it fit, best first."""
    changes = _mirror_changes(measured, estimate, args) if estimate.mirror_active else []
    staging = estimate.per_rank["quantization_staging"]
    fits = estimate.verdict == "fits"
    tp = args.tensor_parallel_size
    if measured.legacy[0] and staging:
        changes.append(f"unset {OFFLOAD}: it keeps each rank's 16-bit shard on the host")
    if staging and not fits and tp > 1 and not measured.load_slots:
        saved = (tp - 1) * staging
        changes.append(
            f"pass --max-parallel-loading-workers 1 (the plugin's load lock makes vLLM honour "
            f"it): one rank stages at a time (-{_gib(saved)})"
        )
    if staging and not fits:
        changes.append(
            "serve a checkpoint quantized ahead of time: no weights are converted on the host"
        )
    if "cgroup_room" in estimate.total and not fits:
        changes.append(
            "raise the container's memory limit (docker run --memory): the room is what it leaves"
        )
    if not fits and not changes:
        changes.append("add host RAM, or serve on fewer GPUs per host")
    return changes


def _device_weight_bytes(ckpt: Checkpoint, args: ServeArgs) -> float:
    """The checkpoint's weights as the device holds them (sym_int4 packs linear weights).

    Without tensor headers every 16-bit weight is taken for a linear layer."""
    weight_bytes = float(ckpt.total_bytes)
    if (args.quantization or "").lower() == "sym_int4":
        if ckpt.tensors:
            linear = sum(
                t.nbytes / 2
                for t in ckpt.tensors
                if t.is_linear_weight and t.dtype in ("BF16", "F16")
            )
        else:
            linear = weight_bytes / 2 if ckpt.dtype in ("BF16", "F16") else 0.0
        weight_bytes = weight_bytes - 2 * linear + linear * SYM_INT4_BYTES_PER_PARAM
    return weight_bytes


def head_notes(config: dict[str, Any], tp: int) -> list[str]:
    """Where the tensor-parallel size does not divide the attention heads, vLLM refuses
    to start (ModelConfig.verify_with_parallel_config; QKVParallelLinear for KV heads,
    which may instead be replicated when TP is a multiple of them)."""
    text = text_config(config)
    section = "text_config" if text is not config else "config.json"
    heads = text.get("num_attention_heads")
    if heads is None:
        return []
    if type(heads) is not int or heads < 1:
        return [f"{section}: num_attention_heads {heads!r} is not a positive integer"]
    notes = []
    if heads % tp:
        notes.append(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads "
            f"({section} num_attention_heads): vLLM refuses to start"
        )
    kv_heads = text.get("num_key_value_heads", heads)
    if type(kv_heads) is not int or kv_heads < 1:
        notes.append(f"{section}: num_key_value_heads {kv_heads!r} is not a positive integer")
    elif kv_heads % tp and tp % kv_heads:
        notes.append(
            f"--tensor-parallel-size {tp} and the {kv_heads} KV heads ({section} "
            "num_key_value_heads) divide neither way: vLLM refuses to start"
        )
    return notes


def _model_notes(ckpt: Checkpoint, args: ServeArgs) -> list[str]:
    """What doctor could not see or refused in the model, and what it assumed instead."""
    notes = [f"could not see {what}" for what in ckpt.unseen]
    notes += [f"refused {what}" for what in ckpt.refused]
    if not ckpt.complete:
        notes.append(f"the checkpoint's size comes from {ckpt.declared_from}, not its headers")
    elif args.params is not None:
        notes.append(f"--params {args.params:,} ignored: the safetensors headers give the size")
    if not ckpt.tensors and (args.quantization or "").lower() in ON_THE_FLY_QUANT:
        notes.append(
            f"no tensor header read: the staged unit is {largest_staged_params(ckpt)[1]}, and "
            "every 16-bit weight is taken for a linear layer"
        )
    return notes + head_notes(ckpt.config, args.tensor_parallel_size)


def _notes(measured: Measurement, estimate: Estimate, args: ServeArgs) -> list[str]:
    tp = args.tensor_parallel_size
    notes = []
    if measured.room.problem:
        notes.append(f"the host's room could not be read ({measured.room.problem}): taken as 0")
    if len(measured.visible) < tp and measured.gpus:
        notes.append(
            f"--tensor-parallel-size {tp} but only {len(measured.visible)} Intel GPU(s) are visible"
        )
    ckpt = measured.ckpt
    if ckpt is not None:
        notes += _model_notes(ckpt, args)
    if (
        ckpt is not None
        and measured.device_bytes
        and _device_weight_bytes(ckpt, args) / tp > estimate.per_rank["device_use"]
    ):
        notes.append("the weights alone exceed the device memory at this utilisation")
    return notes


def _model_section(
    measured: Measurement, estimate: Estimate, args: ServeArgs
) -> dict[str, Any] | None:
    ckpt = measured.ckpt
    if ckpt is None:
        return None
    return {
        "model": measured.model_label,
        "directory": str(ckpt.directory) if ckpt.directory else None,
        "shards": len(ckpt.shards),
        "checkpoint_bytes": ckpt.total_bytes,
        "size_from": "safetensors headers" if ckpt.complete else ckpt.declared_from,
        "checkpoint_dtype": ckpt.dtype,
        "device_weight_bytes_per_rank": _device_weight_bytes(ckpt, args)
        / args.tensor_parallel_size,
        "staging": estimate.staging_why,
    }


def _host_section(snap: Snapshot, room: Room) -> dict[str, Any]:
    return {
        "room": room.bytes,
        "room_detail": room.describe(),
        "mem_total": snap.mem_total,
        "mem_available": snap.mem_available,
        "swap_total": snap.swap_total,
        "swap_free": snap.swap_free,
        "cgroup_current": snap.cgroup_current,
        "cgroup_max": snap.cgroup_max,
    }


def _gpu_section(measured: Measurement) -> dict[str, Any]:
    runtime, guard = measured.runtime, measured.guard
    return {
        "intel_gpus": [
            f"{g.card} {g.pci_slot} 0x{g.device_id:04x} {g.product}" for g in measured.gpus
        ],
        "visible": len(measured.visible),
        "visible_battlemage": measured.visible_battlemage,
        "device_memory_bytes": measured.device_bytes,
        "device_memory_source": measured.device_source,
        "compute_runtime": f"{runtime.version} ({runtime.source})" if runtime else "not found",
        "runtime_in_mirror_range": measured.runtime_affected,
        "level_zero_loader": measured.level_zero_loader or "not found",
        "driver_guard": f"{'applies' if guard.apply else 'does not apply'}: {guard.reason}",
    }


def _plugin_section(settings: Settings) -> dict[str, str]:
    from vllm_xpu_memfix.cli import compat
    from vllm_xpu_memfix.cli.check import sym_int4_layout

    plugin = {key: mode.value for key, mode in settings.modes.items()}
    plugin["enabled"] = str(settings.enabled)
    root = compat.installed_vllm_root()
    plugin["sym_int4"] = sym_int4_layout(root) if root is not None else "vLLM not installed"
    plugin[SELF_CHECK] = int4_self_check.describe(settings.lock_dir)
    return plugin


def diagnose(settings: Settings, args: ServeArgs, environ: Mapping[str, str]) -> Report:
    measured = measure(settings, args, environ)
    estimate = decide(measured, args, environ)
    return Report(
        host=_host_section(measured.snap, measured.room),
        gpus=_gpu_section(measured),
        environment={k: environ[k] for k in RELEVANT_ENV if k in environ},
        plugin=_plugin_section(settings),
        model=_model_section(measured, estimate, args),
        per_rank=estimate.per_rank,
        total=estimate.total,
        verdict=estimate.verdict,
        main_cause=estimate.main_cause,
        changes=advise(measured, estimate, args, environ),
        notes=_notes(measured, estimate, args),
    )


def _gib(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value / GiB:,.1f} GiB" if abs(value) >= GiB else f"{value / 2**20:,.0f} MiB"


def render(report: Report, args: ServeArgs) -> str:
    host, gpus = report.host, report.gpus
    limit = "none" if host["cgroup_max"] is None else _gib(host["cgroup_max"])
    lines = [
        "Host",
        f"  RAM {_gib(host['mem_total'])}, available {_gib(host['mem_available'])}, "
        f"swap {_gib(host['swap_total'])} ({_gib(host['swap_free'])} free), cgroup limit {limit}",
        "GPUs",
        *(f"  {gpu}" for gpu in gpus["intel_gpus"] or ["no Intel GPU found in sysfs"]),
        f"  visible: {gpus['visible']} ({gpus['visible_battlemage']} Battlemage); device memory "
        f"{_gib(gpus['device_memory_bytes'])} ({gpus['device_memory_source']})",
        f"  compute-runtime {gpus['compute_runtime']}; "
        f"Level Zero loader {gpus['level_zero_loader']}",
        f"  driver guard {gpus['driver_guard']}",
        "Environment",
        *(f"  {k}={v}" for k, v in report.environment.items()),
        *([] if report.environment else ["  (none of the relevant variables is set)"]),
        "Plugin switches",
        "  " + ", ".join(f"{k}={v}" for k, v in report.plugin.items() if k not in LONG_LINES),
        *(f"  {key}: {report.plugin[key]}" for key in LONG_LINES if key in report.plugin),
    ]
    if report.model:
        model = report.model
        size_from = (
            "" if model["size_from"] == "safetensors headers" else f" (from {model['size_from']})"
        )
        lines += [
            "Model",
            f"  {model['model']}: {model['shards']} shard(s) read, "
            f"{_gib(model['checkpoint_bytes'])} {model['checkpoint_dtype']}{size_from}; "
            f"weights on each device {_gib(model['device_weight_bytes_per_rank'])}",
        ]
    per_rank = report.per_rank
    lines += [
        f"Per rank (TP {args.tensor_parallel_size}, "
        f"--gpu-memory-utilization {args.gpu_memory_utilization})",
        f"  device memory in use   {_gib(per_rank['device_use'])}",
        f"  host: driver mirror    {_gib(per_rank['driver_mirror'])}",
        f"  host: quant. staging   {_gib(per_rank['quantization_staging'])}",
        f"  host: process baseline {_gib(per_rank['process_baseline'])}",
        "Host total",
        f"  need {_gib(report.total['host_need'])} + checkpoint page cache "
        f"{_gib(report.total['page_cache'])} (reclaimable), "
        f"against the {report.host['room_detail']}",
        f"Verdict: {report.verdict.upper()} (largest part: {report.main_cause})",
        *(f"  - {change}" for change in report.changes),
        *(f"  note: {note}" for note in report.notes),
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    serve = ServeArgs(
        model=args.model or None,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        dtype=args.dtype,
        device_memory_gib=args.device_memory_gib,
        max_parallel_loading_workers=args.max_parallel_loading_workers,
        params=args.params,
    )
    try:
        report = diagnose(config.load(), serve, os.environ)
    except CheckpointError as exc:
        # One line, whatever a hostile file name holds.
        message = str(exc).replace("\r", "\\r").replace("\n", "\\n")
        print(f"doctor: {message}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else render(report, serve))
    return 0
