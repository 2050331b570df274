"""What the serve command will need: host bytes per rank and per cause, against the room
there is, and the verdict. Works on a Measurement alone; reads nothing."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_xpu_memfix.cli.doctor.facts import OFFLOAD, Measurement, ServeArgs
from vllm_xpu_memfix.core.units import STAGING_BYTES_PER_PARAM, GiB
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config

# Host RAM of the vLLM processes themselves, per rank: vllm #50269's maintainers
# call ~15 GB normal on 4x B60 and ~10 GB on one CUDA GPU.
BASELINE_PER_RANK = 3.5 * GiB
# Quantization methods that convert 16-bit weights while loading, through the host.
ON_THE_FLY_QUANT = {"sym_int4", "fp8", "int4", "woq_int4"}
# Device bytes per parameter of a sym_int4 linear weight: 4 bits plus an fp16 scale per 128.
SYM_INT4_BYTES_PER_PARAM = 0.5 + 2 / 128
AT_RISK_SHARE = 0.85
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.\d+\.(?P<proj>\w+)\.weight$")
_SIDE = {
    "gate_proj": "w13",
    "up_proj": "w13",
    "w1": "w13",
    "w3": "w13",
    "down_proj": "w2",
    "w2": "w2",
}


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


def device_weight_bytes(ckpt: Checkpoint, args: ServeArgs) -> float:
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
