"""The report's sections on the host, its GPUs, the plugin and the model: the facts (and
the model's estimate) as the fields a person or a script reads."""

from __future__ import annotations

from typing import Any

from vllm_xpu_memfix.cli.doctor.facts import Measurement, ServeArgs
from vllm_xpu_memfix.cli.doctor.predict import Estimate, device_weight_bytes
from vllm_xpu_memfix.cli.doctor.render import SELF_CHECK
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.intel import int4_self_check
from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.memory.snapshot import Snapshot


def model_section(
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
        "device_weight_bytes_per_rank": device_weight_bytes(ckpt, args) / args.tensor_parallel_size,
        "staging": estimate.staging_why,
    }


def host_section(snap: Snapshot, room: Room) -> dict[str, Any]:
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


def gpu_section(measured: Measurement) -> dict[str, Any]:
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


def plugin_section(settings: Settings) -> dict[str, str]:
    from vllm_xpu_memfix.cli import compat
    from vllm_xpu_memfix.cli.check import sym_int4_layout

    plugin = {key: mode.value for key, mode in settings.modes.items()}
    plugin["enabled"] = str(settings.enabled)
    root = compat.installed_vllm_root()
    plugin["sym_int4"] = sym_int4_layout(root) if root is not None else "vLLM not installed"
    plugin[SELF_CHECK] = int4_self_check.describe(settings.lock_dir)
    return plugin
