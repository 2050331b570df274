"""The report's sections on the host, its GPUs, the plugin and the model: the facts (and
the model's estimate) as the fields a person or a script reads."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from vllm_xpu_memfix.cli.doctor import choices
from vllm_xpu_memfix.cli.doctor.facts import Measurement
from vllm_xpu_memfix.cli.doctor.render import SELF_CHECK
from vllm_xpu_memfix.core.units import GiB, rounded, size
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import catalog, int4_self_check
from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.memory.snapshot import Snapshot
from vllm_xpu_memfix.startup import phases, sizing
from vllm_xpu_memfix.startup.sizing import ServeArgs


def model_section(
    measured: Measurement, outcome: phases.Outcome, args: ServeArgs
) -> dict[str, Any] | None:
    ckpt = measured.ckpt
    if ckpt is None:
        return None
    inputs = outcome.inputs
    return {
        "model": measured.model_label,
        "directory": str(ckpt.directory) if ckpt.directory else None,
        "shards": len(ckpt.shards),
        "quantization": sizing.quantization(ckpt, args),
        "checkpoint_bytes": ckpt.total_bytes,
        "size_from": "safetensors headers" if ckpt.complete else ckpt.declared_from,
        "checkpoint_dtype": ckpt.dtype,
        "device_weight_bytes_per_rank": inputs.weights,  # the high end of the range below
        "bytes_per_weight": asdict(inputs.linear_bytes_per_weight),
        "staging": inputs.load_mode_why if inputs.on_the_fly else "no on-the-fly quantization",
    }


def per_rank_section(outcome: phases.Outcome) -> dict[str, float]:
    """Per rank once the KV cache is allocated: device use, and the host's parts."""
    inputs = outcome.inputs
    at_kv = outcome.phases["kv_cache"]
    return {
        "device_use": at_kv.device or 0.0,
        "host_copy": at_kv.pinned / inputs.host_ranks,
        "quantization_staging": inputs.staging,
        "process_baseline": inputs.baseline,
    }


def total_section(measured: Measurement, outcome: phases.Outcome) -> dict[str, float]:
    snap, ckpt, room = measured.snap, measured.ckpt, measured.room
    total = {
        "host_need": outcome.host_need,
        "page_cache": float(ckpt.total_bytes) if ckpt else 0.0,
        "mem_available": float(snap.mem_available or 0),
        "room": float(room.bytes or 0),
        "swap_free": float(snap.swap_free or 0),
    }
    if room.cgroup.room is not None:
        total["cgroup_room"] = float(room.cgroup.room)
    return total


def host_section(snap: Snapshot, room: Room) -> dict[str, Any]:
    return {
        "room": room.bytes,
        "room_detail": room.describe(GiB),
        "mem_total": snap.mem_total,
        "mem_available": snap.mem_available,
        "swap_total": snap.swap_total,
        "swap_free": snap.swap_free,
        "cgroup_current": snap.cgroup_current,
        "cgroup_max": snap.cgroup_max,
    }


def gpu_section(measured: Measurement) -> dict[str, Any]:
    runtime, guard = measured.runtime, measured.guard
    return {
        "intel_gpus": [
            f"{g.card} {g.pci_slot} 0x{g.device_id:04x} {catalog.product(g.device_id)}"
            for g in measured.gpus
        ],
        "visible": len(measured.visible),
        "visible_battlemage": measured.visible_battlemage,
        "device_memory_bytes": measured.device_bytes,
        "device_memory_source": measured.device_source,
        "compute_runtime": f"{runtime.version} ({runtime.source})"
        if runtime
        else ("not given" if measured.described else "not found"),
        "runtime_pins_host_copy": runtime.pins_host_copy if runtime else None,
        "p2p": measured.p2p,
        "kernel": (measured.kernel.release if measured.kernel else None) or "unknown",
        "level_zero_loader": measured.level_zero_loader or "not found",
        "driver_guard": driver_env.summary(guard),
    }


def plugin_section(measured: Measurement) -> dict[str, str]:
    from vllm_xpu_memfix.cli import compat
    from vllm_xpu_memfix.cli.check import sym_int4_layout

    settings = measured.settings
    if not measured.plugin or settings is None:
        return {"enabled": "False", "installed": "False (judged without the plugin)"}
    plugin = {key: mode.value for key, mode in settings.modes.items()}
    plugin["enabled"] = str(settings.enabled)
    if measured.described is not None:
        plugin["sym_int4"] = measured.int4_layouts_from
        return plugin
    root = compat.installed_vllm_root()
    plugin["sym_int4"] = sym_int4_layout(root) if root is not None else "vLLM not installed"
    plugin[SELF_CHECK] = int4_self_check.describe(settings.lock_dir)
    return plugin


def _gib(value: float | None) -> float | None:
    return None if value is None else rounded(value / GiB, 2)


def phases_section(outcome: phases.Outcome) -> dict[str, dict[str, float | None]]:
    """Per phase: host need summed over the ranks of the host, device need per rank."""
    return {
        name: {"host_gib": _gib(phase.host), "device_gib": _gib(phase.device)}
        for name, phase in outcome.phases.items()
    }


def causes_section(outcome: phases.Outcome) -> list[dict[str, object]]:
    return [{"code": c.code, "gib": rounded(c.gib, 2), "why": c.why} for c in outcome.causes]


def assumed_section(measured: Measurement, args: ServeArgs, outcome: phases.Outcome) -> list[str]:
    """What doctor took where it was not told."""
    assumed = list(measured.assumed)
    assumed += choices.other_vllm_notes(args.not_modelled)
    if args.quantization and choices.quantization_names() is None:
        assumed.append(choices.not_checked(args.quantization))
    if args.max_num_seqs is None:
        assumed.append(f"--max-num-seqs not given: vLLM's {sizing.DEFAULT_MAX_NUM_SEQS}")
    if args.max_num_batched_tokens is None:
        assumed.append(
            f"--max-num-batched-tokens not given: vLLM's {sizing.DEFAULT_BATCHED_TOKENS}"
        )
    inputs = outcome.inputs
    kv = inputs.kv_layout
    if kv is not None and not kv.sampler:
        assumed.append(f"a pooling runner ({kv.source}): no sampler, no sampler warm-up")
    elif measured.ckpt is not None and inputs.burst is None:
        assumed.append("no vocab_size in config.json: the sampler warm-up is not counted")
    assumed += phases.ranged(inputs)
    if inputs.device_bytes is not None:
        assumed.append(
            f"the warm-up adds {size(phases.WARMUP_OUTSIDE_TORCH)} a rank outside torch "
            "(Level Zero modules, oneCCL buffers)"
        )
    return assumed
